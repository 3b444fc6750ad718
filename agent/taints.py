"""Health conditions to device taints: the policy table and its defaults.

(Skeleton: the full policy, user overrides and limits are built by the health/taints work.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agent.model import Device, Severity

EFFECT_NO_SCHEDULE = "NoSchedule"
EFFECT_NO_EXECUTE = "NoExecute"
EFFECT_NONE = "None"


@dataclass(frozen=True)
class DeviceTaint:
    """A taint on one device, as written to ``spec.devices[].taints``."""

    key: str
    effect: str
    value: str = ""
    time_added: str = ""


@dataclass(frozen=True)
class ClusterTaintSupport:
    """What the cluster accepts: 4 taints per device and no ``None`` effect before 1.35."""

    max_taints_per_device: int = 4
    none_effect: bool = False


class TaintPolicy:
    """Maps health conditions to taints (minimal: every warning/critical condition -> NoSchedule)."""

    @classmethod
    def default(cls) -> TaintPolicy:
        return cls()

    @classmethod
    def load(cls, path: object) -> TaintPolicy:
        return cls()

    def taints_for(self, device: Device, support: ClusterTaintSupport) -> tuple[DeviceTaint, ...]:
        """The taints of one device, most severe first, within the cluster's limit."""
        out = [
            DeviceTaint(f"{device.driver}/{c.condition}", EFFECT_NO_SCHEDULE, c.value)
            for c in sorted(device.health.conditions, key=lambda c: -c.severity)
            if c.severity >= Severity.WARNING
        ]
        return tuple(out[: support.max_taints_per_device])

    def taint_map(
        self, devices: Sequence[Device], support: ClusterTaintSupport
    ) -> dict[str, tuple[DeviceTaint, ...]]:
        """Taints by device name, for tainted devices only."""
        return {d.name: t for d in devices if (t := self.taints_for(d, support))}
