"""Conversion between the stored (v1) form and the served versions of resource.k8s.io.

v1beta1 wraps device fields in ``basic`` and keeps request fields flat; v1beta2 and v1 are flat devices
with requests nested under ``exactly``. Events convert between core/v1 and events.k8s.io/v1.
"""

from __future__ import annotations

from typing import Any

from agent.emulator.resources import EVENTS_GROUP, ResourceType
from agent.emulator.store import clone

JSON = dict[str, Any]

_EXACT_FIELDS = (
    "deviceClassName",
    "selectors",
    "allocationMode",
    "count",
    "adminAccess",
    "tolerations",
    "capacity",
)

# core/v1 Event field -> events.k8s.io/v1 Event field.
_EVENT_FIELDS = {
    "involvedObject": "regarding",
    "related": "related",
    "message": "note",
    "reason": "reason",
    "type": "type",
    "action": "action",
    "eventTime": "eventTime",
    "series": "series",
    "reportingComponent": "reportingController",
    "reportingInstance": "reportingInstance",
    "source": "deprecatedSource",
    "firstTimestamp": "deprecatedFirstTimestamp",
    "lastTimestamp": "deprecatedLastTimestamp",
    "count": "deprecatedCount",
}


def to_internal(rtype: ResourceType, version: str, obj: JSON, *, in_place: bool = False) -> JSON:
    """Convert a request body of a served version to the stored form (a copy unless in_place)."""
    out = obj if in_place else clone(obj)
    if rtype.group == EVENTS_GROUP:
        out = _event_from_events_v1(out)
    elif version == "v1beta1":
        if rtype.plural == "resourceslices":
            _unwrap_basic(out)
        elif rtype.plural == "resourceclaims":
            _nest_requests(out.get("spec"))
        elif rtype.plural == "resourceclaimtemplates":
            _nest_requests((out.get("spec") or {}).get("spec"))
    out["apiVersion"] = rtype.api_version(rtype.storage_version) if rtype.group != EVENTS_GROUP else "v1"
    return out


def from_internal(rtype: ResourceType, version: str, obj: JSON) -> JSON:
    """Convert a stored object to a served version (a copy)."""
    out = clone(obj)
    if rtype.group == EVENTS_GROUP:
        out = _event_to_events_v1(out)
    elif version == "v1beta1":
        if rtype.plural == "resourceslices":
            _wrap_basic(out)
        elif rtype.plural == "resourceclaims":
            _flatten_requests(out.get("spec"))
        elif rtype.plural == "resourceclaimtemplates":
            _flatten_requests((out.get("spec") or {}).get("spec"))
    out["apiVersion"] = rtype.api_version(version)
    out["kind"] = rtype.kind
    return out


def _devices(obj: JSON) -> list[Any]:
    spec = obj.get("spec")
    devices = spec.get("devices") if isinstance(spec, dict) else None
    return devices if isinstance(devices, list) else []


def _unwrap_basic(obj: JSON) -> None:
    for device in _devices(obj):
        if isinstance(device, dict) and isinstance(device.get("basic"), dict):
            device.update(device.pop("basic"))


def _wrap_basic(obj: JSON) -> None:
    for device in _devices(obj):
        if isinstance(device, dict):
            basic = {k: device.pop(k) for k in list(device) if k != "name"}
            device["basic"] = basic


def _requests(spec: Any) -> list[Any]:
    if not isinstance(spec, dict):
        return []
    devices = spec.get("devices")
    requests = devices.get("requests") if isinstance(devices, dict) else None
    return requests if isinstance(requests, list) else []


def _nest_requests(spec: Any) -> None:
    for request in _requests(spec):
        if isinstance(request, dict):
            exact = {k: request.pop(k) for k in _EXACT_FIELDS if k in request}
            if exact or "firstAvailable" not in request:
                request["exactly"] = exact


def _flatten_requests(spec: Any) -> None:
    for request in _requests(spec):
        if isinstance(request, dict) and isinstance(request.get("exactly"), dict):
            request.update(request.pop("exactly"))


def _event_to_events_v1(obj: JSON) -> JSON:
    out: JSON = {"metadata": obj.get("metadata", {})}
    for core, new in _EVENT_FIELDS.items():
        if core in obj:
            out[new] = obj[core]
    return out


def _event_from_events_v1(obj: JSON) -> JSON:
    out: JSON = {"metadata": obj.get("metadata", {}), "kind": "Event"}
    for core, new in _EVENT_FIELDS.items():
        if new in obj:
            out[core] = obj[new]
    return out
