"""Whether a device's capacity and shared counters leave room for a request, worded for explain.

Plain capacity (allocator_stable.go: the request's capacity within the device's), consumable
capacity of shared devices (structured/internal/experimental/consumable_capacity.go:
``calculateConsumedQuantity``, ``violatesPolicy``, ``cmpRequestOverCapacity``) and the shared
counters of partitionable devices (allocator_experimental.go).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from agent.core.errors import QuantityError
from agent.core.quantity import Quantity
from agent.explain.devices import SliceDevice


def _capacity_reasons(request: Mapping[str, Any], device: SliceDevice) -> list[str]:
    wanted = (request.get("capacity") or {}).get("requests") or {}
    capacity = device.body.get("capacity") or {}
    reasons = []
    for name, text in wanted.items():
        entry = capacity.get(name)
        if entry is None and "/" in name and name.split("/", 1)[0] == device.driver:
            entry = capacity.get(name.split("/", 1)[1])
        if entry is None:
            reasons.append(f"capacity {name}: the device has none (request wants {text})")
            continue
        have = entry.get("value") if isinstance(entry, Mapping) else entry
        try:
            if Quantity.parse(str(have)).value < Quantity.parse(str(text)).value:
                reasons.append(f"capacity {name} too small: the device has {have}, the request wants {text}")
        except QuantityError:
            reasons.append(f"capacity {name}: cannot compare {have!r} with {text!r}")
    return reasons


def _quantity(value: Any) -> Quantity | None:
    if isinstance(value, Mapping):
        value = value.get("value")
    if value is None:
        return None
    try:
        return Quantity.parse(str(value))
    except QuantityError:
        return None


def _show(value: Fraction, like: Quantity) -> str:
    return Quantity(value, like.format).canonical()


def _capacity_key(name: str, driver: str) -> str:
    """A capacity name, qualified with the driver's domain when it has none."""
    return name if "/" in name else f"{driver}/{name}"


@dataclass
class _Usage:
    """What the other claims hold on this node's devices."""

    owners: dict[tuple[str, str, str], list[str]] = field(default_factory=dict)
    consumed: dict[tuple[str, str, str], dict[str, Fraction]] = field(default_factory=dict)

    def add(self, owner: str, result: Mapping[str, Any]) -> None:
        key = (str(result.get("driver")), str(result.get("pool")), str(result.get("device")))
        self.owners.setdefault(key, []).append(owner)
        taken = self.consumed.setdefault(key, {})
        for name, value in (result.get("consumedCapacity") or {}).items():
            q = _quantity(value)
            if q is not None:
                cap = _capacity_key(str(name), key[0])
                taken[cap] = taken.get(cap, Fraction(0)) + q.value


