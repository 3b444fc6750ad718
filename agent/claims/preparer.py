"""The contract between the kubelet gRPC services and the claim state machine.

The gRPC layer (`agent.kubelet.draservice`) validates requests and calls a `ClaimPreparer`; the state
machine (`agent.claims.state`) implements it with a `ClaimSource` (the API server) and the backend.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from agent.core.backend import ClaimRef


@dataclass(frozen=True)
class PreparedDevice:
    """One device of a prepared claim, as returned to the kubelet."""

    requests: tuple[str, ...]
    """Base request names (``gpu``, never ``gpu/sub``); empty means all requests of the claim."""
    pool: str
    device: str
    cdi_device_ids: tuple[str, ...]
    share_id: str | None = None


@dataclass(frozen=True)
class PrepareResult:
    """The outcome for one claim: its devices, or an error message (then devices are ignored)."""

    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""


class ClaimPreparer(Protocol):
    """Prepares and unprepares claims for one driver."""

    async def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, PrepareResult]:
        """Result per claim UID (every requested UID present).

        Raises `agent.core.errors.ClaimRequestError` when the whole call must fail (a claim that
        cannot be read, is not allocated or was replaced), as the kubelet's Go helper does.
        """
        ...

    async def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, str]:
        """Error message per claim UID, ``""`` for success (unknown claims succeed)."""
        ...


class ClaimSource(Protocol):
    """Reads ResourceClaims from the API server."""

    async def get_resource_claim(self, namespace: str, name: str) -> Mapping[str, Any]:
        """The claim as a resource.k8s.io/v1-shaped dict (converted if the cluster serves an older version).

        Raises `agent.core.errors.KubeApiError` (status 404 when it does not exist).
        """
        ...
