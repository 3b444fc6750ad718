"""Desired ResourceSlices: from devices and their taints to API objects (plain dicts).

Pure functions, shared by the publisher and by `dra-agent run --kube none`, which prints what it
would publish. The objects follow the API version the cluster serves: v1 and v1beta2 are flat,
v1beta1 wraps each device's fields in ``basic``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from agent.core.errors import QuantityError
from agent.core.model import MAX_COUNTER_SETS_PER_SLICE, CounterSet, Device, Version
from agent.core.quantity import Quantity
from agent.health.taints import DeviceTaint

MAX_DEVICES_PER_SLICE = 128
MAX_DEVICES_PER_SLICE_WITH_TAINTS = 64
API_GROUP = "resource.k8s.io"
API_VERSIONS = ("v1", "v1beta2", "v1beta1")


def qualify(name: str, driver: str) -> str:
    """Attribute names without a domain belong to the driver's domain."""
    return name if "/" in name else f"{driver}/{name}"


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
    if device.capacity:
        body["capacity"] = {
            _strip(k, device.driver): {"value": q.canonical()} for k, q in sorted(device.capacity.items())
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


def _strip(name: str, driver: str) -> str:
    prefix = driver + "/"
    return name[len(prefix) :] if name.startswith(prefix) else name


def chunk_devices(
    devices: Sequence[Device],
    tainted: set[str],
    max_devices: int = MAX_DEVICES_PER_SLICE,
    max_with_taints: int = MAX_DEVICES_PER_SLICE_WITH_TAINTS,
) -> list[list[Device]]:
    """Split devices into slices: at most `max_devices` each, `max_with_taints` if any is tainted.

    Devices keep a stable order (by name) so that one device's change touches one slice.
    """
    ordered = sorted(devices, key=lambda d: _natural_key(d.name))
    limit = max_with_taints if tainted else max_devices
    chunks = [list(ordered[i : i + limit]) for i in range(0, len(ordered), limit)]
    return chunks or [[]]


def _natural_key(name: str) -> list[Any]:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def build_slice(
    *,
    driver: str,
    node_name: str,
    node_uid: str,
    devices: Sequence[Device],
    taints: Mapping[str, Sequence[DeviceTaint]],
    generation: int,
    slice_count: int,
    api_version: str = "v1",
    name: str | None = None,
) -> dict[str, Any]:
    """One ResourceSlice object of our pool (``generateName`` unless `name` is given)."""
    metadata: dict[str, Any] = {
        "labels": {"app.kubernetes.io/managed-by": "dra-agent"},
    }
    if name:
        metadata["name"] = name
    else:
        metadata["generateName"] = f"{node_name}-{driver}-"
    if node_uid:
        metadata["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": node_uid, "controller": True}
        ]
    return {
        "apiVersion": f"{API_GROUP}/{api_version}",
        "kind": "ResourceSlice",
        "metadata": metadata,
        "spec": {
            "driver": driver,
            "nodeName": node_name,
            "pool": {"name": node_name, "generation": generation, "resourceSliceCount": slice_count},
            "devices": [device_to_api(d, taints.get(d.name, ()), api_version) for d in devices],
        },
    }


def build_pool(
    *,
    driver: str,
    node_name: str,
    node_uid: str,
    devices: Sequence[Device],
    taints: Mapping[str, Sequence[DeviceTaint]],
    generation: int = 0,
    api_version: str = "v1",
    max_with_taints: int = MAX_DEVICES_PER_SLICE_WITH_TAINTS,
    server_minor: int | None = None,
) -> list[dict[str, Any]]:
    """All slices of one driver's pool on this node (at least one, even when empty).

    A pool with partitionable devices (counter sets) is laid out by `build_partitionable_pool`
    for the served release `server_minor` (None: the newest rules).
    """
    if any(d.counter_sets or d.consumes_counters for d in devices):
        return build_partitionable_pool(
            driver=driver,
            node_name=node_name,
            node_uid=node_uid,
            devices=devices,
            taints=taints,
            generation=generation,
            api_version=api_version,
            max_with_taints=max_with_taints,
            server_minor=server_minor,
        )
    tainted = {name for name, ts in taints.items() if ts}
    chunks = chunk_devices(devices, tainted, max_with_taints=max_with_taints)
    return [
        build_slice(
            driver=driver,
            node_name=node_name,
            node_uid=node_uid,
            devices=chunk,
            taints=taints,
            generation=generation,
            slice_count=len(chunks),
            api_version=api_version,
        )
        for chunk in chunks
    ]


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
        tuple(sorted((str(k), _quantity_key(v)) for k, v in capacity.items())),
        tuple(sorted(taint_identity(t) for t in taints if isinstance(t, Mapping))),
        _consumption_key(flat.get("consumesCounters") or []),
    )


