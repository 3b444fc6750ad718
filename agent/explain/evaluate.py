"""Why a ResourceClaim does or does not get this node's devices: every device, per request.

The checks follow the scheduler's structured allocator
(k8s.io/dynamic-resource-allocation/structured/internal/stable/allocator_stable.go): the class's
selectors, then the request's selectors (CEL, evaluated with `agent.core.cel`), then whether the
device is already allocated, then its taints (only ``NoSchedule``/``NoExecute`` count, tolerations
as ``resourceclaim.ToleratesTaint``), then the request's capacity, then the claim's
``matchAttribute`` constraints. CEL errors read as the scheduler reports them.

Consumable capacity and partitionable devices follow the experimental allocator
(structured/internal/experimental/consumable_capacity.go, allocator_experimental.go): a device
with ``allowMultipleAllocations`` is shared; each allocation consumes, per capacity, the request
rounded by the capacity's ``requestPolicy`` (``default`` when not requested, ``validRange``
min/step, ``validValues``), and a share fits while the other claims' ``consumedCapacity`` plus
this one stays within the capacity. A device that consumes shared counters (``consumesCounters``)
fits while the counters the pool's allocated devices consume leave enough.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from agent.core.cel import CelCompileError, CelError, compile_check, matches, referenced_values
from agent.core.errors import AgentError, QuantityError
from agent.core.quantity import Quantity
from agent.explain.taintrules import RULE_FIELD

BLOCKING_TAINT_EFFECTS = ("NoSchedule", "NoExecute")


class ExplainError(AgentError):
    """The claim cannot be explained (not found, another node's, a selector that does not compile)."""


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


@dataclass(frozen=True)
class DeviceVerdict:
    device: str
    matched: bool
    reasons: tuple[str, ...] = ()


@dataclass(frozen=True)
class RequestReport:
    name: str
    device_class: str
    mode: str
    count: int
    devices: tuple[DeviceVerdict, ...]
    summary: str


@dataclass(frozen=True)
class Placement:
    """Where an allocated claim stands on this node."""

    devices: tuple[str, ...]
    prepared: str
    """``yes``, ``started`` (a prepare in progress or interrupted), ``no`` or ``unknown``."""
    cdi_spec: tuple[str, ...]
    pods: tuple[str, ...]


@dataclass(frozen=True)
class Report:
    claim: str
    node: str
    allocated: bool
    requests: tuple[RequestReport, ...]
    constraints: tuple[str, ...] = ()
    placement: Placement | None = None
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``-o yaml|json``."""
        out: dict[str, Any] = {
            "claim": self.claim,
            "node": self.node,
            "allocated": self.allocated,
            "requests": [
                {
                    "name": r.name,
                    "deviceClassName": r.device_class,
                    "allocationMode": r.mode,
                    "count": r.count,
                    "summary": r.summary,
                    "devices": [
                        {"device": d.device, "matched": d.matched, "reasons": list(d.reasons)}
                        for d in r.devices
                    ],
                }
                for r in self.requests
            ],
            "constraints": list(self.constraints),
        }
        if self.placement is not None:
            p = self.placement
            out["onThisNode"] = {
                "devices": list(p.devices),
                "prepared": p.prepared,
                "cdiSpecs": list(p.cdi_spec),
                "pods": list(p.pods),
            }
        if self.notes:
            out["notes"] = list(self.notes)
        return out


def claim_key(claim: Mapping[str, Any]) -> str:
    meta = claim.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


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


def allocation_results(claim: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    allocation = (claim.get("status") or {}).get("allocation") or {}
    return [r for r in (allocation.get("devices") or {}).get("results") or [] if isinstance(r, Mapping)]


def allocated_node(claim: Mapping[str, Any]) -> str | None:
    """The node an allocation's nodeSelector names (``metadata.name In [node]``), if one."""
    allocation = (claim.get("status") or {}).get("allocation") or {}
    for term in (allocation.get("nodeSelector") or {}).get("nodeSelectorTerms") or []:
        for field_ in term.get("matchFields") or []:
            if field_.get("key") == "metadata.name" and field_.get("operator") == "In":
                values = field_.get("values") or []
                if len(values) == 1:
                    return str(values[0])
    return None


@dataclass(frozen=True)
class _Request:
    """One request, or one subrequest of a ``firstAvailable`` list (``name`` is then ``req/sub``)."""

    name: str
    base: str
    spec: Mapping[str, Any]


def requests_of(claim: Mapping[str, Any]) -> list[_Request]:
    out = []
    for request in ((claim.get("spec") or {}).get("devices") or {}).get("requests") or []:
        name = str(request.get("name", ""))
        if request.get("firstAvailable"):
            for sub in request["firstAvailable"]:
                out.append(_Request(f"{name}/{sub.get('name', '')}", name, sub))
        else:
            out.append(_Request(name, name, request.get("exactly") or request))
    return out


def _tolerates(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    """resourceclaim.ToleratesTaint: effect (empty matches all), key (empty with Exists matches all),
    operator Exists or Equal (the default) with the value."""
    effect = toleration.get("effect") or ""
    if effect and effect != taint.get("effect"):
        return False
    key = toleration.get("key") or ""
    operator = toleration.get("operator") or "Equal"
    if key and key != taint.get("key"):
        return False
    if operator == "Exists":
        return True
    return bool(key) and (toleration.get("value") or "") == (taint.get("value") or "")


def _selector_reasons(
    owner: str, selectors: Sequence[Mapping[str, Any]], device: SliceDevice
) -> tuple[list[str], list[str]]:
    """(reasons the selectors exclude the device, CEL runtime errors as the scheduler words them)."""
    reasons: list[str] = []
    errors: list[str] = []
    for i, selector in enumerate(selectors):
        expression = str((selector.get("cel") or {}).get("expression", ""))
        try:
            ok = matches(expression, device.body, driver=device.driver)
        except CelCompileError:
            raise
        except CelError as error:
            errors.append(f"{owner}: selector #{i} on device {device.id}: CEL runtime error: {error}")
            continue
        if not ok:
            seen = referenced_values(expression, device.body, device.driver)
            values = ", ".join(f"{k}={v}" for k, v in seen.items()) or "no attributes"
            reasons.append(f"{owner} selector #{i} is false: {expression} (saw {values})")
    return reasons, errors


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


def _attribute(device: SliceDevice, name: str) -> str | None:
    attributes = device.body.get("attributes") or {}
    domain, _, ident = name.rpartition("/")
    value = attributes.get(name)
    if value is None and domain == device.driver:
        value = attributes.get(ident)
    if value is None:
        return None
    ((_, raw),) = value.items() if isinstance(value, Mapping) else (("v", value),)
    return str(raw)


def compile_selectors(claim: Mapping[str, Any], classes: Mapping[str, Mapping[str, Any] | None]) -> None:
    """Raise `ExplainError` naming the first selector that does not compile."""
    for request in requests_of(claim):
        class_name = str(request.spec.get("deviceClassName", ""))
        owners = [(f"claim {claim_key(claim)} request {request.name}", request.spec.get("selectors") or [])]
        device_class = classes.get(class_name)
        if device_class is not None:
            owners.append((f"class {class_name}", (device_class.get("spec") or {}).get("selectors") or []))
        for owner, selectors in owners:
            for i, selector in enumerate(selectors):
                expression = str((selector.get("cel") or {}).get("expression", ""))
                try:
                    compile_check(expression)
                except CelCompileError as error:
                    first = str(error).strip().splitlines()[0]  # the parser adds a caret diagram below
                    raise ExplainError(f"{owner}: selector #{i}: CEL compile error: {first}") from error


def explain(
    claim: Mapping[str, Any],
    *,
    node: str,
    classes: Mapping[str, Mapping[str, Any] | None],
    slices: Sequence[Mapping[str, Any]],
    other_claims: Sequence[Mapping[str, Any]] = (),
    placement: Placement | None = None,
    notes: Sequence[str] = (),
) -> Report:
    """The report for `claim` against this node's `slices` (raises `ExplainError` on bad selectors)."""
    compile_selectors(claim, classes)
    key = claim_key(claim)
    uid = (claim.get("metadata") or {}).get("uid")
    usage = _Usage()
    for other in other_claims:
        if (other.get("metadata") or {}).get("uid") == uid or claim_key(other) == key:
            continue
        for r in allocation_results(other):
            usage.add(claim_key(other), r)
    devices = slice_devices(slices)
    counter_sets = _counter_sets(slices)
    reports = []
    matched_by_request: dict[str, list[SliceDevice]] = {}
    needed: dict[str, int] = {}
    for request in requests_of(claim):
        spec = request.spec
        class_name = str(spec.get("deviceClassName", ""))
        device_class = classes.get(class_name)
        mode = str(spec.get("allocationMode") or "ExactCount")
        count = int(spec.get("count") or 1) if mode == "ExactCount" else 0
        verdicts = []
        matched: list[SliceDevice] = []
        for device in devices:
            reasons: list[str] = []
            if device_class is None:
                reasons.append(f"DeviceClass {class_name} not found")
            else:
                excluded, failed = _selector_reasons(
                    f"class {class_name}", (device_class.get("spec") or {}).get("selectors") or [], device
                )
                reasons += excluded + failed
            if not reasons:
                excluded, failed = _selector_reasons(f"claim {key}", spec.get("selectors") or [], device)
                reasons += excluded + failed
            shared = bool(device.body.get("allowMultipleAllocations"))
            owners = usage.owners.get((device.driver, device.pool, device.name))
            if owners and not shared:
                reasons.append(f"allocated to claim {', '.join(sorted(set(owners)))}")
            tolerations = spec.get("tolerations") or []
            for taint in device.body.get("taints") or []:
                if taint.get("effect") in BLOCKING_TAINT_EFFECTS and not any(
                    _tolerates(t, taint) for t in tolerations
                ):
                    value = f"={taint['value']}" if taint.get("value") else ""
                    rule = taint.get(RULE_FIELD)
                    source = f" (DeviceTaintRule {rule})" if rule else ""
                    reasons.append(
                        f"taint {taint.get('key')}{value}:{taint.get('effect')}{source} not tolerated"
                    )
            if shared:
                reasons += _shared_capacity_reasons(spec, device, usage)
            else:
                reasons += _capacity_reasons(spec, device)
            if not owners or shared:
                reasons += _counter_reasons(device, devices, usage, counter_sets)
            verdicts.append(DeviceVerdict(device.id, not reasons, tuple(reasons)))
            if not reasons:
                matched.append(device)
        matched_by_request[request.name] = matched
        needed[request.name] = count if mode == "ExactCount" else max(len(matched), 1)
        if mode == "ExactCount":
            ok = len(matched) >= count
            summary = f"needs {count} device(s); {len(matched)} of {len(devices)} on this node match"
        else:
            ok = bool(matched)
            summary = f"needs all matching devices (at least 1); {len(matched)} of {len(devices)} match"
        reports.append(
            RequestReport(
                request.name,
                class_name,
                mode,
                count,
                tuple(verdicts),
                summary + ("" if ok else ": unsatisfiable here"),
            )
        )
    constraints = _constraints(claim, requests_of(claim), matched_by_request, needed)
    return Report(
        claim=key,
        node=node,
        allocated=bool(allocation_results(claim)),
        requests=tuple(reports),
        constraints=tuple(constraints),
        placement=placement,
        notes=tuple(notes),
    )


def _serves(counts: Mapping[str, int], covered: Sequence[_Request], needed: Mapping[str, int]) -> bool:
    """Enough devices with one value for every request (a firstAvailable request needs one subrequest)."""
    return all(
        any(counts.get(r.name, 0) >= needed[r.name] for r in covered if r.base == base)
        for base in {r.base for r in covered}
    )


def _constraints(
    claim: Mapping[str, Any],
    requests: Sequence[_Request],
    matched: Mapping[str, list[SliceDevice]],
    needed: Mapping[str, int],
) -> list[str]:
    """``matchAttribute``: can one value of the attribute serve every request it covers?"""
    out = []
    for i, constraint in enumerate(((claim.get("spec") or {}).get("devices") or {}).get("constraints") or []):
        name = constraint.get("matchAttribute")
        if not name:
            continue
        scope = set(constraint.get("requests") or []) or {r.base for r in requests}
        covered = [r for r in requests if r.base in scope]
        per_value: dict[str, dict[str, int]] = {}
        missing = []
        for request in covered:
            for device in matched[request.name]:
                value = _attribute(device, name)
                if value is None:
                    missing.append(device.id)
                else:
                    counts = per_value.setdefault(value, {})
                    counts[request.name] = counts.get(request.name, 0) + 1
        possible = [v for v, counts in per_value.items() if _serves(counts, covered, needed)]
        detail = (
            "; ".join(f"{v}: {dict(sorted(c.items()))}" for v, c in sorted(per_value.items())) or "no values"
        )
        lacking = f"; devices without it: {', '.join(sorted(set(missing)))}" if missing else ""
        if possible:
            out.append(
                f"constraint #{i} matchAttribute {name}: possible with {', '.join(sorted(possible))}{lacking}"
            )
        else:
            out.append(
                f"constraint #{i} matchAttribute {name}: impossible: no single value serves "
                f"{', '.join(r.name for r in covered)} (matching devices per value: {detail}){lacking}"
            )
    return out
