"""Per-workload attribution: keeps the allocation info series in step with the prepared claims.

The claim state calls `WorkloadAttribution.prepared_changed` with the claims that changed: every
prepared claim after the start-up checkpoint load (the checkpoint survives restarts, so the series
come back with it), then those its calls prepared or unprepared; only their series change, so a
call costs the same however many claims the node holds. A claim that is gone loses its series
at once; a new claim gets its consumers from the kubelet's PodResources API (pod and container
per device) or, where the kubelet does not report it (socket absent, older kubelet, container not
started yet), from the claim's ``reservedFor`` (pod only).
`run` re-resolves shortly after a change (`SETTLE_SECONDS`) and on an interval, so a pod's
containers replace the pod-only series once they run. It also asks each driver's backend, once
per prepared device, what it prepared (`agent.core.backend.DescribesPrepared`): a MIG device's
UUID (a dynamic one has none before), its GPU's UUID and its GPU instance ID label the series.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from typing import Any, Protocol

import anyio

from agent.claims.preparer import ClaimSource
from agent.core.backend import (
    STATUS_GPU_INSTANCE_ID,
    STATUS_PARENT_UUID,
    STATUS_UUID,
    ClaimRef,
    PreparedStatus,
)
from agent.core.errors import AgentError, KubeApiError
from agent.core.inventory import Inventory
from agent.core.logs import log_fields
from agent.kubelet.podresources import ContainerDevice, PodResourcesUnavailable
from agent.observe.allocations import Allocation, AllocationSeries

log = logging.getLogger("agent.kubelet.workloads")

REFRESH_SECONDS = 10.0
SETTLE_SECONDS = 0.2
"""After a change, how long `run` waits for more before it refreshes: a refresh (a PodResources
call, the series rebuilt) between a prepare's steps delayed the kubelet's answer (~0.25 ms per
call); a burst of prepares now costs one refresh."""
Consumer = tuple[str, str, str]
"""(namespace, pod, container); container is empty when only the pod is known."""
Describe = Callable[[str, ClaimRef], Awaitable[PreparedStatus]]
"""A backend's `agent.core.backend.prepared_status`."""
Identity = tuple[str, str, str]
"""(UUID, parent GPU's UUID, GPU instance ID) of a prepared device, as its backend tells them."""


class DeviceLister(Protocol):
    """The PodResources API (`agent.kubelet.podresources.PodResourcesClient`)."""

    async def list_devices(self) -> Sequence[ContainerDevice]: ...


