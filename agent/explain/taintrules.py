"""DeviceTaintRules as the scheduler applies them: an admin's rule taints every device its
selector matches, on top of the taints the driver published.

Upstream: staging/src/k8s.io/api/resource/v1alpha3/types.go (DeviceTaintRule, DeviceTaintSelector:
``driver``, ``pool`` and ``device``, each optional, all must match; an empty selector matches
every device, a missing one none) and the scheduler's use of them
(staging/src/k8s.io/dynamic-resource-allocation/resourceslice/tracker: rules add their taint to
the matching devices). GA and on by default in 1.37; beta and off in 1.36.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

RULE_FIELD = "deviceTaintRule"
"""Set on a taint a rule added, to name the rule in the explanation (not an API field)."""


def _matches(selector: Mapping[str, Any], driver: str, pool: str, device: str) -> bool:
    return all(
        selector.get(field) in (None, value)
        for field, value in (("driver", driver), ("pool", pool), ("device", device))
    )


def rule_taints(
    rules: Sequence[Mapping[str, Any]], driver: str, pool: str, device: str
) -> list[dict[str, Any]]:
    """The taints `rules` put on one device, each naming its rule."""
    taints = []
    for rule in rules:
        spec = rule.get("spec") or {}
        selector = spec.get("deviceSelector")
        taint = spec.get("taint")
        if not isinstance(selector, Mapping) or not isinstance(taint, Mapping):
            continue
        if _matches(selector, driver, pool, device):
            name = str((rule.get("metadata") or {}).get("name", ""))
            taints.append({**taint, RULE_FIELD: name})
    return taints


def apply_rules(
    slices: Sequence[Mapping[str, Any]], rules: Sequence[Mapping[str, Any]]
) -> list[Mapping[str, Any]]:
    """`slices` with each device's taints extended by the rules' (the slices themselves unchanged)."""
    if not rules:
        return list(slices)
    out: list[Mapping[str, Any]] = []
    for piece in slices:
        spec = piece.get("spec") or {}
        driver, pool = str(spec.get("driver", "")), str((spec.get("pool") or {}).get("name", ""))
        devices = []
        for entry in spec.get("devices") or []:
            if not isinstance(entry, Mapping):
                devices.append(entry)
                continue
            added = rule_taints(rules, driver, pool, str(entry.get("name", "")))
            if not added:
                devices.append(entry)
                continue
            if "basic" in entry and isinstance(entry["basic"], Mapping):
                body = entry["basic"]
                taints = [*(body.get("taints") or []), *added]
                devices.append({**entry, "basic": {**body, "taints": taints}})
            else:
                devices.append({**entry, "taints": [*(entry.get("taints") or []), *added]})
        out.append({**piece, "spec": {**spec, "devices": devices}})
    return out
