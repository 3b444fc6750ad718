"""Unknown-field handling for resource.k8s.io bodies, as the apiserver's decoder does it.

By default (``fieldValidation=Warn``) unknown fields are dropped and reported in a ``Warning``
header; with ``fieldValidation=Strict`` they fail the request with 400. A v1-shaped device sent to
v1beta1 (fields outside ``basic``) is the classic mistake this catches. Only the parts of the schema
a node agent writes are described; other fields pass through.
"""

from __future__ import annotations

import json
from typing import Any

from agent.emulator.resources import RESOURCE_GROUP, ResourceType

JSON = dict[str, Any]

_TOP = frozenset({"apiVersion", "kind", "metadata", "spec", "status"})
_SLICE_SPEC = frozenset(
    {
        "driver",
        "pool",
        "nodeName",
        "nodeSelector",
        "allNodes",
        "devices",
        "perDeviceNodeSelection",
        "sharedCounters",
    }
)
_POOL = frozenset({"name", "generation", "resourceSliceCount"})
_DEVICE_FIELDS = frozenset(
    {
        "attributes",
        "capacity",
        "consumesCounters",
        "nodeName",
        "nodeSelector",
        "allNodes",
        "taints",
        "bindsToNode",
        "bindingConditions",
        "bindingFailureConditions",
        "allowMultipleAllocations",
    }
)
#: Device fields of one release only: ``DRANodeAllocatableResources`` (alpha) named the field
#: ``nodeAllocatableResourceMappings`` in 1.36 and ``nodeAllocatableResources`` from 1.37 (the old
#: name is unknown there).
_DEVICE_FIELDS_BY_MINOR: dict[int, frozenset[str]] = {
    36: frozenset({"nodeAllocatableResourceMappings"}),
    37: frozenset({"nodeAllocatableResources"}),
}
#: Slice spec fields new in 1.37 (alpha: DRAPartitionableDevicesType, DRAOptionalNodeOperations).
_SLICE_SPEC_1_37 = frozenset({"partitionTypeAttribute", "skipNodeOperations"})
_TAINT = frozenset({"key", "value", "effect", "timeAdded"})
_ATTRIBUTE = frozenset({"int", "bool", "string", "version"})
#: ``DRAListTypeAttributes`` fields, new in the 1.36 API.
_LIST_ATTRIBUTE = frozenset({"bools", "ints", "strings", "versions"})
_CAPACITY = frozenset({"value", "requestPolicy"})
_REQUEST_POLICY = frozenset({"default", "validValues", "validRange"})
_RANGE = frozenset({"min", "max", "step"})
_COUNTER_SET = frozenset({"name", "counters"})
_CONSUMPTION = frozenset({"counterSet", "counters"})
_COUNTER = frozenset({"value"})
_METADATA = frozenset(
    {
        "name",
        "generateName",
        "namespace",
        "selfLink",
        "uid",
        "resourceVersion",
        "generation",
        "creationTimestamp",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
        "labels",
        "annotations",
        "ownerReferences",
        "finalizers",
        "managedFields",
    }
)


def prune_unknown(rtype: ResourceType, version: str, body: JSON, minor: int = 35) -> list[str]:
    """Remove unknown fields from body in place; returns their paths (served-version shape).

    ``metadata`` is checked for every type; the rest only for resource.k8s.io objects. ``minor`` is the
    served release's minor version (fields added in a release are unknown before it).
    """
    unknown: list[str] = []
    if isinstance(body.get("metadata"), dict):
        _prune(body["metadata"], _METADATA, "metadata.", unknown)
    if rtype.group != RESOURCE_GROUP:
        return unknown
    _prune(body, _TOP, "", unknown)
    if rtype.plural != "resourceslices":
        return unknown
    spec = body.get("spec")
    if not isinstance(spec, dict):
        return unknown
    _prune(spec, _SLICE_SPEC | (_SLICE_SPEC_1_37 if minor >= 37 else frozenset()), "spec.", unknown)
    if isinstance(spec.get("pool"), dict):
        _prune(spec["pool"], _POOL, "spec.pool.", unknown)
    counter_sets = spec.get("sharedCounters")
    for i, counter_set in enumerate(counter_sets if isinstance(counter_sets, list) else []):
        if isinstance(counter_set, dict):
            _prune_counters(counter_set, _COUNTER_SET, f"spec.sharedCounters[{i}].", unknown)
    attribute_fields = _ATTRIBUTE | _LIST_ATTRIBUTE if minor >= 36 else _ATTRIBUTE
    device_fields = _DEVICE_FIELDS | _DEVICE_FIELDS_BY_MINOR.get(min(minor, 37), frozenset())
    devices = spec.get("devices")
    for i, device in enumerate(devices if isinstance(devices, list) else []):
        if not isinstance(device, dict):
            continue
        path = f"spec.devices[{i}]."
        if version == "v1beta1":
            _prune(device, frozenset({"name", "basic"}), path, unknown)
            fields = device.get("basic")
            path += "basic."
        else:
            _prune(device, device_fields | {"name"}, path, unknown)
            fields = device
        if not isinstance(fields, dict):
            continue
        if fields is not device:
            _prune(fields, device_fields, path, unknown)
        for name, attribute in _map(fields.get("attributes")):
            if isinstance(attribute, dict):
                _prune(attribute, attribute_fields, f"{path}attributes.{name}.", unknown)
        for name, capacity in _map(fields.get("capacity")):
            if isinstance(capacity, dict):
                _prune_capacity(capacity, f"{path}capacity.{name}.", unknown)
        consumptions = fields.get("consumesCounters")
        for j, item in enumerate(consumptions if isinstance(consumptions, list) else []):
            if isinstance(item, dict):
                _prune_counters(item, _CONSUMPTION, f"{path}consumesCounters[{j}].", unknown)
        taints = fields.get("taints")
        for j, item in enumerate(taints if isinstance(taints, list) else []):
            if isinstance(item, dict):
                _prune(item, _TAINT, f"{path}taints[{j}].", unknown)
    return unknown


