"""Desired ResourceSlices: from devices and their taints to API objects (plain dicts).

Pure functions, shared by the publisher and by `dra-agent run --kube none`, which prints what it
would publish. The objects follow the API version the cluster serves: v1 and v1beta2 are flat,
v1beta1 wraps each device's fields in ``basic``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from agent.core.errors import QuantityError
from agent.core.model import MAX_COUNTER_SETS_PER_SLICE, CounterSet, Device, Version
from agent.core.quantity import Quantity
from agent.health.taints import DeviceTaint

MAX_DEVICES_PER_SLICE = 128
"""Devices per slice (upstream ``ResourceSliceMaxDevices``)."""
MAX_DEVICES_PER_SLICE_WITH_TAINTS = 64
"""From 1.35, when a device has taints (``ResourceSliceMaxDevicesWithTaintsOrConsumesCounters``)."""
API_GROUP = "resource.k8s.io"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "dra-agent"


def attribute_to_api(value: bool | int | str | Version) -> dict[str, Any]:
    """``{"int": 1}``, ``{"bool": true}``, ``{"string": "x"}`` or ``{"version": "1.2.3"}``."""
    if isinstance(value, bool):
        return {"bool": value}
    if isinstance(value, int):
        return {"int": value}
    if isinstance(value, Version):
        return {"version": value.value}
    return {"string": value}


def taint_to_api(taint: DeviceTaint) -> dict[str, Any]:
    """A DeviceTaint object; timeAdded is set by the API server when absent."""
    out: dict[str, Any] = {"key": taint.key, "effect": taint.effect}
    if taint.value:
        out["value"] = taint.value
    if taint.time_added:
        out["timeAdded"] = taint.time_added
    return out


def device_to_api(
    device: Device, taints: Sequence[DeviceTaint] = (), api_version: str = "v1"
) -> dict[str, Any]:
    """One entry of ``spec.devices`` in the shape of `api_version`."""
    body: dict[str, Any] = {}
    if device.attributes:
        # Driver-domain attributes are written without the domain, as the vendor drivers do.
        body["attributes"] = {
            _strip(k, device.driver): attribute_to_api(v) for k, v in sorted(device.attributes.items())
        }
    if device.allow_multiple_allocations:
        body["allowMultipleAllocations"] = True
    if device.capacity:
        body["capacity"] = {
            _strip(k, device.driver): _capacity(device, k, q) for k, q in sorted(device.capacity.items())
        }
    if device.consumes_counters:
        body["consumesCounters"] = [
            {"counterSet": c.counter_set, "counters": _counters_to_api(c.counters)}
            for c in device.consumes_counters
        ]
    if taints:
        body["taints"] = [taint_to_api(t) for t in taints]
    if api_version == "v1beta1":
        return {"name": device.name, "basic": body}
    return {"name": device.name, **body}


def _capacity(device: Device, name: str, quantity: Quantity) -> dict[str, Any]:
    out: dict[str, Any] = {"value": quantity.canonical()}
    policy = device.request_policies.get(name)
    if policy is not None:
        out["requestPolicy"] = policy.to_api()
    return out


def _strip(name: str, driver: str) -> str:
    prefix = driver + "/"
    return name[len(prefix) :] if name.startswith(prefix) else name


def _natural_key(name: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def natural_sorted(names: Sequence[str]) -> list[str]:
    """Device names in natural order (``gpu-2`` before ``gpu-10``), the order slices use."""
    return sorted(names, key=_natural_key)


def flat_device(entry: Mapping[str, Any]) -> dict[str, Any]:
    """A ``spec.devices[]`` entry in the flat v1 shape (v1beta1's ``basic`` unwrapped)."""
    basic = entry.get("basic")
    if isinstance(basic, Mapping):
        return {"name": entry.get("name"), **basic}
    return dict(entry)


def _quantity_key(value: Any) -> Any:
    raw = value.get("value") if isinstance(value, Mapping) else value
    try:
        return Quantity.parse(raw).value if isinstance(raw, str | int) else raw
    except QuantityError:
        return raw


def _policy_key(value: Any) -> Any:
    """A request policy by quantity values (the API server canonicalizes them)."""
    policy = value.get("requestPolicy") if isinstance(value, Mapping) else None
    if not isinstance(policy, Mapping):
        return None
    valid_range = policy.get("validRange") or {}
    return (
        _quantity_key(policy.get("default")),
        tuple(_quantity_key(v) for v in policy.get("validValues") or []),
        tuple(_quantity_key(valid_range.get(k)) for k in ("min", "max", "step"))
        if isinstance(valid_range, Mapping)
        else (),
    )


def taint_identity(taint: Mapping[str, Any]) -> tuple[str, str, str]:
    """What makes two taints the same, ignoring ``timeAdded`` (which the API server fills in)."""
    return (str(taint.get("key", "")), str(taint.get("value", "") or ""), str(taint.get("effect", "")))


def semantic_device(entry: Mapping[str, Any]) -> tuple[Any, ...]:
    """A comparable form of a device entry: quantities by value, taints without ``timeAdded``.

    Equal forms mean the API server already stores what we would write, so no write is needed.
    """
    flat = flat_device(entry)
    attributes = flat.get("attributes") or {}
    capacity = flat.get("capacity") or {}
    taints = flat.get("taints") or []
    return (
        flat.get("name"),
        tuple(
            sorted(
                (str(k), repr(sorted(v.items())) if isinstance(v, Mapping) else repr(v))
                for k, v in attributes.items()
            )
        ),
        tuple(sorted((str(k), _quantity_key(v), repr(_policy_key(v))) for k, v in capacity.items())),
        tuple(sorted(taint_identity(t) for t in taints if isinstance(t, Mapping))),
        flat.get("allowMultipleAllocations") is True,
        _consumption_key(flat.get("consumesCounters") or []),
    )


def _consumption_key(consumptions: Any) -> tuple[Any, ...]:
    """``consumesCounters`` (or ``sharedCounters``) by value, so a moved MIG placement is a change."""
    if not isinstance(consumptions, list):
        return ()
    return tuple(
        (
            str(c.get("counterSet", c.get("name"))),
            tuple(sorted((str(k), _quantity_key(v)) for k, v in (c.get("counters") or {}).items())),
        )
        for c in consumptions
        if isinstance(c, Mapping)
    )


def semantic_counters(counter_sets: Any) -> tuple[Any, ...]:
    """A comparable form of ``spec.sharedCounters`` (quantities by value)."""
    return _consumption_key(counter_sets or [])


def device_names(slice_obj: Mapping[str, Any]) -> frozenset[str]:
    """The names of the devices of a slice object."""
    devices = slice_obj.get("spec", {}).get("devices") or []
    return frozenset(str(d.get("name")) for d in devices if isinstance(d, Mapping))


def chunk_names(names: Sequence[str], max_devices: int) -> list[list[str]]:
    """Split device names (natural order) into slices of at most `max_devices` (at least one slice).

    A stable order keeps one device's change inside one slice.
    """
    ordered = natural_sorted(names)
    chunks = [ordered[i : i + max_devices] for i in range(0, len(ordered), max_devices)]
    return chunks or [[]]


def keep_time_added(entry: Mapping[str, Any], stored: Mapping[str, Any] | None) -> dict[str, Any]:
    """`entry` with the stored ``timeAdded`` of taints that stay (key, value and effect equal).

    As the Go slice controller's ``copyTaintTimeAdded``: an update must not reset when a taint began.
    """
    if not stored:
        return dict(entry)
    times = {
        taint_identity(t): t["timeAdded"]
        for t in flat_device(stored).get("taints") or []
        if isinstance(t, Mapping) and t.get("timeAdded")
    }
    wrapped = "basic" in entry
    body = dict(entry["basic"] if wrapped else entry)
    if not times or not body.get("taints"):
        return dict(entry)
    body["taints"] = [
        {**t, "timeAdded": times[taint_identity(t)]}
        if "timeAdded" not in t and taint_identity(t) in times
        else t
        for t in body["taints"]
    ]
    return {"name": entry.get("name"), "basic": body} if wrapped else body


def build_slice(
    *,
    driver: str,
    node_name: str,
    node_uid: str,
    entries: Sequence[Mapping[str, Any]],
    generation: int,
    slice_count: int,
    api_version: str = "v1",
    current: Mapping[str, Any] | None = None,
    shared_counters: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """One ResourceSlice of our pool (named after the node), owned by the Node.

    The only slice builder: the publisher writes what it returns and ``--kube none`` prints it.
    A new slice gets ``generateName``; an update of `current` keeps its metadata (name,
    resourceVersion for the precondition) and the ``timeAdded`` of taints that stay.
    """
    if current is not None:
        metadata = {k: v for k, v in current.get("metadata", {}).items() if k != "managedFields"}
        stored = {str(d.get("name")): d for d in current.get("spec", {}).get("devices") or []}
        entries = [keep_time_added(e, stored.get(str(e.get("name")))) for e in entries]
    else:
        metadata = {"generateName": f"{node_name}-{driver}-"}
    metadata["labels"] = {**metadata.get("labels", {}), MANAGED_BY_LABEL: MANAGED_BY}
    metadata["ownerReferences"] = [
        {"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": node_uid, "controller": True}
    ]
    slice_obj: dict[str, Any] = {
        "apiVersion": f"{API_GROUP}/{api_version}",
        "kind": "ResourceSlice",
        "metadata": metadata,
        "spec": {
            "driver": driver,
            "nodeName": node_name,
            "pool": {"name": node_name, "generation": generation, "resourceSliceCount": slice_count},
            "devices": [dict(e) for e in entries],
        },
    }
    if shared_counters:
        slice_obj["spec"]["sharedCounters"] = [dict(c) for c in shared_counters]
        if not entries:
            # From 1.35 a slice holds counters or devices; an empty list counts as set.
            del slice_obj["spec"]["devices"]
    return slice_obj


# -- partitionable devices (DRAPartitionableDevices, KEP-4815) ---------------------------------

MAX_SHARED_COUNTERS_1_34 = 32
"""1.33/1.34 ``ResourceSliceMaxSharedCounters``: counters in all the counter sets of a slice."""
MAX_DEVICE_COUNTERS_PER_SLICE_1_34 = 1024
"""1.33/1.34 ``ResourceSliceMaxDeviceCountersPerSlice``: counters consumed by all devices of a slice."""
SEPARATE_COUNTERS_FROM = 35
"""From 1.35 ``sharedCounters`` and ``devices`` may not share a slice."""


def server_minor(git_version: str) -> int | None:
    """34 for ``v1.34.2`` (None when the version cannot be read)."""
    match = re.match(r"^v?1\.(\d+)", git_version or "")
    return int(match.group(1)) if match else None


def _counters_to_api(counters: Mapping[str, Quantity]) -> dict[str, Any]:
    return {k: {"value": q.canonical()} for k, q in sorted(counters.items())}


def counter_set_to_api(counter_set: CounterSet) -> dict[str, Any]:
    """One entry of ``spec.sharedCounters``."""
    return {"name": counter_set.name, "counters": _counters_to_api(counter_set.counters)}


def offer_order(devices: Sequence[Device]) -> list[Device]:
    """Devices grouped by hardware (``parent``), the whole device first, then its partitions in the
    backend's order.

    The scheduler allocates the first device that fits, in slice order (structured allocator,
    ``allocateOne``: pools, their slices, each slice's devices in index order). So the backend's
    order of a GPU's partitions is the packing policy: dynamic MIG lists the smallest profiles
    first and each profile's placements so that larger profiles keep room
    (`backends.nvidia.migprofiles.packing_order`). The sort is stable.
    """
    return sorted(devices, key=lambda d: (_natural_key(d.parent or d.name), bool(d.parent)))


def partitionable_layout(
    devices: Sequence[Device], max_devices: int, minor: int | None
) -> list[tuple[list[CounterSet], list[str]]]:
    """(counter sets, device names) of each slice of a pool with shared counters.

    From 1.35 (upstream ``validateResourceSliceSpec``: "only one of `sharedCounters` or `devices`
    is allowed"), counter sets go in slices of their own (8 each, ``ResourceSliceMaxCounterSets``)
    and devices in slices of at most 64 (``ResourceSliceMaxDevicesWithTaintsOrConsumesCounters``),
    one piece of hardware per slice where it fits. In 1.33 and 1.34 a device may only consume a
    set of its own slice: each set goes with its consumers, sets sharing a slice while it stays
    within 32 shared counters, `max_devices` devices and 1024 consumed counters; devices that
    consume nothing follow in plain slices.
    """
    sets = [s for d in devices for s in d.counter_sets]
    if minor is None or minor >= SEPARATE_COUNTERS_FROM:
        layout: list[tuple[list[CounterSet], list[str]]] = [
            (sets[i : i + MAX_COUNTER_SETS_PER_SLICE], [])
            for i in range(0, len(sets), MAX_COUNTER_SETS_PER_SLICE)
        ]
        return layout + [([], names) for names in _by_hardware(devices, min(max_devices, 64))]
    return _shared_layout(sets, devices, max_devices)


def _by_hardware(devices: Sequence[Device], limit: int) -> list[list[str]]:
    groups: dict[str, list[str]] = {}
    for device in offer_order(devices):
        groups.setdefault(device.parent or device.name, []).append(device.name)
    chunks: list[list[str]] = []
    current: list[str] = []
    for group in groups.values():
        if current and len(current) + len(group) > limit:
            chunks.append(current)
            current = []
        for name in group:  # a group larger than a slice is split
            if len(current) == limit:
                chunks.append(current)
                current = []
            current.append(name)
    if current:
        chunks.append(current)
    return chunks


def _consumed(device: Device) -> int:
    return sum(len(c.counters) for c in device.consumes_counters)


def _shared_layout(
    sets: Sequence[CounterSet], devices: Sequence[Device], max_devices: int
) -> list[tuple[list[CounterSet], list[str]]]:
    consumers: dict[str, list[Device]] = {s.name: [] for s in sets}
    plain: list[Device] = []
    for device in offer_order(devices):
        named = [c.counter_set for c in device.consumes_counters if c.counter_set in consumers]
        if named:
            consumers[named[0]].append(device)
        else:
            plain.append(device)
    groups: list[tuple[list[CounterSet], list[Device]]] = []
    for counter_set in sets:
        members = consumers[counter_set.name]
        if groups:
            last_sets, last_devices = groups[-1]
            if (
                sum(len(s.counters) for s in last_sets) + len(counter_set.counters)
                <= MAX_SHARED_COUNTERS_1_34
                and len(last_devices) + len(members) <= max_devices
                and sum(_consumed(d) for d in [*last_devices, *members]) <= MAX_DEVICE_COUNTERS_PER_SLICE_1_34
            ):
                last_sets.append(counter_set)
                last_devices.extend(members)
                continue
        groups.append(([counter_set], list(members)))
    layout = [(group_sets, [d.name for d in members]) for group_sets, members in groups]
    names = [d.name for d in plain]
    return layout + [([], names[i : i + max_devices]) for i in range(0, len(names), max_devices)]


def without_counters(devices: Sequence[Device]) -> tuple[list[Device], list[str]]:
    """What a pool may hold where the API server drops counters (``DRAPartitionableDevices`` off).

    A device that carries counter sets (the whole hardware, a whole GPU) is published without
    its counters, alone: it overlaps nothing published. A device that consumes counters and
    carries none (a MIG placement) would overlap it and its siblings unseen by the scheduler, so
    it is withheld; returns (devices to publish, names withheld).
    """
    kept: list[Device] = []
    withheld: list[str] = []
    for device in devices:
        if device.counter_sets:
            kept.append(dataclasses.replace(device, counter_sets=(), consumes_counters=()))
        elif device.consumes_counters:
            withheld.append(device.name)
        else:
            kept.append(device)
    return kept, withheld


def without_shares(devices: Sequence[Device]) -> tuple[list[Device], list[str]]:
    """What a pool may hold where the API server drops the sharing fields (``DRAConsumableCapacity``
    off): each shareable device without ``allowMultipleAllocations`` and its request policies, as
    the server would store it (for exclusive use); returns (devices to publish, names changed)."""
    kept: list[Device] = []
    changed: list[str] = []
    for device in devices:
        if device.allow_multiple_allocations:
            kept.append(dataclasses.replace(device, allow_multiple_allocations=False, request_policies={}))
            changed.append(device.name)
        else:
            kept.append(device)
    return kept, changed
