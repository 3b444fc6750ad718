"""This node's slice devices, as explain sees them: driver, pool, name and the device entry."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SliceDevice:
    """One device of one of this node's slices."""

    driver: str
    pool: str
    name: str
    body: Mapping[str, Any]
    """The slice's device entry (v1 shape; v1beta1's ``basic`` is unwrapped)."""

    @property
    def id(self) -> str:
        return f"{self.driver}/{self.pool}/{self.name}"


def slice_devices(slices: Sequence[Mapping[str, Any]]) -> list[SliceDevice]:
    """The devices of `slices`, sorted by driver, pool and name."""
    found = []
    for s in slices:
        spec = s.get("spec") or {}
        driver, pool = str(spec.get("driver", "")), str((spec.get("pool") or {}).get("name", ""))
        for d in spec.get("devices") or []:
            if isinstance(d, Mapping):
                body = d.get("basic", d)
                found.append(
                    SliceDevice(driver, pool, str(d.get("name", "")), {**body, "name": d.get("name")})
                )
    return sorted(found, key=lambda d: (d.driver, d.pool, d.name))