def _prune_capacity(capacity: JSON, path: str, unknown: list[str]) -> None:
    _prune(capacity, _CAPACITY, path, unknown)
    policy = capacity.get("requestPolicy")
    if isinstance(policy, dict):
        _prune(policy, _REQUEST_POLICY, f"{path}requestPolicy.", unknown)
        if isinstance(policy.get("validRange"), dict):
            _prune(policy["validRange"], _RANGE, f"{path}requestPolicy.validRange.", unknown)


def _prune_counters(item: JSON, known: frozenset[str], path: str, unknown: list[str]) -> None:
    _prune(item, known, path, unknown)
    for name, counter in _map(item.get("counters")):
        if isinstance(counter, dict):
            _prune(counter, _COUNTER, f"{path}counters.{name}.", unknown)


def parse_json(raw: bytes) -> tuple[Any, list[str]]:
    """Decode a JSON body; also returns the paths of keys given twice in one object (the decoder's
    ``duplicate field`` strict error), the last value winning as in Go."""
    duplicates: list[str] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        repeated = []
        for key, value in items:
            if key in out:
                repeated.append(key)
            out[key] = value
        if repeated:
            out[_REPEATED] = repeated
        return out

    return _collect(json.loads(raw, object_pairs_hook=pairs), "", duplicates), duplicates


_REPEATED = "\x00repeated"


def _collect(value: Any, path: str, duplicates: list[str]) -> Any:
    if isinstance(value, list):
        return [_collect(item, f"{path}[{i}]", duplicates) for i, item in enumerate(value)]
    if not isinstance(value, dict):
        return value
    for key in value.pop(_REPEATED, []):
        duplicates.append(f"{path}.{key}" if path else key)
    return {k: _collect(v, f"{path}.{k}" if path else k, duplicates) for k, v in value.items()}


def _map(value: object) -> list[tuple[str, Any]]:
    return [(str(k), v) for k, v in value.items()] if isinstance(value, dict) else []


def _prune(obj: JSON, known: frozenset[str], prefix: str, unknown: list[str]) -> None:
    for key in [k for k in obj if k not in known]:
        del obj[key]
        unknown.append(f"{prefix}{key}")


# ----- type checking, as the decoder does before validation ------------------------------------------
# A type is "string", "integer", "boolean", "object" (any JSON object), "any", "quantity" (string or
# integer), ("list", T), ("map", T) or a dict of field -> T (a struct; unknown fields were pruned).
Type = Any