class WorkloadAttribution:
    """Listener of the claim states of every driver; owns the allocation info series."""

    def __init__(
        self,
        series: AllocationSeries,
        *,
        node_name: str,
        inventories: Mapping[str, Inventory],
        claims: ClaimSource | None,
        pod_resources: DeviceLister | None,
        refresh_seconds: float = REFRESH_SECONDS,
        settle_seconds: float = SETTLE_SECONDS,
        describe: Mapping[str, Describe] | None = None,
    ) -> None:
        self.series = series
        self.node_name = node_name
        self.inventories = inventories
        self.claims = claims
        self.pod_resources = pod_resources
        self.refresh_seconds = refresh_seconds
        self.settle_seconds = settle_seconds
        self.describe = describe or {}
        self._identities: dict[tuple[str, str], Identity] = {}
        """(claim UID, device) -> what its backend said of it (asked once)."""
        self._prepared: dict[str, dict[ClaimRef, tuple[str, ...]]] = {}
        self._consumers: dict[str, dict[str, frozenset[Consumer]]] = {}
        """Claim UID -> device name ('' for every device of the claim) -> consumers."""
        self._reserved_for: dict[str, frozenset[Consumer]] = {}
        self._published_versions: dict[str, int] = {}
        """Driver -> the inventory version its series were last all set from."""
        self._changed = anyio.Event()
        self._fallback_logged = False

    def prepared_changed(
        self,
        driver: str,
        prepared: Mapping[ClaimRef, tuple[str, ...]],
        unprepared: Collection[ClaimRef],
    ) -> None:
        """The driver's claims that changed (see `agent.claims.state.hooks.PreparedListener`).

        Only those claims' series change here: a prepare costs the same with 1 or 500 claims
        prepared on the node.
        """
        claims = self._prepared.setdefault(driver, {})
        for ref in unprepared:
            claims.pop(ref, None)
            self.series.set_claim(driver, ref.uid, ())
            if not self._is_prepared(ref):  # (the claim may have another driver's devices too)
                self._consumers.pop(ref.uid, None)
                self._reserved_for.pop(ref.uid, None)
                for key in [k for k in self._identities if k[0] == ref.uid]:
                    del self._identities[key]
        for ref, devices in prepared.items():
            claims[ref] = devices
            self._publish(driver, ref)
        self._changed.set()

    def claims_read(self, claims: Mapping[ClaimRef, Mapping[str, Any]]) -> None:
        """The claims a prepare just read: their ``reservedFor`` spares the fallback a GET per claim.

        Called by the claim state right before `prepared_changed`, for claims it prepared.
        """
        for ref, claim in claims.items():
            self._reserved_for.setdefault(ref.uid, _pods(ref, claim))

    async def run(self) -> None:
        """Resolve consumers on every change and every `refresh_seconds` until cancelled."""
        while True:
            self._changed = anyio.Event()
            await self.refresh()
            with anyio.move_on_after(self.refresh_seconds):
                await self._changed.wait()
                await anyio.sleep(self.settle_seconds)  # the changes of a burst, in one refresh

    async def refresh(self) -> None:
        """Ask PodResources (or the claims) who uses each prepared claim, then update the series."""
        refs = [ref for claims in self._prepared.values() for ref in claims]
        if not refs:
            return
        reported = await self._from_pod_resources()
        changed = await self._identify()
        for ref in refs:
            found = reported.get((ref.namespace, ref.name))
            consumers = found or {"": await self._from_reserved_for(ref)}
            if self._is_prepared(ref) and self._consumers.get(ref.uid) != consumers:
                self._consumers[ref.uid] = consumers  # (and not unprepared while we were reading)
                changed.add(ref)
        for driver, claims in self._prepared.items():
            inventory = self.inventories.get(driver)
            version = inventory.version if inventory is not None else 0
            if self._published_versions.get(driver) != version:  # devices (re)discovered: UUIDs
                self._published_versions[driver] = version
                republish = list(claims)
            else:
                republish = [ref for ref in claims if ref in changed]
            for ref in republish:
                self._publish(driver, ref)

    async def _identify(self) -> set[ClaimRef]:
        """Ask the backends about the devices prepared since the last time (the claims that changed)."""
        found: set[ClaimRef] = set()
        for driver, claims in self._prepared.items():
            describe = self.describe.get(driver)
            if describe is None:
                continue
            for ref, devices in list(claims.items()):
                for name in devices:
                    if (ref.uid, name) in self._identities:
                        continue
                    try:
                        status = await describe(name, ref)
                    except AgentError as error:  # asked again at the next refresh
                        log.debug("no prepared status", extra=log_fields(device=name, error=str(error)))
                        continue
                    if self._is_prepared(ref):  # (not unprepared while we were asking)
                        self._identities[(ref.uid, name)] = (
                            str(status.get(STATUS_UUID, "")),
                            str(status.get(STATUS_PARENT_UUID, "")),
                            str(status.get(STATUS_GPU_INSTANCE_ID, "")),
                        )
                        found.add(ref)
        return found

    def _is_prepared(self, ref: ClaimRef) -> bool:
        return any(ref in claims for claims in self._prepared.values())

    async def _from_pod_resources(self) -> dict[tuple[str, str], dict[str, frozenset[Consumer]]]:
        if self.pod_resources is None:
            return {}
        try:
            devices = await self.pod_resources.list_devices()
        except PodResourcesUnavailable as error:
            if not self._fallback_logged:
                self._fallback_logged = True
                log.info(
                    "PodResources unavailable; per-pod metrics name the pod from the claim's reservedFor "
                    "(no container)",
                    extra=log_fields(reason=str(error)),
                )
            return {}
        found: dict[tuple[str, str], dict[str, set[Consumer]]] = {}
        for d in devices:
            if d.pool and d.pool != self.node_name:
                continue
            # Kubelets before 1.31 give no device name: the container then uses every device.
            per_device = found.setdefault((d.claim_namespace, d.claim), {})
            per_device.setdefault(d.device, set()).add((d.pod_namespace, d.pod, d.container))
        return {key: {dev: frozenset(c) for dev, c in value.items()} for key, value in found.items()}

    async def _from_reserved_for(self, ref: ClaimRef) -> frozenset[Consumer]:
        cached = self._reserved_for.get(ref.uid)
        if cached is not None:
            return cached
        if self.claims is None:
            return frozenset()
        try:
            claim = await self.claims.get_resource_claim(ref.namespace, ref.name)
        except (KubeApiError, OSError, TimeoutError) as error:
            log.debug("cannot read claim for its pods", extra=log_fields(uid=ref.uid, error=str(error)))
            return frozenset()
        consumers = _pods(ref, claim)
        if self._is_prepared(ref):  # not unprepared while we were reading
            self._reserved_for[ref.uid] = consumers
        return consumers

    def _publish(self, driver: str, ref: ClaimRef) -> None:
        """Set the series of one prepared claim of `driver` from its devices and consumers."""
        consumers = self._consumers.get(ref.uid)
        if consumers is None:
            return  # not resolved yet: `run` is about to
        inventory = self.inventories.get(driver)
        allocations: list[Allocation] = []
        for name in self._prepared[driver][ref]:
            users = consumers.get(name) or consumers.get("") or frozenset({(ref.namespace, "", "")})
            device = inventory.device(name) if inventory is not None else None
            uuid, parent, instance = self._identities.get((ref.uid, name), ("", "", ""))
            for namespace, pod, container in users:
                allocations.append(
                    Allocation(
                        driver=driver,
                        pool=self.node_name,
                        device=name,
                        uuid=uuid or (device.uuid if device else ""),
                        pci_bus_id=device.pci_bus_id if device else "",
                        namespace=namespace,
                        pod=pod,
                        container=container,
                        claim=ref.name,
                        parent_uuid=parent,
                        gpu_instance_id=instance,
                    )
                )
        self.series.set_claim(driver, ref.uid, allocations)


def _pods(ref: ClaimRef, claim: Mapping[str, Any]) -> frozenset[Consumer]:
    """The pods a claim's ``reservedFor`` names (no container)."""
    return frozenset(
        (ref.namespace, str(r.get("name", "")), "")
        for r in _reserved_for(claim)
        if r.get("resource") == "pods" and r.get("name")
    )


def _reserved_for(claim: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    status = claim.get("status") or {}
    entries = status.get("reservedFor") or []
    return [e for e in entries if isinstance(e, Mapping)]
