"""What the API server accepts in a ResourceSlice, learnt by asking it rather than from its version.

Feature gates, not the minor version, decide whether device taints survive in a slice
(``DRADeviceTaints``, ``pkg/features/kube_features.go``: alpha and off from 1.33, beta and on
by default from 1.36) and the release decides the limits (4 taints per device before 1.35, 16 and the
``None`` effect from 1.35, when a slice with a tainted device also holds at most 64 devices).
So the publisher sends a server-side dry-run create of a probe slice (nothing is stored):

1. one device with five taints, one of them with the ``None`` effect: accepted means the 1.35
   rules; the answer keeps the taints only when the gate is on;
2. if that is refused as invalid, one device with one ``NoSchedule`` taint: accepted means the
   older rules; again the answer shows whether taints are kept.

The probe runs at start and again when the server's version changes (a control-plane upgrade),
once per process for all drivers (`agent.kube.nodecache`).
When it cannot run (an old server without dry-run, a network error) the version decides, as
a guess, until the next probe succeeds.

Shared counters and their consumption (partitionable devices) survive only with
``DRAPartitionableDevices`` (alpha and off from 1.33, beta and on by default from 1.36): with the
gate off the API server drops ``sharedCounters`` and ``consumesCounters``
(``dropDisabledDRAPartitionableDevicesFields`` in ``pkg/registry/resource/resourceslice/strategy.go``),
and devices that overlap would all look free. A pool that has counters asks with one more dry-run
create (`probe_counters`): a slice holding one counter set, kept or dropped.

Shareable devices (consumable capacity) keep ``allowMultipleAllocations`` and each capacity's
``requestPolicy`` only with ``DRAConsumableCapacity`` (alpha and off in 1.34 and 1.35, beta and on
by default from 1.36): with the gate off the API server drops both
(``dropDisabledDRAConsumableCapacityFields``, same file) and the scheduler allocates the devices
exclusively. A pool with shareable devices asks with a dry-run create too (`probe_shares`): a
slice holding one device with ``allowMultipleAllocations``, kept or dropped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from agent.core.errors import KubeApiError
from agent.core.logs import log_fields
from agent.health.taints import EFFECT_NO_SCHEDULE, EFFECT_NONE, ClusterTaintSupport
from agent.kube.client import ServerInfo
from agent.kube.slices import (
    MAX_DEVICES_PER_SLICE,
    MAX_DEVICES_PER_SLICE_WITH_TAINTS,
    build_slice,
    flat_device,
)

PROBE_DEVICE = "dra-agent-probe"
_NEW_RULES_TAINTS = 5  # one more than the 4 allowed before 1.35


class SliceProber(Protocol):
    """What the probe needs of `agent.kube.client.KubeClient`."""

    async def dry_run_create_resource_slice(self, body: Mapping[str, Any]) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Capabilities:
    """What our slices may carry on this server."""

    server_version: str
    slice_taints: bool
    """The server keeps device taints in slices (``DRADeviceTaints`` on)."""
    max_taints_per_device: int
    none_effect: bool
    probed: bool = True
    """False for a guess from the version (the probe could not run)."""
    counters: bool | None = None
    """The server keeps shared counters (``DRAPartitionableDevices`` on); None: not asked yet."""
    shares: bool | None = None
    """The server keeps ``allowMultipleAllocations`` (``DRAConsumableCapacity`` on); None: not asked yet."""

    @property
    def taint_support(self) -> ClusterTaintSupport:
        return ClusterTaintSupport(
            max_taints_per_device=self.max_taints_per_device, none_effect=self.none_effect
        )

    @property
    def max_devices_per_slice(self) -> int:
        """64 where the 1.35 rules apply (taints or not, so one taint never reshapes the pool)."""
        return MAX_DEVICES_PER_SLICE_WITH_TAINTS if self.none_effect else MAX_DEVICES_PER_SLICE

    def without_slice_taints(self) -> Capabilities:
        """These capabilities once a real write showed the taints dropped."""
        return dataclasses.replace(self, slice_taints=False)

    def with_counters(self, kept: bool | None) -> Capabilities:
        """These capabilities once a probe or a real write showed whether counters are kept
        (None: to be asked again)."""
        return dataclasses.replace(self, counters=kept)

    def with_shares(self, kept: bool | None) -> Capabilities:
        """The same for the sharing fields (`shares`)."""
        return dataclasses.replace(self, shares=kept)


def guess(info: ServerInfo) -> Capabilities:
    """Capabilities from the version alone (used only while the probe cannot run)."""
    support = info.taint_support
    return Capabilities(
        info.git_version,
        info.slice_taints_possible,
        support.max_taints_per_device,
        support.none_effect,
        probed=False,
    )


async def probe(kube: SliceProber, info: ServerInfo, *, driver: str, node_name: str) -> Capabilities:
    """Ask the server with dry-run creates; raises `KubeApiError` when it cannot answer."""
    new_rules = [
        (f"{driver}/probe-{i}", EFFECT_NONE if i == 0 else EFFECT_NO_SCHEDULE)
        for i in range(_NEW_RULES_TAINTS)
    ]
    try:
        kept = await _try(kube, info, driver, node_name, new_rules)
    except KubeApiError as error:
        if error.status not in (400, 422):
            raise
        kept = await _try(kube, info, driver, node_name, [(f"{driver}/probe-0", EFFECT_NO_SCHEDULE)])
        return Capabilities(info.git_version, kept, 4, False)
    if not kept:
        # Dropped before validation, so the limits stay unknown: the version's are the best guess.
        return dataclasses.replace(guess(info), slice_taints=False, probed=True)
    return Capabilities(info.git_version, True, 16, True)


async def _dry_run(
    kube: SliceProber,
    info: ServerInfo,
    driver: str,
    node_name: str,
    entries: list[dict[str, Any]],
    **more: Any,
) -> dict[str, Any]:
    """The spec the server answers a dry-run create of a probe slice with (nothing is stored)."""
    body = build_slice(
        driver=driver,
        node_name=node_name,
        node_uid="",
        entries=entries,
        generation=1,
        slice_count=1,
        api_version=info.slice_version,
        **more,
    )
    body["metadata"].pop("ownerReferences")  # nothing is stored; the owner's uid is not needed
    answer = await kube.dry_run_create_resource_slice(body)
    spec = answer.get("spec", {})
    return spec if isinstance(spec, dict) else {}


def _probe_device(info: ServerInfo, **fields: Any) -> dict[str, Any]:
    """The probe device with `fields`, nested under ``basic`` for v1beta1."""
    if info.slice_version == "v1beta1":
        return {"name": PROBE_DEVICE, "basic": fields}
    return {"name": PROBE_DEVICE, **fields}


def _devices(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [flat_device(d) for d in spec.get("devices") or [] if isinstance(d, Mapping)]


async def _try(
    kube: SliceProber, info: ServerInfo, driver: str, node_name: str, taints: list[tuple[str, str]]
) -> bool:
    """Whether the server kept the taints of an accepted probe slice."""
    entry = _probe_device(info, taints=[{"key": k, "effect": e} for k, e in taints])
    spec = await _dry_run(kube, info, driver, node_name, [entry])
    return any(d.get("taints") for d in _devices(spec))


async def probe_counters(kube: SliceProber, info: ServerInfo, *, driver: str, node_name: str) -> bool:
    """Whether the server keeps a slice's ``sharedCounters``; raises `KubeApiError` when it cannot answer."""
    counters = [{"name": PROBE_DEVICE, "counters": {"probe": {"value": "1"}}}]
    spec = await _dry_run(kube, info, driver, node_name, [], shared_counters=counters)
    return bool(spec.get("sharedCounters"))


async def probe_shares(kube: SliceProber, info: ServerInfo, *, driver: str, node_name: str) -> bool:
    """Whether the server keeps a device's ``allowMultipleAllocations``; raises `KubeApiError` when it
    cannot answer."""
    spec = await _dry_run(kube, info, driver, node_name, [_probe_device(info, allowMultipleAllocations=True)])
    return any(d.get("allowMultipleAllocations") for d in _devices(spec))


def describe(capabilities: Capabilities, **more: Any) -> dict[str, Any]:
    """Log fields for `capabilities` (and `more`)."""
    return log_fields(
        **more,
        server=capabilities.server_version,
        slice_taints=capabilities.slice_taints,
        max_taints_per_device=capabilities.max_taints_per_device,
        none_effect=capabilities.none_effect,
        probed=capabilities.probed,
        counters=capabilities.counters,
        shares=capabilities.shares,
    )
