"""Fault injection into the fake backends of one `create_backend` call (`FaultInjector`): finds the
device a fault names, keeps what is active (for ``fake list``), hands `HealthEvent`s to the
backend's health monitor and serves the control socket (`backends.fake.control`)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import anyio

from agent.core.backend import ConditionKind, HealthEvent
from agent.core.clock import Clock, SystemClock
from agent.core.model import Severity
from backends.fake.conditions import CONDITION_NAME, ActiveFault, FaultError, FaultTarget, condition_defaults


@dataclass
class FaultInjector:
    """Injects faults into the fake backends of one `create_backend` call; serves the control socket."""

    clock: Clock = field(default_factory=SystemClock)
    control_path: str = ""
    backends: dict[str, FaultTarget] = field(default_factory=dict)
    _serving: bool = field(default=False, init=False)
    _serving_done: anyio.Event | None = field(default=None, init=False)

    def add(self, backend: FaultTarget) -> None:
        self.backends[backend.driver_name] = backend

    # -- lookup -------------------------------------------------------------------------------

    def find(self, device: str, driver: str | None = None) -> FaultTarget:
        """The backend that has `device`, or `FaultError` saying what to do."""
        if driver is not None:
            backend = self.backends.get(driver)
            if backend is None:
                raise FaultError(f"no fake driver {driver!r}; drivers are {', '.join(sorted(self.backends))}")
            if not backend.has(device):
                raise FaultError(
                    f"driver {driver!r} has no device {device!r}; see 'dra-agent fake list' for the devices"
                )
            return backend
        found = [b for b in self.backends.values() if b.has(device)]
        if not found:
            raise FaultError(
                f"no device {device!r} on any fake driver; run 'dra-agent fake list' to see the devices"
            )
        if len(found) > 1:
            names = ", ".join(sorted(b.driver_name for b in found))
            raise FaultError(
                f"device {device!r} exists on several drivers ({names}); choose one with --driver"
            )
        return found[0]

    # -- the FaultController protocol ------------------------------------------------------------

    async def inject(
        self,
        device: str,
        condition: str,
        value: str = "",
        *,
        driver: str | None = None,
        severity: Severity | None = None,
        kind: ConditionKind | None = None,
        message: str = "",
    ) -> list[str]:
        """Report `condition` on `device`; returns the affected ``driver/device`` names."""
        return self.inject_now(
            device, condition, value, driver=driver, severity=severity, kind=kind, message=message
        )

    def inject_now(
        self,
        device: str,
        condition: str,
        value: str = "",
        *,
        driver: str | None = None,
        severity: Severity | None = None,
        kind: ConditionKind | None = None,
        message: str = "",
    ) -> list[str]:
        """Synchronous `inject` (cheap enough for storms of thousands per second)."""
        if not CONDITION_NAME.match(condition):
            raise FaultError(
                f"condition {condition!r} must be lower-case letters, digits and '-' (e.g. xid, gpu-lost)"
            )
        if condition == "gpu-lost":
            return self.lose_now(device, driver=driver)
        backend = self.find(device, driver)
        default_severity, default_kind = condition_defaults(condition, value)
        severity = severity or default_severity
        kind = kind or default_kind
        now = self.clock.time()
        key = (device, condition, value)
        active = backend.active.get(key)
        if active is None:
            backend.active[key] = ActiveFault(device, condition, value, severity, kind, now)
        else:
            active.count += 1
            active.severity, active.kind = severity, kind
        backend.emit(HealthEvent(device, condition, severity, value, message, kind, at=now))
        return [f"{backend.driver_name}/{device}"]

    async def lose(self, device: str, *, driver: str | None = None) -> list[str]:
        """Make the GPU of `device` fall off the bus: every device sharing it is lost."""
        return self.lose_now(device, driver=driver)

    def lose_now(self, device: str, *, driver: str | None = None) -> list[str]:
        backend = self.find(device, driver)
        now = self.clock.time()
        affected = []
        for name in backend.group_of(device):
            backend.lost.add(name)
            backend.active.setdefault(
                (name, "gpu-lost", ""),
                ActiveFault(name, "gpu-lost", "", Severity.CRITICAL, ConditionKind.STATE, now),
            )
            backend.emit(
                HealthEvent(
                    name,
                    "gpu-lost",
                    Severity.CRITICAL,
                    message="GPU fell off the bus",
                    kind=ConditionKind.STATE,
                    at=now,
                )
            )
            affected.append(f"{backend.driver_name}/{name}")
        return affected

    async def recover(
        self, device: str, condition: str | None = None, *, driver: str | None = None
    ) -> list[str]:
        """Clear `condition` (or every condition) of `device`; a lost GPU comes back."""
        backend = self.find(device, driver)
        now = self.clock.time()
        names = [device]
        if device in backend.lost and condition in (None, "gpu-lost"):
            names = [n for n in backend.group_of(device) if n in backend.lost]
            backend.lost.difference_update(names)
        cleared: list[str] = []
        for name in names:
            keys = [k for k in backend.active if k[0] == name and condition in (None, k[1])]
            for key in keys:
                fault = backend.active.pop(key)
                backend.emit(
                    HealthEvent(
                        name, fault.condition, fault.severity, fault.value, "recovered", fault.kind, True, now
                    )
                )
            if keys:
                cleared.append(f"{backend.driver_name}/{name}")
        if condition is not None and not cleared:
            # Clear it anyway: the agent may hold a condition this process no longer remembers.
            severity, kind = condition_defaults(condition, "")
            backend.emit(HealthEvent(device, condition, severity, "", "recovered", kind, True, now))
            cleared.append(f"{backend.driver_name}/{device}")
        return cleared

    def snapshot(self) -> list[dict[str, object]]:
        """Every device with its state and injected faults, for ``fake list``."""
        rows: list[dict[str, object]] = []
        for driver, backend in sorted(self.backends.items()):
            for name in sorted(backend.all_devices()):
                faults = [
                    {
                        "condition": f.condition,
                        "value": f.value,
                        "severity": f.severity.label,
                        "kind": f.kind.value,
                        "since": f.since,
                        "count": f.count,
                    }
                    for (dev, _, _), f in sorted(backend.active.items())
                    if dev == name
                ]
                lost = name in backend.lost
                rows.append({"driver": driver, "device": name, "lost": lost, "faults": faults})
        return rows

    # -- control socket ---------------------------------------------------------------------------

    async def serve_control(self) -> None:
        """Serve the control socket while this task runs; one server per injector (others wait)."""
        if not self.control_path:
            await anyio.sleep_forever()
        # Imported in a worker thread: the event loop goes on starting the kubelet sockets (~7 ms).
        await anyio.to_thread.run_sync(importlib.import_module, "backends.fake.control")
        from backends.fake.control import serve_control

        while True:
            if self._serving and self._serving_done is not None:
                await self._serving_done.wait()
                continue
            self._serving, self._serving_done = True, anyio.Event()
            try:
                await serve_control(self, self.control_path, self.clock)
            finally:
                self._serving = False
                self._serving_done.set()

    def remove_stale_socket(self) -> None:
        """Remove the control socket file when no server holds it (called on stop)."""
        from backends.fake.control import unlink_socket

        if self.control_path and not self._serving:
            unlink_socket(self.control_path)
