"""The pool reconciler: current slices + desired devices -> the writes that make them equal.

Pure functions, no I/O. The rules are those of the Go slice controller
(``staging/src/k8s.io/dynamic-resource-allocation/resourceslice/resourceslicecontroller.go``,
``syncPool``), so consumers see our pool exactly as they see pools of drivers built on it:

- the pool's generation is the highest generation among its slices; slices with a lower one are
  obsolete and deleted, as are slices of our driver on this node in another pool;
- a current slice matches a desired one when both are the only slice, otherwise when they hold
  the same device names (unmatched current slices are deleted, unmatched desired ones created);
- the generation stays only when no slice is created and at most one matched slice changes;
  otherwise it goes up by one and every matched slice is rewritten with it, so that consumers
  never combine slices of two states of the pool (the API: a driver "must change the generation
  in all ResourceSlices" when it changes one or more resources of a pool);
- devices compare semantically (quantities by value, taints without ``timeAdded``) and in order.

`build_pool` is what ``--kube none`` prints: the creates of a pool with no current slices.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.core.model import Device
from agent.health.taints import ClusterTaintSupport, DeviceTaint
from agent.kube.slices import (
    MANAGED_BY,
    MANAGED_BY_LABEL,
    MAX_DEVICES_PER_SLICE_WITH_TAINTS,
    build_slice,
    chunk_names,
    counter_set_to_api,
    device_names,
    device_to_api,
    partitionable_layout,
    semantic_counters,
    semantic_device,
)
from agent.kube.validation import Problem, partition_entries

_NOT_NODE_LOCAL = ("nodeSelector", "allNodes", "perDeviceNodeSelection")


@dataclass(frozen=True)
class PoolTarget:
    """Whose pool: our driver on our node, the Node's uid (owner) and the API version to write."""

    driver: str
    node_name: str
    node_uid: str
    api_version: str = "v1"


@dataclass(frozen=True)
class DesiredPool:
    """The device entries of each slice to publish, and what was left out."""

    chunks: tuple[tuple[dict[str, Any], ...], ...]
    problems: tuple[Problem, ...] = ()
    taints: Mapping[str, Sequence[DeviceTaint]] = field(default_factory=dict)
    """The taints that are in `chunks`, by device (valid devices only)."""
    counters: tuple[tuple[dict[str, Any], ...], ...] = ()
    """The ``sharedCounters`` of each slice (as many as `chunks`), or () for a pool without them."""


@dataclass(frozen=True)
class PoolPlan:
    """The writes of one pass, in the order to send them: deletes, updates, creates."""

    generation: int
    deletes: tuple[Mapping[str, Any], ...] = ()
    updates: tuple[dict[str, Any], ...] = ()
    creates: tuple[dict[str, Any], ...] = ()

    @property
    def writes(self) -> int:
        return len(self.deletes) + len(self.updates) + len(self.creates)


def desired_pool(
    devices: Sequence[Device],
    taints: Mapping[str, Sequence[DeviceTaint]],
    *,
    support: ClusterTaintSupport,
    api_version: str = "v1",
    max_devices: int = MAX_DEVICES_PER_SLICE_WITH_TAINTS,
    minor: int | None = None,
) -> DesiredPool:
    """Device entries in `api_version`'s shape, checked against the server's rules, in slices.

    A device that breaks a rule is left out (a problem) so that the others still publish. A pool
    with shared counters (partitionable devices) is laid out for the served release `minor`
    (`partitionable_layout`; None: the newest rules).
    """
    entries: list[dict[str, Any]] = []
    problems: list[Problem] = []
    for device in devices:
        try:
            entries.append(device_to_api(device, taints.get(device.name, ()), api_version))
        except Exception as error:  # a malformed device must not stop the others
            problems.append(Problem(str(getattr(device, "name", "?")), "device", str(error), "conversion"))
    valid, rejected = partition_entries(entries, support)
    by_name = {str(e["name"]): dict(e) for e in valid}
    published = {n: taints[n] for n in by_name if taints.get(n)}
    if any(d.counter_sets or d.consumes_counters for d in devices):
        layout = partitionable_layout([d for d in devices if d.name in by_name], max_devices, minor)
        return DesiredPool(
            tuple(tuple(by_name[n] for n in names) for _, names in layout),
            (*problems, *rejected),
            published,
            tuple(tuple(counter_set_to_api(c) for c in sets) for sets, _ in layout),
        )
    chunks = tuple(tuple(by_name[n] for n in chunk) for chunk in chunk_names(list(by_name), max_devices))
    return DesiredPool(chunks, (*problems, *rejected), published)


