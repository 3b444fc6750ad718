"""Reading a ResourceClaim (resource.k8s.io/v1 dict) the way the kubelet plugin helper does.

`check_claim` applies the whole-request checks of the Go helper (not allocated, replaced);
`parse_allocation` picks the allocation results of one driver on this node's pool and groups
them per device, with base request names (``gpu/sub`` -> ``gpu``) as the kubelet needs them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agent.core.backend import ClaimRef
from agent.core.errors import AgentError, ClaimRequestError, QuantityError
from agent.core.quantity import Quantity
from agent.core.sharing import SOURCE_CLAIM, SOURCE_CLASS, OpaqueConfig

MAX_RESULTS = 32
"""`AllocationResultsMaxSize` of the API: more results than this is not a claim the API server wrote."""

# CDI device names are `<claimUID>-<device>[-<shareID>]`: every part must fit CDI's name grammar.
_CDI_NAME_PART = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")


class ClaimAllocationError(AgentError):
    """The claim's allocation cannot be prepared on this node (answered as a per-claim error)."""

    def __init__(self, message: str, reason: str) -> None:
        self.reason = reason
        super().__init__(message)


@dataclass(frozen=True)
class AllocatedDevice:
    """One device of this driver and node allocated to a claim, with the requests it serves."""

    pool: str
    device: str
    requests: tuple[str, ...]
    """Base request names, in allocation order, without duplicates."""
    share_id: str | None = None
    admin_access: bool = False
    consumed: tuple[tuple[str, str], ...] = ()
    """``consumedCapacity`` of the result: (capacity name, canonical quantity), sorted."""


@dataclass(frozen=True)
class AllocatedClaim:
    """The part of a claim's allocation that this driver prepares on this node."""

    ref: ClaimRef
    devices: tuple[AllocatedDevice, ...]


def base_request_name(request: str) -> str:
    """``gpu/large`` -> ``gpu`` (the kubelet matches containers on base request names)."""
    return request.split("/", 1)[0]


def claim_key(ref: ClaimRef) -> str:
    """``namespace/name`` as in the Go helper's messages."""
    return f"{ref.namespace}/{ref.name}"


def _mapping(value: object) -> Mapping[str, Any] | None:
    return value if isinstance(value, Mapping) else None


def check_claim(ref: ClaimRef, claim: Mapping[str, Any]) -> None:
    """Raise `ClaimRequestError` when the claim is not allocated or is not the one the kubelet means."""
    metadata = _mapping(claim.get("metadata")) or {}
    if str(metadata.get("uid", "")) != ref.uid:
        raise ClaimRequestError(
            f"claim {claim_key(ref)} got replaced: the API server has UID {metadata.get('uid', '')!r}, "
            f"the kubelet asked for {ref.uid!r}; the kubelet retries with the new claim",
            "FAILED_PRECONDITION",
        )
    status = _mapping(claim.get("status")) or {}
    if _mapping(status.get("allocation")) is None:
        raise ClaimRequestError(
            f"claim {claim_key(ref)} not allocated; wait for the scheduler to allocate it",
            "FAILED_PRECONDITION",
        )


