"""The live state of one driver's devices: what the backend discovered, with their health.

Data flows one way: the backend's discovery and the health tracker write here; the slice
publisher, the kubelet health stream and the metrics read from here and wait for changes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from types import MappingProxyType

import anyio

from agent.core.model import HEALTHY, Device, DeviceHealth


class Inventory:
    """Devices of one driver with their health; readers wait on `wait_changed`.

    Taints are not stored: the Kubernetes side derives them from the health conditions with
    the taint policy and what the cluster accepts (`agent.health.taints`).
    """

    def __init__(self, driver: str) -> None:
        self.driver = driver
        self._devices: dict[str, Device] = {}
        self._health: dict[str, DeviceHealth] = {}
        self._version = 0
        self._changed = anyio.Event()
        self.discovered = False

    @property
    def version(self) -> int:
        """Increases on every change."""
        return self._version

    def set_devices(self, devices: Sequence[Device]) -> None:
        """Replace the discovered devices (the health of vanished devices is dropped)."""
        new = {d.name: d for d in devices}
        first = not self.discovered
        self.discovered = True
        if new != self._devices or first:
            self._devices = new
            self._health = {k: v for k, v in self._health.items() if k in new}
            self._bump()

    def set_health(self, health: Mapping[str, DeviceHealth]) -> None:
        """Replace the health of the devices (keys of unknown devices are ignored)."""
        new_health = {k: v for k, v in health.items() if k in self._devices and v != HEALTHY}
        if new_health != self._health:
            self._health = new_health
            self._bump()

    def devices(self) -> tuple[Device, ...]:
        """The devices with their current health, in discovery order (the backend's order is the
        order the scheduler is offered a GPU's partitions in: `agent.kube.slices.offer_order`)."""
        return tuple(
            dataclasses.replace(d, health=self._health[d.name]) if d.name in self._health else d
            for d in self._devices.values()
        )

    def discovered_devices(self) -> tuple[Device, ...]:
        """The devices as discovered (their health not applied), in discovery order."""
        return tuple(self._devices.values())

    def device(self, name: str) -> Device | None:
        """One discovered device as discovered (its health not applied: see `devices`)."""
        return self._devices.get(name)

    def device_names(self) -> frozenset[str]:
        return frozenset(self._devices)

    def health(self) -> Mapping[str, DeviceHealth]:
        """Health of the devices that are not plainly healthy."""
        return MappingProxyType(dict(self._health))

    async def wait_changed(self, seen_version: int) -> int:
        """Return the current version once it differs from `seen_version`."""
        while self._version == seen_version:
            await self._changed.wait()
        return self._version

    def _bump(self) -> None:
        self._version += 1
        event, self._changed = self._changed, anyio.Event()
        event.set()