def _consumption_key(consumptions: Any) -> tuple[Any, ...]:
    """``consumesCounters`` by value, so a changed MIG placement is not taken for the stored one."""
    if not isinstance(consumptions, list):
        return ()
    return tuple(
        (
            str(c.get("counterSet")),
            tuple(sorted((str(k), _quantity_key(v)) for k, v in (c.get("counters") or {}).items())),
        )
        for c in consumptions
        if isinstance(c, Mapping)
    )


def device_names(slice_obj: Mapping[str, Any]) -> frozenset[str]:
    """The names of the devices of a slice object."""
    devices = slice_obj.get("spec", {}).get("devices") or []
    return frozenset(str(d.get("name")) for d in devices if isinstance(d, Mapping))


def chunk_names(
    names: Sequence[str], tainted: set[str], max_devices: int, max_with_taints: int
) -> list[list[str]]:
    """Split device names (natural order) into slices; one with a tainted device holds `max_with_taints`.

    Chunks fill greedily, so an untainted pool keeps the 128-device layout.
    """
    chunks: list[list[str]] = []
    current: list[str] = []
    current_tainted = False
    for name in natural_sorted(names):
        is_tainted = name in tainted
        limit = max_with_taints if (current_tainted or is_tainted) else max_devices
        if len(current) + 1 > limit:
            chunks.append(current)
            current, current_tainted = [], False
        current.append(name)
        current_tainted = current_tainted or is_tainted
    if current or not chunks:
        chunks.append(current)
    return chunks


# -- partitionable devices (DRAPartitionableDevices, KEP-4815) ---------------------------------

#: 1.33 and 1.34 (``validation.go`` of those releases): counters live in the slice of the devices
#: that consume them, at most 32 counters in all the counter sets of a slice, at most 32
#: counters per device and 1024 in all the devices of a slice.
MAX_SHARED_COUNTERS_1_34 = 32
MAX_DEVICE_COUNTERS_PER_SLICE_1_34 = 1024
#: From 1.35, ``sharedCounters`` and ``devices`` may not share a slice.
SEPARATE_COUNTERS_FROM = 35


def _counters_to_api(counters: Mapping[str, Quantity]) -> dict[str, Any]:
    return {k: {"value": q.canonical()} for k, q in sorted(counters.items())}


def counter_set_to_api(counter_set: CounterSet) -> dict[str, Any]:
    """One entry of ``spec.sharedCounters``."""
    return {"name": counter_set.name, "counters": _counters_to_api(counter_set.counters)}


