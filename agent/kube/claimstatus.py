"""Per-device claim status: which physical device a claim holds, and whether it is healthy.

After a prepare, each prepared device's entry in the claim's ``status.devices`` (KEP-4817: beta in
1.33-1.36, GA in 1.37) is written by server-side apply with the driver's own field manager
(``dra-agent/<driver>``), so entries of other drivers and the scheduler's allocation are never
touched: ``driver``, ``pool``, ``device``, ``data`` (the device's UUID, PCI address, product and
parent: a MIG device or partition names the GPU it is on) and a ``Ready`` condition that follows
the device's health (``True``/``Prepared``; ``False``/``Unhealthy`` with the conditions while
it is not). An unprepare applies the driver's entries empty, which removes them. The claim's UID
is sent with the object, so a claim deleted and created again under the same name is not written.

A write never fails or delays a prepare: writes happen here, after the prepare answered; a
failed write is logged (once per episode), counted (``dra_agent_claim_status_writes_total``) and
retried with capped backoff until it succeeds or the claim is gone (404) or changes again.

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
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import anyio

from agent.core.backend import ClaimRef
from agent.core.clock import Clock
from agent.core.errors import KubeApiError
from agent.core.inventory import Inventory
from agent.core.logs import log_fields
from agent.core.model import Device, HealthStatus
from agent.observe.metrics import Metrics

log = logging.getLogger("agent.kube.claimstatus")

READY = "Ready"
MAX_BACKOFF_SECONDS = 60.0
FIELD_MANAGER_PREFIX = "dra-agent/"


class StatusApi(Protocol):
    async def apply_claim_status(
        self, namespace: str, name: str, body: Mapping[str, Any], *, field_manager: str
    ) -> dict[str, Any]: ...


@dataclass(frozen=True)
class _Entry:
    """What one device's entry says (the condition's time is kept apart: it changes only on a flip)."""

    device: str
    ready: bool
    message: str
    data: tuple[tuple[str, str], ...]


def rfc3339(at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(at)))


def device_entry(device: Device) -> _Entry:
    health = device.health
    ready = health.status is not HealthStatus.UNHEALTHY
    data = tuple(
        (key, value)
        for key, value in (
            ("uuid", device.uuid),
            ("pciBusID", device.pci_bus_id),
            ("productName", device.product),
            ("parent", device.parent),
        )
        if value
    )
    return _Entry(device.name, ready, "" if ready else health.message, data)


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
    ) -> None:
        self.driver = driver
        self._pool = pool
        self._inventory = inventory
        self._api = api
        self._clock = clock
        self._metrics = metrics
        self._prepared: dict[ClaimRef, tuple[str, ...]] = {}
        self._written: dict[ClaimRef, tuple[_Entry, ...]] = {}
        self._since: dict[tuple[ClaimRef, str], tuple[bool, float]] = {}
        self._dirty: set[ClaimRef] = set()
        self._failing = False
        self._wake = anyio.Event()
        if metrics is not None:
            for result in ("success", "error"):
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
            self._dirty.add(ref)
        self._wake.set()

    def claims_read(self, claims: Mapping[ClaimRef, Mapping[str, Any]]) -> None:
        """Nothing to take from the claims themselves."""

    # -- writing ---------------------------------------------------------------------------------

    def _entries(self, ref: ClaimRef) -> tuple[_Entry, ...]:
        devices = {d.name: d for d in self._inventory.devices()}
        return tuple(device_entry(devices[n]) for n in self._prepared.get(ref, ()) if n in devices)

    def _body(self, ref: ClaimRef, entries: tuple[_Entry, ...]) -> dict[str, Any]:
        now = self._clock.time()
        listed = []
        for entry in entries:
            ready, since = self._since.get((ref, entry.device), (entry.ready, now))
            if ready != entry.ready:
                since = now
            self._since[(ref, entry.device)] = (entry.ready, since)
            listed.append(
                {
                    "driver": self.driver,
                    "pool": self._pool,
                    "device": entry.device,
                    "conditions": [
                        {
                            "type": READY,
                            "status": "True" if entry.ready else "False",
                            "reason": "Prepared" if entry.ready else "Unhealthy",
                            "message": entry.message[:1024],
                            "lastTransitionTime": rfc3339(since),
                        }
                    ],
                    "data": dict(entry.data),
                }
            )
        return {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": ref.name, "namespace": ref.namespace, "uid": ref.uid},
            "status": {"devices": listed},
        }

    async def write(self, ref: ClaimRef) -> bool:
        """Apply `ref`'s entries when they differ from the last write; False when it failed."""
        entries = self._entries(ref)
        if self._written.get(ref) == entries and ref not in self._dirty:
            return True
        api = await self._api()
        body = self._body(ref, entries)
        try:
            await api.apply_claim_status(
                ref.namespace, ref.name, body, field_manager=FIELD_MANAGER_PREFIX + self.driver
            )
        except KubeApiError as error:
            gone = error.status in (404, 409)  # deleted, or created again under the name (UID)
            self._count("error")
            if gone:
                self._forget(ref)
                return True
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
        if self._failing:
            self._failing = False
            log.info("claim device status written again", extra=log_fields(driver=self.driver))
        if ref in self._prepared:
            self._written[ref] = entries
        else:
            self._forget(ref)
        return True

    def _forget(self, ref: ClaimRef) -> None:
        self._written.pop(ref, None)
        for key in [k for k in self._since if k[0] == ref]:
            del self._since[key]

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
            self._wake = anyio.Event()
            # A health change: the claims whose entries now read differently.
            for ref in self._prepared:
                if self._written.get(ref) != self._entries(ref):
                    self._dirty.add(ref)
