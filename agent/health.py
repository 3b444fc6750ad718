"""Health tracking: backend health events to device health, with hold time for recovery.

(Minimal version; extended with flap damping by the health/taints work.)
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.backend import ConditionKind, HealthEvent
from agent.clock import Clock
from agent.inventory import Inventory
from agent.model import DeviceHealth, HealthCondition


@dataclass
class _Active:
    condition: HealthCondition
    kind: ConditionKind
    last_seen: float
    cleared_at: float | None = None


class HealthTracker:
    """Keeps the active conditions of one driver's devices and writes their health to the inventory."""

    def __init__(self, inventory: Inventory, clock: Clock, hold_seconds: float = 60.0) -> None:
        self._inventory = inventory
        self._clock = clock
        self._hold = hold_seconds
        self._active: dict[tuple[str, str, str], _Active] = {}

    async def handle(self, event: HealthEvent) -> None:
        """The `HealthSink` given to the backend."""
        now = event.at if event.at is not None else self._clock.time()
        key = (event.device, event.condition, event.value)
        if event.cleared:
            if key in self._active:
                self._active[key].cleared_at = now
        else:
            current = self._active.get(key)
            since = current.condition.since if current else now
            self._active[key] = _Active(
                HealthCondition(event.condition, event.severity, event.value, event.message, since),
                event.kind,
                now,
            )
        self._publish()

    def expire(self) -> None:
        """Drop conditions whose hold time has passed."""
        now = self._clock.time()
        for key, active in list(self._active.items()):
            start = (
                active.cleared_at
                if active.cleared_at is not None
                else (active.last_seen if active.kind is ConditionKind.EVENT else None)
            )
            if start is not None and now - start >= self._hold:
                del self._active[key]
        self._publish()

    async def run(self) -> None:
        """Expire conditions until cancelled."""
        while True:
            await self._clock.sleep(min(1.0, max(self._hold / 10, 0.01)))
            self.expire()

    def _publish(self) -> None:
        by_device: dict[str, list[HealthCondition]] = {}
        for (device, _, _), active in self._active.items():
            by_device.setdefault(device, []).append(active.condition)
        self._inventory.set_health({d: DeviceHealth(tuple(c)) for d, c in by_device.items()})