def _consumed_share(requested: Quantity | None, total: Quantity, policy: Mapping[str, Any]) -> Fraction:
    """calculateConsumedQuantity: what one allocation takes of a capacity under its request policy."""
    if requested is None:
        default = _quantity(policy.get("default"))
        return default.value if default is not None else total.value
    valid_range = policy.get("validRange") or {}
    low = _quantity(valid_range.get("min"))
    if low is not None:
        if requested.value < low.value:
            return low.value
        step = _quantity(valid_range.get("step"))
        if step is None or step.value <= 0:
            return requested.value
        steps = -((low.value - requested.value) // step.value)  # ceil
        return low.value + steps * step.value
    for valid in policy.get("validValues") or []:
        q = _quantity(valid)
        if q is not None and requested.value <= q.value:
            return q.value
    return requested.value


def _policy_violation(consumed: Fraction, policy: Mapping[str, Any], like: Quantity) -> str | None:
    """violatesPolicy, worded: why a share of this size is not allowed (None when it is)."""
    default = _quantity(policy.get("default"))
    if default is not None and consumed == default.value:
        return None
    valid_range = policy.get("validRange")
    if valid_range:
        high = _quantity(valid_range.get("max"))
        if high is not None and consumed > high.value:
            return f"more than the device's maximum of {high.canonical()} per allocation"
        step, low = _quantity(valid_range.get("step")), _quantity(valid_range.get("min"))
        if step is not None and step.value > 0 and (consumed - (low.value if low else 0)) % step.value:
            return f"not a multiple of the device's step {step.canonical()}"
        return None
    values = [q for q in (_quantity(v) for v in policy.get("validValues") or []) if q is not None]
    if values and all(consumed != q.value for q in values):
        shown = ", ".join(q.canonical() for q in values)
        return f"not one of the device's valid values ({shown})"
    return None


def _shared_capacity_reasons(request: Mapping[str, Any], device: SliceDevice, usage: _Usage) -> list[str]:
    """cmpRequestOverCapacity for a device with allowMultipleAllocations: the capacity left."""
    capacity = {
        _capacity_key(str(n), device.driver): v for n, v in (device.body.get("capacity") or {}).items()
    }
    wanted: dict[str, Quantity] = {}
    reasons = []
    for name, text in ((request.get("capacity") or {}).get("requests") or {}).items():
        key = _capacity_key(str(name), device.driver)
        q = _quantity(text)
        if key not in capacity:
            reasons.append(f"capacity {name}: the device has none (request wants {text})")
        elif q is None:
            reasons.append(f"capacity {name}: {text!r} is not a quantity")
        else:
            wanted[key] = q
    if reasons:
        return reasons
    taken = usage.consumed.get((device.driver, device.pool, device.name), {})
    for key, entry in sorted(capacity.items()):
        total = _quantity(entry)
        if total is None:
            continue
        policy = (entry.get("requestPolicy") if isinstance(entry, Mapping) else None) or {}
        requested = wanted.get(key)
        share = _consumed_share(requested, total, policy)
        name = key.rpartition("/")[2] if key.startswith(device.driver + "/") else key
        if requested is None:
            asked = f"not requested, an allocation takes {_show(share, total)}"
        elif share != requested.value:
            rounded = _show(share, total)
            asked = f"requested {requested.canonical()}, rounded up to {rounded} by the request policy"
        else:
            asked = f"requested {requested.canonical()}"
        violation = _policy_violation(share, policy, total)
        if violation is not None:
            reasons.append(f"{name}: {asked}: {violation}")
            continue
        left = total.value - taken.get(key, Fraction(0))
        if share > left:
            reasons.append(
                f"{name}: {asked}, {_show(max(left, Fraction(0)), total)} left of {total.canonical()}"
            )
    return reasons


def _counter_sets(slices: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str, str], dict[str, Quantity]]:
    """(driver, pool, counter set) -> counter -> total, from the pool's slices' sharedCounters."""
    sets: dict[tuple[str, str, str], dict[str, Quantity]] = {}
    for s in slices:
        spec = s.get("spec") or {}
        driver, pool = str(spec.get("driver", "")), str((spec.get("pool") or {}).get("name", ""))
        for counter_set in spec.get("sharedCounters") or []:
            counters = sets.setdefault((driver, pool, str(counter_set.get("name", ""))), {})
            for name, value in (counter_set.get("counters") or {}).items():
                q = _quantity(value)
                if q is not None:
                    counters[str(name)] = q
    return sets


def _consumes(device: SliceDevice) -> list[tuple[str, str, Quantity]]:
    out = []
    for entry in device.body.get("consumesCounters") or []:
        for name, value in (entry.get("counters") or {}).items():
            q = _quantity(value)
            if q is not None:
                out.append((str(entry.get("counterSet", "")), str(name), q))
    return out


def _counter_reasons(
    device: SliceDevice,
    devices: Sequence[SliceDevice],
    usage: _Usage,
    sets: Mapping[tuple[str, str, str], Mapping[str, Quantity]],
) -> list[str]:
    """A device that consumes shared counters fits while the allocated devices of its pool leave enough."""
    if (device.driver, device.pool, device.name) in usage.owners:
        return []  # already allocated (shared): its counters are consumed already
    reasons = []
    for counter_set, name, need in _consumes(device):
        total = (sets.get((device.driver, device.pool, counter_set)) or {}).get(name)
        if total is None:
            reasons.append(f"counter {counter_set}/{name}: the pool publishes no such shared counter")
            continue
        used = Fraction(0)
        users = []
        for other in devices:
            if (other.driver, other.pool) != (device.driver, device.pool):
                continue
            if (other.driver, other.pool, other.name) not in usage.owners:
                continue
            for other_set, other_name, amount in _consumes(other):
                if (other_set, other_name) == (counter_set, name):
                    used += amount.value
                    users.append(other.name)
        left = total.value - used
        if need.value > left:
            reasons.append(
                f"counter {counter_set}/{name}: needs {need.canonical()}, "
                f"{_show(max(left, Fraction(0)), total)} left of {total.canonical()} "
                f"(allocated: {', '.join(sorted(set(users)))})"
            )
    return reasons