_OBJ = "object"
_TAINT_T: Type = {"key": "string", "value": "string", "effect": "string", "timeAdded": "string"}
_OWNER_T: Type = {
    "apiVersion": "string",
    "kind": "string",
    "name": "string",
    "uid": "string",
    "controller": "boolean",
    "blockOwnerDeletion": "boolean",
}
METADATA_T: Type = {
    "name": "string",
    "generateName": "string",
    "namespace": "string",
    "uid": "string",
    "resourceVersion": "string",
    "generation": "integer",
    "creationTimestamp": "string",
    "deletionTimestamp": "string",
    "deletionGracePeriodSeconds": "integer",
    "labels": ("map", "string"),
    "annotations": ("map", "string"),
    "ownerReferences": ("list", _OWNER_T),
    "finalizers": ("list", "string"),
    "managedFields": ("list", _OBJ),
    "selfLink": "string",
}
_COUNTERS_T: Type = ("map", {"value": "quantity"})
_POLICY_T: Type = {
    "default": "quantity",
    "validValues": ("list", "quantity"),
    "validRange": {"min": "quantity", "max": "quantity", "step": "quantity"},
}
_DEVICE_T: Type = {
    "name": "string",
    "attributes": (
        "map",
        {
            "int": "integer",
            "bool": "boolean",
            "string": "string",
            "version": "string",
            "ints": ("list", "integer"),
            "bools": ("list", "boolean"),
            "strings": ("list", "string"),
            "versions": ("list", "string"),
        },
    ),
    "capacity": ("map", {"value": "quantity", "requestPolicy": _POLICY_T}),
    "consumesCounters": ("list", {"counterSet": "string", "counters": _COUNTERS_T}),
    "nodeName": "string",
    "nodeSelector": _OBJ,
    "allNodes": "boolean",
    "taints": ("list", _TAINT_T),
    "bindsToNode": "boolean",
    "bindingConditions": ("list", "string"),
    "bindingFailureConditions": ("list", "string"),
    "allowMultipleAllocations": "boolean",
}
SLICE_T: Type = {
    "spec": {
        "driver": "string",
        "pool": {"name": "string", "generation": "integer", "resourceSliceCount": "integer"},
        "nodeName": "string",
        "nodeSelector": _OBJ,
        "allNodes": "boolean",
        "perDeviceNodeSelection": "boolean",
        "sharedCounters": ("list", {"name": "string", "counters": _COUNTERS_T}),
        "devices": ("list", _DEVICE_T),
    }
}
_EXACT_T: Type = {
    "deviceClassName": "string",
    "selectors": ("list", _OBJ),
    "allocationMode": "string",
    "count": "integer",
    "adminAccess": "boolean",
    "tolerations": ("list", _OBJ),
    "capacity": _OBJ,
}
_CLAIM_SPEC_T: Type = {
    "devices": {
        "requests": ("list", {"name": "string", "exactly": _EXACT_T, "firstAvailable": ("list", _OBJ)}),
        "constraints": ("list", _OBJ),
        "config": ("list", _OBJ),
    }
}
CLAIM_T: Type = {
    "spec": _CLAIM_SPEC_T,
    "status": {
        "allocation": {
            "devices": {
                "results": (
                    "list",
                    {
                        "request": "string",
                        "driver": "string",
                        "pool": "string",
                        "device": "string",
                        "adminAccess": "boolean",
                        "tolerations": ("list", _OBJ),
                        "shareID": "string",
                        "consumedCapacity": _OBJ,
                        "bindingConditions": ("list", "string"),
                        "bindingFailureConditions": ("list", "string"),
                    },
                ),
                "config": ("list", _OBJ),
            },
            "nodeSelector": _OBJ,
            "allocationTimestamp": "string",
        },
        "reservedFor": (
            "list",
            {"apiGroup": "string", "resource": "string", "name": "string", "uid": "string"},
        ),
        "devices": (
            "list",
            {
                "driver": "string",
                "pool": "string",
                "device": "string",
                "shareID": "string",
                "conditions": ("list", _OBJ),
                "data": "any",
                "networkData": {
                    "interfaceName": "string",
                    "ips": ("list", "string"),
                    "hardwareAddress": "string",
                },
            },
        ),
    },
}
TAINT_RULE_T: Type = {
    "spec": {"deviceSelector": {"driver": "string", "pool": "string", "device": "string"}, "taint": _TAINT_T},
    "status": {"conditions": ("list", _OBJ)},
}
_TYPES: dict[str, Type] = {
    "resourceslices": SLICE_T,
    "resourceclaims": CLAIM_T,
    "resourceclaimtemplates": {"spec": {"metadata": METADATA_T, "spec": _CLAIM_SPEC_T}},
    "devicetaintrules": TAINT_RULE_T,
}


def _json_type(value: object) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _check(value: Any, expected: Type, path: str) -> str | None:
    """The first type mismatch as the decoder words it, or None. Drops JSON nulls (Go zero values)."""
    if expected == "any":
        return None
    ok = {
        "string": isinstance(value, str),
        "integer": isinstance(value, int) and not isinstance(value, bool),
        "boolean": isinstance(value, bool),
        "object": isinstance(value, dict),
        "quantity": isinstance(value, (str, int)) and not isinstance(value, bool),
    }
    if isinstance(expected, str):
        if ok[expected]:
            return None
        return f"cannot unmarshal {_json_type(value)} into Go struct field {path} of type {expected}"
    if isinstance(expected, tuple):
        kind, inner = expected
        if kind == "list":
            if not isinstance(value, list):
                return f"cannot unmarshal {_json_type(value)} into Go struct field {path} of type []"
            for i, item in enumerate(value):
                error = _check(item, inner, f"{path}[{i}]")
                if error:
                    return error
            return None
        if not isinstance(value, dict):
            return f"cannot unmarshal {_json_type(value)} into Go struct field {path} of type map"
        for key, item in value.items():
            error = _check(item, inner, f"{path}[{key}]")
            if error:
                return error
        return None
    if not isinstance(value, dict):
        return f"cannot unmarshal {_json_type(value)} into Go struct field {path} of type struct"
    for key in [k for k, v in value.items() if v is None and k in expected]:
        del value[key]
    for key, inner in expected.items():
        if key in value:
            error = _check(value[key], inner, f"{path}.{key}" if path else key)
            if error:
                return error
    return None


def type_error(plural: str, obj: JSON) -> str | None:
    """Check an internal-form object's field types; returns the decoder's complaint or None."""
    error = _check(obj.get("metadata", {}), METADATA_T, "metadata")
    if error:
        return error
    expected = _TYPES.get(plural)
    return _check(obj, expected, "") if expected is not None else None