def plan_pool(
    current: Sequence[Mapping[str, Any]],
    chunks: Sequence[Sequence[Mapping[str, Any]]],
    target: PoolTarget,
    counters: Sequence[Sequence[Mapping[str, Any]]] = (),
) -> PoolPlan:
    """The writes that turn `current` (our driver's slices on this node) into `chunks`.

    `counters` are the ``sharedCounters`` of each slice (`DesiredPool.counters`); a slice then
    matches on its counter set names as well as its device names.
    """
    shared = list(counters) or [()] * len(chunks)
    ours = [s for s in current if _pool(s).get("name") == target.node_name]
    obsolete = [s for s in current if _pool(s).get("name") != target.node_name]
    generation = max((_generation(s) for s in ours), default=0)
    obsolete += [s for s in ours if _generation(s) < generation]
    live = [s for s in ours if _generation(s) >= generation]

    matched: dict[int, Mapping[str, Any]] = {}
    if len(live) == 1 and len(chunks) == 1:
        matched[0] = live[0]
    else:
        for slice_obj in live:
            names = device_names(slice_obj)
            index = next(
                (
                    i
                    for i, chunk in enumerate(chunks)
                    if i not in matched
                    and len(chunk) == len(slice_obj.get("spec", {}).get("devices") or [])
                    and names == {str(e["name"]) for e in chunk}
                    and _set_names(slice_obj) == {str(c.get("name")) for c in shared[i]}
                ),
                None,
            )
            if index is None:
                obsolete.append(slice_obj)
            else:
                matched[index] = slice_obj

    count = len(chunks)
    changed = {
        i
        for i, slice_obj in matched.items()
        if _differs(slice_obj, chunks[i], target, generation=generation, count=count, counters=shared[i])
    }
    new = [i for i in range(count) if i not in matched]
    if new or len(changed) > 1:
        generation += 1
        changed = set(matched)

    def body(i: int, current_slice: Mapping[str, Any] | None) -> dict[str, Any]:
        return build_slice(
            driver=target.driver,
            node_name=target.node_name,
            node_uid=target.node_uid,
            entries=chunks[i],
            generation=generation,
            slice_count=count,
            api_version=target.api_version,
            current=current_slice,
            shared_counters=shared[i],
        )

    return PoolPlan(
        generation,
        deletes=tuple(obsolete),
        updates=tuple(body(i, matched[i]) for i in sorted(changed)),
        creates=tuple(body(i, None) for i in new),
    )


def build_pool(
    *,
    driver: str,
    node_name: str,
    node_uid: str,
    devices: Sequence[Device],
    taints: Mapping[str, Sequence[DeviceTaint]],
    support: ClusterTaintSupport | None = None,
    api_version: str = "v1",
    max_devices: int = MAX_DEVICES_PER_SLICE_WITH_TAINTS,
    minor: int | None = None,
) -> list[dict[str, Any]]:
    """The slices the publisher would create for `devices` in an empty cluster (``--kube none``).

    `minor` is the served release (34 for 1.34), which decides where shared counters go.
    """
    desired = desired_pool(
        devices,
        taints,
        support=support or ClusterTaintSupport(),
        api_version=api_version,
        max_devices=max_devices,
        minor=minor,
    )
    target = PoolTarget(driver, node_name, node_uid, api_version)
    return list(plan_pool([], desired.chunks, target, desired.counters).creates)


def _pool(slice_obj: Mapping[str, Any]) -> Mapping[str, Any]:
    pool = slice_obj.get("spec", {}).get("pool")
    return pool if isinstance(pool, Mapping) else {}


def _set_names(slice_obj: Mapping[str, Any]) -> set[str]:
    sets = slice_obj.get("spec", {}).get("sharedCounters") or []
    return {str(c.get("name")) for c in sets if isinstance(c, Mapping)}


def _generation(slice_obj: Mapping[str, Any]) -> int:
    try:
        return int(_pool(slice_obj).get("generation", 0) or 0)
    except (TypeError, ValueError):
        return 0


def _differs(
    current: Mapping[str, Any],
    entries: Sequence[Mapping[str, Any]],
    target: PoolTarget,
    *,
    generation: int,
    count: int,
    counters: Sequence[Mapping[str, Any]] = (),
) -> bool:
    spec = current.get("spec", {})
    pool = _pool(current)
    if (
        (pool.get("name"), _generation(current), pool.get("resourceSliceCount"))
        != (target.node_name, generation, count)
        or spec.get("nodeName") != target.node_name
        or any(spec.get(k) for k in _NOT_NODE_LOCAL)
        or semantic_counters(spec.get("sharedCounters")) != semantic_counters(list(counters))
    ):
        return True
    # Beyond the Go controller: our label, and the owner (a re-created Node has a new uid).
    meta = current.get("metadata", {})
    if (meta.get("labels") or {}).get(MANAGED_BY_LABEL) != MANAGED_BY:
        return True
    owners = [
        (o.get("kind"), o.get("name"), o.get("uid"), o.get("controller"))
        for o in meta.get("ownerReferences") or []
    ]
    if owners != [("Node", target.node_name, target.node_uid, True)]:
        return True
    have = [semantic_device(d) for d in spec.get("devices") or []]
    return have != [semantic_device(d) for d in entries]
