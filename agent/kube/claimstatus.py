"""Per-device claim status: which physical device a claim holds, and whether it is healthy.

After a prepare, the claim's ``status.devices`` (KEP-4817: beta in 1.33-1.36, GA in 1.37) gets one
entry per allocation result the driver prepared, written by server-side apply with the driver's
own field manager (``dra-agent/<driver>``), so entries of other drivers and the scheduler's
allocation are never touched. The API server matches each entry to an allocation result by
driver, pool, device and ``shareID`` (pkg/apis/resource/validation/validation.go,
``validateDeviceStatus``): a share of a shareable device carries its result's ``shareID``, and
two shares of one device in one claim are two entries. An entry holds ``data`` (the device's UUID,
PCI address, product and parent; what the backend tells of the device as prepared, such as a
dynamic MIG device's UUID, GPU and compute instance IDs and ``parentUUID``:
`agent.core.backend.DescribesPrepared`) and a ``Ready`` condition that follows the device's health
(``True``/``Prepared``; ``False``/``Unhealthy`` with the conditions while it is not). An unprepare
applies the driver's entries empty, which removes them. The claim's UID is sent with the object,
so a claim deleted and created again under the same name is not written.

A write never fails or delays a prepare: writes happen here, `SETTLE_SECONDS` after the calls that
prepared or unprepared the claims ended, so their answers leave first. A write
the API server refuses for good (any 4xx but 401, 404, 408, 409 and 429: invalid, forbidden, bad
request) is logged once with the server's message, counted as ``result="rejected"`` and not sent
again (health changes included) until the claim is prepared again or the agent restarts; a claim
deleted or created again meanwhile (404, 409) is ``result="gone"``; another failure is logged
(once per episode), counted as ``result="error"`` and retried with capped backoff until it
succeeds or the claim is gone or changes again.

RBAC (the chart's ClusterRole): ``resourceclaims/status`` get and patch, and, for granular status
authorization (``DRAResourceClaimGranularStatusAuthorization``, beta and on from 1.36), the
synthetic ``resourceclaims/driver`` subresource with ``associated-node:patch`` and
``associated-node:update`` for our driver names only (pkg/registry/resource/resourceclaim,
``AuthorizedForDeviceStatus``: a node's service account may write only claims allocated to its
node).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import anyio

from agent.core.backend import ClaimRef, PreparedStatus
from agent.core.clock import Clock
from agent.core.errors import AgentError, KubeApiError
from agent.core.inventory import Inventory
from agent.core.logs import log_fields
from agent.core.model import Device, HealthStatus
from agent.observe.metrics import Metrics

log = logging.getLogger("agent.kube.claimstatus")

READY = "Ready"
MAX_BACKOFF_SECONDS = 60.0
SETTLE_SECONDS = 0.05
"""How long the writer waits after being woken: the calls that woke it have answered by then."""
FIELD_MANAGER_PREFIX = "dra-agent/"


RESULTS = ("success", "error", "rejected", "gone")
"""``result`` values of ``dra_agent_claim_status_writes_total``."""
TRANSIENT_4XX = frozenset({401, 404, 408, 409, 429})
"""4xx answers that may change on retry: credentials renewed, claim gone or recreated, throttling."""


def permanent(status: int) -> bool:
    """Whether an API answer will not change on retry (422 invalid, 403 forbidden, 400...)."""
    return 400 <= status < 500 and status not in TRANSIENT_4XX


class StatusApi(Protocol):
    async def apply_claim_status(
        self, namespace: str, name: str, body: Mapping[str, Any], *, field_manager: str
    ) -> dict[str, Any]: ...


@dataclass(frozen=True)
class StatusTarget:
    """One allocation result the driver prepared: the key of its ``status.devices`` entry."""

    pool: str
    device: str
    share_id: str | None = None


Targets = Callable[[ClaimRef], Sequence[StatusTarget]]
"""The prepared results of a claim (from the claim checkpoint, which survives restarts)."""
Describe = Callable[[str, ClaimRef], Awaitable[PreparedStatus]]
"""What the backend tells of a device prepared for a claim (`agent.core.backend.prepared_status`)."""


@dataclass(frozen=True)
class _Entry:
    """What one entry says (the condition's time is kept apart: it changes only on a flip)."""

    target: StatusTarget
    ready: bool
    message: str
    data: tuple[tuple[str, str | int], ...]


def rfc3339(at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(at)))


