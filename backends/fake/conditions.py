"""What the fake backend and its fault injector share, so neither imports the other: the conditions a
fake reports (`CONDITIONS`: the real backends' names, severities and kinds, so the taint policy sees
the same shapes), an injected fault, its error, and what the injector needs of a backend."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

from agent.core.backend import ConditionKind, HealthEvent
from agent.core.errors import BackendError
from agent.core.model import Device, Severity

CONDITIONS: dict[str, tuple[Severity, ConditionKind]] = {
    # NVIDIA
    "xid": (Severity.CRITICAL, ConditionKind.EVENT),
    "gpu-lost": (Severity.CRITICAL, ConditionKind.STATE),
    "ecc-uncorrectable": (Severity.CRITICAL, ConditionKind.EVENT),
    "unmonitored": (Severity.INFO, ConditionKind.STATE),
    # AMD
    "gpu-reset": (Severity.CRITICAL, ConditionKind.EVENT),
    "ring-hang": (Severity.CRITICAL, ConditionKind.EVENT),
    "thermal-throttle": (Severity.INFO, ConditionKind.EVENT),
}
"""Condition -> (default severity, kind), as the NVIDIA and AMD backends report them."""

APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})
"""XIDs caused by the application, not the GPU: informational by default."""

UNKNOWN_CONDITION = (Severity.WARNING, ConditionKind.EVENT)
CONDITION_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


class FaultError(BackendError):
    """A fault-injection request cannot be carried out (unknown device, bad condition...)."""


def condition_defaults(condition: str, value: str) -> tuple[Severity, ConditionKind]:
    """The severity and kind a real backend would report for `condition` with `value`."""
    severity, kind = CONDITIONS.get(condition, UNKNOWN_CONDITION)
    if condition == "xid" and value.isdigit() and int(value) in APPLICATION_XIDS:
        severity = Severity.INFO
    return severity, kind


@dataclass
class ActiveFault:
    """A condition injected and not yet recovered."""

    device: str
    condition: str
    value: str
    severity: Severity
    kind: ConditionKind
    since: float
    count: int = 1


class FaultTarget(Protocol):
    """What the fault injector needs of a fake backend (`backends.fake.backend.FakeBackend`)."""

    lost: set[str]
    active: dict[tuple[str, str, str], ActiveFault]

    @property
    def driver_name(self) -> str: ...

    def has(self, device: str) -> bool: ...

    def all_devices(self) -> dict[str, Device]: ...

    def group_of(self, device: str) -> list[str]: ...

    def emit(self, event: HealthEvent) -> None: ...

    def lose_at_first_pass(self, device: str) -> None: ...
