"""The ``exclude-devices=`` backend setting: GPUs left to another owner (the device plugin).

Every backend gets it: `create_backends` takes the setting out before the backend's factory sees
it and wraps the backend in `ExcludingBackend`, which leaves the named devices (by DRA device name
or by UUID, joined with ``+``) out of discovery, and so out of the slices, and out of telemetry,
and refuses to prepare them. Unprepare passes through: a claim prepared before the exclusion
must still be released.

A device consuming a counter set carried by an excluded device is excluded too (the MIG
placements of an excluded partitionable GPU): its counter set is no longer published, and the
API server refuses a device that consumes from a set the pool does not define.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from agent.core.backend import Backend, ClaimRef, ContainerEdits, DeviceTelemetry, HealthSink
from agent.core.errors import ConfigError, DeviceNotFoundError
from agent.core.logs import log_fields
from agent.core.model import Device

log = logging.getLogger("agent.core.exclusion")

EXCLUDE_SETTING = "exclude-devices"


def parse_exclusions(text: str) -> frozenset[str]:
    """``gpu-0+GPU-1b2c...`` -> the names and UUIDs; empty text excludes nothing."""
    names = [n.strip() for n in text.split("+")] if text.strip() else []
    if any(not n or any(c.isspace() for c in n) for n in names):
        raise ConfigError(
            "--backend", f"{EXCLUDE_SETTING}={text}", "device names or UUIDs joined with '+' (gpu-0+gpu-1)"
        )
    return frozenset(names)


class ExcludingBackend:
    """A `Backend` that hides the devices named in `excluded` (names or UUIDs) of `inner`."""

    def __init__(self, inner: Backend, excluded: frozenset[str]) -> None:
        self.inner = inner
        self.excluded = excluded
        self._hidden: frozenset[str] = frozenset()
        self._reported: frozenset[str] | None = None

    @property
    def driver_name(self) -> str:
        return self.inner.driver_name

    def __getattr__(self, name: str) -> Any:
        # Optional protocols (health_conditions...) and backend extras stay visible.
        return getattr(self.inner, name)

    async def start(self) -> None:
        await self.inner.start()

    async def stop(self) -> None:
        await self.inner.stop()

    async def discover(self) -> Sequence[Device]:
        devices = await self.inner.discover()
        named = [d for d in devices if d.name in self.excluded or d.uuid in self.excluded]
        gone_sets = {s.name for d in named for s in d.counter_sets}
        hidden = frozenset(d.name for d in named) | frozenset(
            d.name for d in devices if any(c.counter_set in gone_sets for c in d.consumes_counters)
        )
        self._hidden = hidden
        if hidden != self._reported:
            self._reported = hidden
            matched = {k for d in devices for k in (d.name, d.uuid) if d.name in hidden}
            log.info(
                "devices excluded from our slices",
                extra=log_fields(driver=self.driver_name, devices="+".join(sorted(hidden)) or "none"),
            )
            if unknown := sorted(self.excluded - matched):
                log.warning(
                    f"{EXCLUDE_SETTING} names no device of this node",
                    extra=log_fields(driver=self.driver_name, names="+".join(unknown)),
                )
        return [d for d in devices if d.name not in hidden]

    async def monitor_health(self, sink: HealthSink) -> None:
        await self.inner.monitor_health(sink)

    async def prepare(self, device: str, claim: ClaimRef) -> ContainerEdits:
        if device in self._hidden or device in self.excluded:
            raise DeviceNotFoundError(self.driver_name, device)
        return await self.inner.prepare(device, claim)

    async def unprepare(self, device: str, claim: ClaimRef) -> None:
        await self.inner.unprepare(device, claim)

    async def telemetry(self) -> Sequence[DeviceTelemetry]:
        return [t for t in await self.inner.telemetry() if t.device not in self._hidden]


def exclude_devices(backend: Backend, excluded: frozenset[str]) -> Backend:
    """`backend` itself when nothing is excluded, else wrapped in `ExcludingBackend`."""
    return ExcludingBackend(backend, excluded) if excluded else backend