def build_partitionable_pool(
    *,
    driver: str,
    node_name: str,
    node_uid: str,
    devices: Sequence[Device],
    taints: Mapping[str, Sequence[DeviceTaint]],
    generation: int = 0,
    api_version: str = "v1",
    max_with_taints: int = MAX_DEVICES_PER_SLICE_WITH_TAINTS,
    server_minor: int | None = None,
) -> list[dict[str, Any]]:
    """The slices of a pool whose devices consume shared counters, as the served release wants them.

    1.35 and later (upstream ``validateResourceSliceSpec``: "only one of `sharedCounters` or
    `devices` is allowed"): the counter sets go in slices of their own (8 sets each), the devices
    in slices of at most 64 (the limit once any device consumes counters). 1.33 and 1.34: each
    slice carries the counter sets its devices consume (a device may only name a set of its own
    slice), grouped while the slice stays within 32 shared counters, 128 devices and 1024
    consumed counters; devices that consume nothing follow in plain slices.
    """
    sets = [s for d in devices for s in d.counter_sets]
    if server_minor is None or server_minor >= SEPARATE_COUNTERS_FROM:
        groups: list[tuple[list[CounterSet], list[Device]]] = [
            (sets[i : i + MAX_COUNTER_SETS_PER_SLICE], [])
            for i in range(0, len(sets), MAX_COUNTER_SETS_PER_SLICE)
        ]
        limit = min(max_with_taints, MAX_DEVICES_PER_SLICE_WITH_TAINTS)
        groups += [([], chunk) for chunk in chunk_by_hardware(devices, limit)]
    else:
        groups = _shared_groups(sets, devices, max_with_taints, {n for n, ts in taints.items() if ts})
    out: list[dict[str, Any]] = []
    for counter_sets, members in groups:
        slice_obj = build_slice(
            driver=driver,
            node_name=node_name,
            node_uid=node_uid,
            devices=members,
            taints=taints,
            generation=generation,
            slice_count=len(groups),
            api_version=api_version,
        )
        if counter_sets:
            slice_obj["spec"]["sharedCounters"] = [counter_set_to_api(c) for c in counter_sets]
            if not members:
                del slice_obj["spec"]["devices"]
        out.append(slice_obj)
    return out


def offer_order(devices: Sequence[Device]) -> list[Device]:
    """Devices grouped by hardware (``parent``), the whole device first, then its partitions by name
    in reverse natural order.

    The scheduler allocates the first device that fits, in slice order (verified on 1.36). Partition
    names end with their placement start (``gpu-0-mig-3g40gb-9-4``), so offering the last start
    first packs partitions from the end and keeps the low placements free for the next claims:
    a 3g.40gb then takes slices 4-7 of an A100 and two 2g.20gb still fit at 0 and 2.
    """
    by_name = sorted(devices, key=lambda d: _natural_key(d.name), reverse=True)
    return sorted(by_name, key=lambda d: (_natural_key(d.parent or d.name), bool(d.parent)))


def chunk_by_hardware(devices: Sequence[Device], limit: int) -> list[list[Device]]:
    """Slices of at most `limit` devices in `offer_order`, keeping one piece of hardware in one slice."""
    groups: dict[str, list[Device]] = {}
    for device in offer_order(devices):
        groups.setdefault(device.parent or device.name, []).append(device)
    chunks: list[list[Device]] = []
    current: list[Device] = []
    for group in groups.values():
        if current and len(current) + len(group) > limit:
            chunks.append(current)
            current = []
        for device in group:  # a group larger than a slice is split
            if len(current) == limit:
                chunks.append(current)
                current = []
            current.append(device)
    if current:
        chunks.append(current)
    return chunks


def _device_counter_total(device: Device) -> int:
    return sum(len(c.counters) for c in device.consumes_counters)


def _shared_groups(
    sets: Sequence[CounterSet], devices: Sequence[Device], max_with_taints: int, tainted: set[str]
) -> list[tuple[list[CounterSet], list[Device]]]:
    """1.33/1.34 layout: counter sets packed with the devices that consume them."""
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
        size = len(counter_set.counters)
        counted = sum(_device_counter_total(d) for d in members)
        if groups:
            last_sets, last_devices = groups[-1]
            limit = (
                max_with_taints
                if tainted & {d.name for d in [*last_devices, *members]}
                else MAX_DEVICES_PER_SLICE
            )
            if (
                sum(len(s.counters) for s in last_sets) + size <= MAX_SHARED_COUNTERS_1_34
                and len(last_devices) + len(members) <= limit
                and sum(_device_counter_total(d) for d in last_devices) + counted
                <= MAX_DEVICE_COUNTERS_PER_SLICE_1_34
            ):
                last_sets.append(counter_set)
                last_devices.extend(members)
                continue
        groups.append(([counter_set], list(members)))
    groups += [
        ([], chunk) for chunk in chunk_devices(plain, tainted, max_with_taints=max_with_taints) if chunk
    ]
    return groups
