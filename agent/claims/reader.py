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
from agent.core.errors import AgentError, ClaimRequestError

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
    devices = tuple(
        AllocatedDevice(pool=p, device=d, requests=tuple(reqs), share_id=s, admin_access=admin)
        for (p, d, s), (reqs, admin) in grouped.items()
    )
    return AllocatedClaim(ref=ref, devices=devices)
