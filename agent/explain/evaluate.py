"""Why a ResourceClaim does or does not get this node's devices: every device, per request.

The checks follow the scheduler's structured allocator
(k8s.io/dynamic-resource-allocation/structured/internal/stable/allocator_stable.go): the class's
selectors, then the request's selectors (CEL, evaluated with `agent.core.cel`), then whether the
device is already allocated, then its taints (only ``NoSchedule``/``NoExecute`` count, tolerations
as ``resourceclaim.ToleratesTaint``), then the request's capacity, then the claim's
``matchAttribute`` constraints. CEL errors read as the scheduler reports them.

Consumable capacity and partitionable devices follow the experimental allocator
(`agent.explain.capacity`): a device with ``allowMultipleAllocations`` is shared; each allocation
consumes, per capacity, the request rounded by the capacity's ``requestPolicy``, and a share fits
while the other claims' ``consumedCapacity`` plus this one stays within the capacity. A device
that consumes shared counters (``consumesCounters``) fits while the counters the pool's allocated
devices consume leave enough.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent.core.cel import CelCompileError, CelError, compile_check, matches, referenced_values
from agent.core.errors import AgentError
from agent.explain.capacity import (
    _capacity_reasons,
    _counter_reasons,
    _counter_sets,
    _shared_capacity_reasons,
    _Usage,
)
from agent.explain.devices import SliceDevice, slice_devices
from agent.explain.taintrules import RULE_FIELD

BLOCKING_TAINT_EFFECTS = ("NoSchedule", "NoExecute")


class ExplainError(AgentError):
    """The claim cannot be explained (not found, another node's, a selector that does not compile)."""


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