def _results(ref: ClaimRef, claim: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    allocation = _mapping((_mapping(claim.get("status")) or {}).get("allocation")) or {}
    devices = _mapping(allocation.get("devices")) or {}
    results = devices.get("results") or []
    if not isinstance(results, list):
        raise ClaimAllocationError(
            f"claim {claim_key(ref)}: status.allocation.devices.results is not a list", "invalid"
        )
    if len(results) > MAX_RESULTS:
        raise ClaimAllocationError(
            f"claim {claim_key(ref)}: {len(results)} allocation results, more than the API's {MAX_RESULTS}",
            "invalid",
        )
    checked: list[Mapping[str, Any]] = []
    for index, result in enumerate(results):
        entry = _mapping(result)
        if entry is None or not all(
            isinstance(entry.get(k), str) and entry.get(k) for k in ("request", "driver", "pool", "device")
        ):
            raise ClaimAllocationError(
                f"claim {claim_key(ref)}: allocation result {index} lacks request, driver, pool or device",
                "invalid",
            )
        checked.append(entry)
    return checked


def parse_allocation(ref: ClaimRef, claim: Mapping[str, Any], *, driver: str, pool: str) -> AllocatedClaim:
    """The devices of `driver` in `pool` allocated to the claim (other drivers' results are skipped).

    Raises `ClaimAllocationError` when a result of this driver names another pool (the claim was
    allocated on another node) or is malformed.
    """
    grouped: dict[tuple[str, str, str | None], tuple[list[str], bool]] = {}
    consumed: dict[tuple[str, str, str | None], tuple[tuple[str, str], ...]] = {}
    for result in _results(ref, claim):
        if result["driver"] != driver:
            continue
        if result["pool"] != pool:
            raise ClaimAllocationError(
                f"claim {claim_key(ref)}: device {result['device']!r} is allocated on another node "
                f"(pool {result['pool']!r}, this node's pool is {pool!r}); the pod was scheduled elsewhere",
                "other_node",
            )
        share = result.get("shareID")
        share_id = str(share) if share else None
        for part in (result["device"], share_id):
            if part is not None and not _CDI_NAME_PART.match(part):
                raise ClaimAllocationError(
                    f"claim {claim_key(ref)}: {part!r} cannot be part of a CDI device name", "invalid"
                )
        key = (result["pool"], result["device"], share_id)
        requests, admin = grouped.setdefault(key, ([], False))
        base = base_request_name(result["request"])
        if base not in requests:
            requests.append(base)
        grouped[key] = (requests, admin or result.get("adminAccess") is True)
        if result.get("consumedCapacity") is not None:
            consumed[key] = _consumed(ref, result["consumedCapacity"])
    devices = tuple(
        AllocatedDevice(
            pool=p,
            device=d,
            requests=tuple(reqs),
            share_id=s,
            admin_access=admin,
            consumed=consumed.get((p, d, s), ()),
        )
        for (p, d, s), (reqs, admin) in grouped.items()
    )
    return AllocatedClaim(ref=ref, devices=devices)


def _consumed(ref: ClaimRef, raw: object) -> tuple[tuple[str, str], ...]:
    """A result's ``consumedCapacity``; a negative value (the API server lets one through) is refused."""
    if not isinstance(raw, Mapping):
        raise ClaimAllocationError(f"claim {claim_key(ref)}: consumedCapacity is not an object", "invalid")
    out = []
    for name, value in sorted(raw.items()):
        try:
            quantity = Quantity.parse(value if isinstance(value, str | int) else str(value))
        except QuantityError as error:
            raise ClaimAllocationError(
                f"claim {claim_key(ref)}: consumedCapacity[{name}]: {error}", "invalid"
            ) from None
        if quantity.value < 0:
            raise ClaimAllocationError(
                f"claim {claim_key(ref)}: consumedCapacity[{name}] is {value!r}: a share cannot consume a "
                "negative quantity; request a positive capacity in the claim",
                "invalid",
            )
        out.append((str(name), quantity.canonical()))
    return tuple(out)


def _request_names(claim: Mapping[str, Any]) -> set[str] | None:
    """The claim's request names (``gpu`` and ``gpu/sub`` for subrequests); None when the spec is absent."""
    devices = _mapping((_mapping(claim.get("spec")) or {}).get("devices"))
    if devices is None or not isinstance(devices.get("requests"), list):
        return None
    names: set[str] = set()
    for request in devices["requests"]:
        entry = _mapping(request) or {}
        name = str(entry.get("name", ""))
        names.add(name)
        subs = entry.get("firstAvailable")
        for sub in subs if isinstance(subs, list) else []:
            if isinstance(sub, Mapping):
                names.add(f"{name}/{sub.get('name', '')}")
    return names


def parse_device_configs(ref: ClaimRef, claim: Mapping[str, Any], *, driver: str) -> tuple[OpaqueConfig, ...]:
    """The opaque configs of `driver` in ``status.allocation.devices.config``, in order (last wins).

    The scheduler writes the DeviceClass's configs (``FromClass``) before the claim's
    (``FromClaim``). Raises `ClaimAllocationError` (reason ``config``) for an entry of our driver
    whose parameters are not an object, or that names a request the claim does not have.
    """
    allocation = _mapping((_mapping(claim.get("status")) or {}).get("allocation")) or {}
    raw = (_mapping(allocation.get("devices")) or {}).get("config") or []
    if not isinstance(raw, list):
        raise ClaimAllocationError(
            f"claim {claim_key(ref)}: status.allocation.devices.config is not a list", "config"
        )
    known = _request_names(claim)
    configs: list[OpaqueConfig] = []
    for index, item in enumerate(raw):
        entry = _mapping(item) or {}
        opaque = _mapping(entry.get("opaque"))
        if opaque is None or opaque.get("driver") != driver:
            continue
        where = f"status.allocation.devices.config[{index}]"
        parameters = opaque.get("parameters")
        if not isinstance(parameters, Mapping):
            raise ClaimAllocationError(
                f"claim {claim_key(ref)}: {where}.opaque.parameters must be an object "
                "(apiVersion, kind and the driver's fields)",
                "config",
            )
        requests = entry.get("requests") or []
        if not isinstance(requests, list) or not all(isinstance(r, str) for r in requests):
            raise ClaimAllocationError(
                f"claim {claim_key(ref)}: {where}.requests must be a list of names", "config"
            )
        unknown = [r for r in requests if known is not None and r not in known]
        if unknown:
            raise ClaimAllocationError(
                f"claim {claim_key(ref)}: {where}.requests names {unknown[0]!r}, which is not a request of "
                f"the claim (its requests: {', '.join(sorted(known or ())) or 'none'})",
                "config",
            )
        source = SOURCE_CLASS if entry.get("source") == SOURCE_CLASS else SOURCE_CLAIM
        configs.append(
            OpaqueConfig(
                driver=driver, parameters=parameters, source=source, requests=tuple(requests), index=index
            )
        )
    return tuple(configs)
