"""Which XIDs are the application's (informational) and which the GPU's (critical).

The default informational set is NVIDIA's DRA driver's ``xidsToSkip`` (device_health.go); the
settings ``ignored-xids`` and ``critical-xids`` add to it and take from it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from agent.core.errors import ConfigError
from agent.core.model import Severity

# XIDs caused by the application (illegal address, MMU fault in user code, ...), not the GPU.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})


def parse_xids(option: str, value: str) -> frozenset[int]:
    """``"79+94"``, ``"79,94"`` or ``"79 94"`` -> {79, 94} (use ``+`` inside ``--backend``)."""
    items = [p for p in re.split(r"[,+\s|/]+", value.strip()) if p]
    try:
        xids = frozenset(int(p) for p in items)
    except ValueError as error:
        raise ConfigError(option, value, "XID numbers separated by '+' or ',' such as 79+94") from error
    if any(x < 0 for x in xids):
        raise ConfigError(option, value, "non-negative XID numbers")
    return xids


@dataclass(frozen=True)
class XidPolicy:
    """Which XIDs are informational (application errors) rather than critical."""

    informational: frozenset[int] = APPLICATION_XIDS

    @classmethod
    def from_settings(cls, settings: Mapping[str, str]) -> XidPolicy:
        ignored = parse_xids("ignored-xids", settings.get("ignored-xids", ""))
        critical = parse_xids("critical-xids", settings.get("critical-xids", ""))
        return cls((APPLICATION_XIDS | ignored) - critical)

    def severity(self, xid: int) -> Severity:
        return Severity.INFO if xid in self.informational else Severity.CRITICAL
