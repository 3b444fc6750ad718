"""Devices that rediscovery no longer finds stay published, with ``gpu-lost``, until they answer.

A GPU that falls off the bus may vanish from the vendor library's enumeration. Dropping it from
the slice would hide the loss (no taint, no alert: it simply is not there) and, for a pod that
holds it, turn a failure into a silent disappearance. So a device whose physical GPU (its
``parent``, or itself) is no longer found at all is kept as last discovered and gets the STATE
condition ``gpu-lost``; it is cleared when the device is found again. A device whose GPU is
still there (a MIG device or partition removed by a reconfiguration) goes, as before.

An operator retires a GPU for good by restarting the agent pod once the GPU is removed: a new
agent process publishes what it discovers (the held conditions of a device it does not find are
forgotten after the hold time).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from agent.core.backend import GPU_LOST, ConditionKind, HealthEvent
from agent.core.logs import log_fields
from agent.core.model import Device, Severity

log = logging.getLogger("agent.health.vanished")

MESSAGE = "not found by rediscovery: kept published until it answers again"


def _gpu(device: Device) -> str:
    return device.parent or device.name


class VanishedDevices:
    """Which devices of one driver are kept published although rediscovery no longer finds them."""

    def __init__(self, driver: str) -> None:
        self.driver = driver
        self.kept: dict[str, Device] = {}

    def merge(
        self, published: Sequence[Device], discovered: Sequence[Device], at: float
    ) -> tuple[list[Device], list[HealthEvent]]:
        """The devices to publish (`discovered` plus those kept) and the ``gpu-lost`` events
        (raised for the newly kept, cleared for those found again)."""
        found = {d.name for d in discovered}
        gpus = {_gpu(d) for d in discovered}
        events: list[HealthEvent] = []
        for name in [n for n in self.kept if n in found]:
            del self.kept[name]
            log.info("device found again", extra=log_fields(driver=self.driver, device=name))
            events.append(self._event(name, at, cleared=True))
        for device in published:
            if device.name in found or device.name in self.kept or _gpu(device) in gpus:
                continue
            self.kept[device.name] = device
            log.error(
                "device no longer found; kept published with gpu-lost",
                extra=log_fields(driver=self.driver, device=device.name, gpu=_gpu(device)),
            )
            events.append(self._event(device.name, at, cleared=False))
        return [*discovered, *self.kept.values()], events

    @staticmethod
    def _event(device: str, at: float, *, cleared: bool) -> HealthEvent:
        return HealthEvent(
            device, GPU_LOST, Severity.CRITICAL, "", MESSAGE, ConditionKind.STATE, cleared=cleared, at=at
        )
