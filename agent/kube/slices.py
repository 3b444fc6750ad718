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
from agent.core.model import Device, Version
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
    if device.allow_multiple_allocations:
        body["allowMultipleAllocations"] = True
    if device.capacity:
        body["capacity"] = {
            _strip(k, device.driver): _capacity(device, k, q) for k, q in sorted(device.capacity.items())
        }
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
) -> list[dict[str, Any]]:
    """All slices of one driver's pool on this node (at least one, even when empty)."""
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