def device_data(device: Device) -> dict[str, str | int]:
    """The `Device`'s part of an entry's ``data``."""
    return {
        key: value
        for key, value in (
            ("uuid", device.uuid),
            ("pciBusID", device.pci_bus_id),
            ("productName", device.product),
            ("parent", device.parent),
        )
        if value
    }


def device_entry(device: Device, target: StatusTarget, prepared: PreparedStatus) -> _Entry:
    """The entry of `target`: the `Device` (with its health) and what its backend said of it."""
    health = device.health
    ready = health.status is not HealthStatus.UNHEALTHY
    data = {**device_data(device), **prepared}
    return _Entry(target, ready, "" if ready else health.message, tuple(data.items()))


class ClaimStatusWriter:
    """Keeps the ``status.devices`` entries of one driver's prepared claims; `run` until cancelled."""

    def __init__(
        self,
        driver: str,
        pool: str,
        inventory: Inventory,
        api: Callable[[], Awaitable[StatusApi]],
        *,
        clock: Clock,
        metrics: Metrics | None = None,
        targets: Targets | None = None,
        describe: Describe | None = None,
    ) -> None:
        self.driver = driver
        self._pool = pool
        self._inventory = inventory
        self._api = api
        self._clock = clock
        self._metrics = metrics
        self._targets = targets
        self._describe = describe
        self._prepared: dict[ClaimRef, tuple[str, ...]] = {}
        self._written: dict[ClaimRef, tuple[_Entry, ...]] = {}
        self._sent: set[ClaimRef] = set()
        """Claims a write was sent for (it may have landed even when it failed): entries to remove."""
        self._rejected: set[ClaimRef] = set()
        """Claims whose status the API server refused for good: not sent again (but removed)."""
        self._described: dict[tuple[ClaimRef, str], PreparedStatus] = {}
        self._since: dict[tuple[ClaimRef, StatusTarget], tuple[bool, float]] = {}
        self._dirty: set[ClaimRef] = set()
        self._failing = False
        self._wake = anyio.Event()
        if metrics is not None:
            for result in RESULTS:
                metrics.claim_status_writes.labels(driver, result)

    # -- the claim state's listener (`agent.claims.state.hooks.PreparedListener`) -----------------

    def prepared_changed(
        self, driver: str, prepared: Mapping[ClaimRef, tuple[str, ...]], unprepared: Collection[ClaimRef]
    ) -> None:
        if driver != self.driver:
            return
        for ref in unprepared:
            self._prepared.pop(ref, None)
            self._dirty.add(ref)
        for ref, devices in prepared.items():
            self._prepared[ref] = devices
            self._rejected.discard(ref)  # prepared again: worth one more try
            self._dirty.add(ref)
        self._wake.set()

    def claims_read(self, claims: Mapping[ClaimRef, Mapping[str, Any]]) -> None:
        """Nothing to take from the claims themselves: the checkpoint has their results."""

    # -- writing ---------------------------------------------------------------------------------

    def _targets_of(self, ref: ClaimRef) -> Sequence[StatusTarget]:
        names = self._prepared.get(ref)
        if names is None:
            return ()
        found = self._targets(ref) if self._targets is not None else ()
        return found or [StatusTarget(self._pool, name) for name in names]

    async def _prepared_status(self, ref: ClaimRef, device: str) -> PreparedStatus:
        """The backend's word on the prepared device, asked once per claim and device."""
        key = (ref, device)
        found = self._described.get(key)
        if found is None:
            found = {}
            if self._describe is not None:
                try:
                    found = await self._describe(device, ref)
                except AgentError as error:  # written without it, asked again at the next write
                    log.debug("no prepared status", extra=log_fields(device=device, error=str(error)))
                    return {}
            self._described[key] = found
        return found

    async def _entries(self, ref: ClaimRef) -> tuple[_Entry, ...]:
        out = []
        devices = {d.name: d for d in self._inventory.devices()}  # with their health
        for target in self._targets_of(ref):
            device = devices.get(target.device)
            if device is not None:
                out.append(device_entry(device, target, await self._prepared_status(ref, target.device)))
        return tuple(out)

    def _body(self, ref: ClaimRef, entries: tuple[_Entry, ...]) -> dict[str, Any]:
        now = self._clock.time()
        listed = []
        for entry in entries:
            target = entry.target
            ready, since = self._since.get((ref, target), (entry.ready, now))
            if ready != entry.ready:
                since = now
            self._since[(ref, target)] = (entry.ready, since)
            item: dict[str, Any] = {"driver": self.driver, "pool": target.pool, "device": target.device}
            if target.share_id:
                item["shareID"] = target.share_id
            item["conditions"] = [
                {
                    "type": READY,
                    "status": "True" if entry.ready else "False",
                    "reason": "Prepared" if entry.ready else "Unhealthy",
                    "message": entry.message[:1024],
                    "lastTransitionTime": rfc3339(since),
                }
            ]
            item["data"] = dict(entry.data)
            listed.append(item)
        return {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": ref.name, "namespace": ref.namespace, "uid": ref.uid},
            "status": {"devices": listed},
        }

    async def write(self, ref: ClaimRef) -> bool:
        """Apply `ref`'s entries when they differ from the last write; False when worth a retry."""
        entries = await self._entries(ref)
        if self._written.get(ref) == entries and ref not in self._dirty:
            return True
        if not entries and ref not in self._prepared and ref not in self._sent:
            return True  # unprepared before its first write: nothing to remove
        if ref in self._rejected and ref in self._prepared:
            return True  # refused for good: not again until prepared again or the agent restarts
        api = await self._api()
        body = self._body(ref, entries)
        self._sent.add(ref)
        try:
            await api.apply_claim_status(
                ref.namespace, ref.name, body, field_manager=FIELD_MANAGER_PREFIX + self.driver
            )
        except KubeApiError as error:
            if error.status in (404, 409):  # deleted, or created again under the name (UID)
                self._count("gone")
                self._forget(ref)
                return True
            if permanent(error.status):
                self._reject(ref, error)
                return True
            self._count("error")
            if not self._failing:
                self._failing = True
                log.warning(
                    "cannot write the claim's device status; retrying (the claim stays prepared)",
                    extra=log_fields(
                        driver=self.driver, claim=f"{ref.namespace}/{ref.name}", error=str(error)
                    ),
                )
            return False
        self._count("success")
        self._rejected.discard(ref)
        if self._failing:
            self._failing = False
            log.info("claim device status written again", extra=log_fields(driver=self.driver))
        if ref in self._prepared:
            self._written[ref] = entries
        else:
            self._forget(ref)
        return True

    def _reject(self, ref: ClaimRef, error: KubeApiError) -> None:
        self._count("rejected")
        self._rejected.add(ref)
        log.warning(
            "the API server refused the claim's device status; not retrying until the claim is "
            "prepared again or the agent restarts (the claim stays prepared)",
            extra=log_fields(
                driver=self.driver, claim=f"{ref.namespace}/{ref.name}", status=error.status, error=str(error)
            ),
        )

    def _forget(self, ref: ClaimRef) -> None:
        self._written.pop(ref, None)
        self._sent.discard(ref)
        self._rejected.discard(ref)
        for key in [k for k in self._since if k[0] == ref]:
            del self._since[key]
        for described in [k for k in self._described if k[0] == ref]:
            del self._described[described]

    def _count(self, result: str) -> None:
        if self._metrics is not None:
            self._metrics.claim_status_writes.labels(self.driver, result).inc()

    async def run(self) -> None:
        version = self._inventory.version
        backoff = 0.5
        while True:
            for ref in list(self._dirty):
                if await self.write(ref):
                    self._dirty.discard(ref)
            if self._dirty:
                await self._clock.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_SECONDS)
                continue
            backoff = 0.5
            async with anyio.create_task_group() as tg:

                async def inventory_changed() -> None:
                    nonlocal version
                    version = await self._inventory.wait_changed(version)
                    tg.cancel_scope.cancel()

                async def woken() -> None:
                    await self._wake.wait()
                    tg.cancel_scope.cancel()

                tg.start_soon(inventory_changed)
                tg.start_soon(woken)
            # The kubelet's answers leave first, and the claims of a burst are written in one pass.
            await self._clock.sleep(SETTLE_SECONDS)
            self._wake = anyio.Event()
            # A health change: the claims whose entries now read differently.
            for ref in list(self._prepared):
                if self._written.get(ref) != await self._entries(ref):
                    self._dirty.add(ref)
