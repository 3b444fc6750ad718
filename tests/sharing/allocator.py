"""The scheduler's arithmetic for shares of one device, as a real 1.36 scheduler did it.

From ``../shared/reference/dra-1.36-verified-shapes.md`` (section 1): every capacity of an
``allowMultipleAllocations`` device is consumed by every claim on it; a request is rounded up to
the policy's step (or the next valid value), an omitted one consumes the policy's default, or the
whole capacity without a policy; a request above the policy's max or the capacity, or for a
capacity the device does not publish, makes the device ineligible; and the claims' consumption
must fit in each capacity. ``CapacityRequirements.Requests`` in
``K/staging/src/k8s.io/api/resource/v1/types.go`` documents the same rules.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

from agent.core.quantity import Quantity


def _q(text: object) -> Fraction:
    return Quantity.parse(str(text)).value


def consume(entry: Mapping[str, Any], requested: object | None) -> Fraction | None:
    """What one claim consumes of one capacity `entry` (``{value, requestPolicy}``); None: ineligible."""
    capacity = _q(entry["value"])
    policy = entry.get("requestPolicy")
    if policy is None:
        if requested is None:
            return capacity
        wanted = _q(requested)
        return wanted if wanted <= capacity else None
    if requested is None:
        return _q(policy["default"])
    wanted = _q(requested)
    if "validValues" in policy:
        return next((v for v in (_q(x) for x in policy["validValues"]) if v >= wanted), None)
    valid_range = policy.get("validRange")
    if valid_range is None:
        return wanted if wanted <= capacity else None
    low = _q(valid_range["min"])
    value = max(wanted, low)
    if "step" in valid_range:
        step = _q(valid_range["step"])
        value = low + -(-(value - low) // step) * step
    high = _q(valid_range["max"]) if "max" in valid_range else capacity
    return value if value <= min(high, capacity) else None


def allocate(device: Mapping[str, Any], claims: Sequence[Mapping[str, str]]) -> list[bool]:
    """Claims (capacity requests) in order on one shareable slice device: which got a share."""
    capacities: Mapping[str, Any] = device.get("capacity") or {}
    used = {name: Fraction(0) for name in capacities}
    placed = []
    for requests in claims:
        if set(requests) - set(capacities):
            placed.append(False)  # a capacity the device does not publish
            continue
        wants = {name: consume(entry, requests.get(name)) for name, entry in capacities.items()}
        fits = all(
            want is not None and used[name] + want <= _q(capacities[name]["value"])
            for name, want in wants.items()
        )
        if fits:
            for name, want in wants.items():
                assert want is not None
                used[name] += want
        placed.append(fits)
    return placed
