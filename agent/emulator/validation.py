"""The apiserver's validation rules, written independently of the agent's own model
(upstream `pkg/apis/resource/validation/validation.go`).

Validation runs on the stored (v1) form, so field paths in errors use v1 paths; the apiserver
normalises v1beta1 ``spec.devices[i].basic.`` paths the same way.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from agent.core.quantity import Quantity
from agent.emulator.errors import Cause

JSON = dict[str, Any]

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(-(0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(\.(0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*)?"
    r"(\+[0-9a-zA-Z-]+(\.[0-9a-zA-Z-]+)*)?$"
)
_INT64 = (-(2**63), 2**63 - 1)

DNS_LABEL_MSG = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must "
    "start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for "
    "validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
)
DNS_SUBDOMAIN_MSG = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', "
    "and must start and end with an alphanumeric character (e.g. 'example.com', regex used for "
    "validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)
QUALIFIED_NAME_MSG = (
    "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with "
    "an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation "
    "is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')"
)
LABEL_VALUE_MSG = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and "
    "must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', "
    "regex used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')"
)
C_IDENTIFIER_MSG = (
    "a valid C identifier must start with alphabetic character or '_', followed by a string of "
    "alphanumeric characters or '_' (e.g. 'my_name',  or 'MY_NAME',  or 'MyName', regex used for "
    "validation is '[A-Za-z_][A-Za-z0-9_]*')"
)

# Limits (kubernetes/api resource/v1 constants).
SLICE_MAX_DEVICES = 128
SLICE_MAX_DEVICES_WITH_TAINTS = 64
MAX_ATTRIBUTES_AND_CAPACITIES = 32
DEVICE_MAX_ID_LENGTH = 32
DEVICE_MAX_DOMAIN_LENGTH = 63
DRIVER_NAME_MAX_LENGTH = 63
POOL_NAME_MAX_LENGTH = 253
ATTRIBUTE_STRING_MAX = 64
VERSION_MAX = 64
MAX_COUNTER_SETS = 8
MAX_COUNTERS_PER_SET = 32
CLAIM_MAX_REQUESTS = 32
ALLOCATION_RESULTS_MAX = 32
RESERVED_FOR_MAX = 256
DEVICE_STATUS_MAX_CONDITIONS = 8
RAW_MAX_BYTES = 10 * 1024
ANNOTATIONS_MAX_BYTES = 256 * 1024


def _fmt(value: object) -> str:
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)


def required(path: str, detail: str = "") -> Cause:
    """``Required value``."""
    return Cause(path, "FieldValueRequired", "Required value" + (f": {detail}" if detail else ""))


def invalid(path: str, value: object, detail: str) -> Cause:
    """``Invalid value``."""
    return Cause(path, "FieldValueInvalid", f"Invalid value: {_fmt(value)}: {detail}")


def too_many(path: str, actual: int, limit: int) -> Cause:
    """``Too many``."""
    return Cause(path, "FieldValueTooMany", f"Too many: {actual}: must have at most {limit} items")


def too_long(path: str, limit: int) -> Cause:
    """``Too long``."""
    return Cause(path, "FieldValueTooLong", f"Too long: may not be more than {limit} bytes")


def not_supported(path: str, value: object, supported: list[str]) -> Cause:
    """``Unsupported value``."""
    listed = ", ".join(json.dumps(s) for s in supported)
    return Cause(
        path, "FieldValueNotSupported", f"Unsupported value: {_fmt(value)}: supported values: {listed}"
    )


def duplicate(path: str, value: object) -> Cause:
    """``Duplicate value``."""
    return Cause(path, "FieldValueDuplicate", f"Duplicate value: {_fmt(value)}")


def forbidden(path: str, detail: str) -> Cause:
    """``Forbidden``."""
    return Cause(path, "FieldValueForbidden", f"Forbidden: {detail}")


def immutable(path: str, value: object) -> Cause:
    """The apiserver's "field is immutable" error."""
    return invalid(path, value, "field is immutable")


def dns_label(path: str, value: object) -> list[Cause]:
    """RFC 1123 label."""
    if not isinstance(value, str):
        return [invalid(path, value, DNS_LABEL_MSG)]
    out = []
    if len(value) > 63:
        out.append(invalid(path, value, "must be no more than 63 characters"))
    if not _DNS_LABEL.match(value):
        out.append(invalid(path, value, DNS_LABEL_MSG))
    return out


def dns_subdomain(path: str, value: object) -> list[Cause]:
    """RFC 1123 subdomain."""
    if not isinstance(value, str):
        return [invalid(path, value, DNS_SUBDOMAIN_MSG)]
    out = []
    if len(value) > 253:
        out.append(invalid(path, value, "must be no more than 253 characters"))
    if not _DNS_SUBDOMAIN.match(value):
        out.append(invalid(path, value, DNS_SUBDOMAIN_MSG))
    return out


def qualified_name(path: str, value: object) -> list[Cause]:
    """A label key: ``[prefix/]name``."""
    if not isinstance(value, str) or not value:
        return [invalid(path, value, "name part must be non-empty")]
    prefix, _, name = value.rpartition("/")
    out = []
    if "/" in value and not prefix:
        out.append(invalid(path, value, "prefix part must be non-empty"))
    elif prefix:
        out += [
            invalid(path, value, "prefix part " + c.message.split(": ", 2)[-1])
            for c in dns_subdomain(path, prefix)
        ]
    if not name:
        out.append(invalid(path, value, "name part must be non-empty"))
    else:
        if len(name) > 63:
            out.append(invalid(path, value, "name part must be no more than 63 characters"))
        if not _QUALIFIED_NAME.match(name):
            out.append(invalid(path, value, QUALIFIED_NAME_MSG))
    if value.count("/") > 1:
        out = [
            invalid(
                path,
                value,
                "a qualified name must consist of alphanumeric characters, '-', '_' or '.', and must start "
                "and end with an alphanumeric character with an optional DNS subdomain prefix and '/'",
            )
        ]
    return out


def label_value(path: str, value: object) -> list[Cause]:
    """A label value (may be empty)."""
    if not isinstance(value, str):
        return [invalid(path, value, LABEL_VALUE_MSG)]
    out = []
    if len(value) > 63:
        out.append(invalid(path, value, "must be no more than 63 characters"))
    if not _LABEL_VALUE.match(value):
        out.append(invalid(path, value, LABEL_VALUE_MSG))
    return out


def driver_name(path: str, value: object) -> list[Cause]:
    """``ValidateCSIDriverName``: non-empty, at most 63, DNS subdomain after lower-casing."""
    if not value:
        return [required(path)]
    if not isinstance(value, str):
        return [invalid(path, value, DNS_SUBDOMAIN_MSG)]
    if len(value) > DRIVER_NAME_MAX_LENGTH:
        return [too_long(path, DRIVER_NAME_MAX_LENGTH)]
    return [invalid(path, value, c.message.split(": ", 2)[-1]) for c in dns_subdomain(path, value.lower())]


@dataclass(frozen=True)
class Rules:
    """What differs between releases and feature gates."""

    release: str
    gates: Mapping[str, bool]

    @property
    def minor(self) -> int:
        """The minor release number (34 for 1.34)."""
        return int(self.release.split(".")[1])

    @property
    def max_taints(self) -> int:
        """``DeviceTaintsMaxLength``: 4 up to 1.34, 16 from 1.35."""
        return 16 if self.minor >= 35 else 4

    @property
    def taint_effects(self) -> list[str]:
        """Valid taint effects (``None`` from 1.35)."""
        return ["NoExecute", "NoSchedule", "None"] if self.minor >= 35 else ["NoExecute", "NoSchedule"]

    def gate(self, name: str) -> bool:
        """Whether a feature gate is on."""
        return bool(self.gates.get(name, False))


def metadata(obj: JSON, *, namespaced: bool, name_rule: str = "subdomain") -> list[Cause]:
    """Generic ObjectMeta rules."""
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        return [required("metadata")]
    out: list[Cause] = []
    name = meta.get("name")
    if not name:
        out.append(required("metadata.name", "name or generateName is required"))
    else:
        checker = dns_label if name_rule == "label" else dns_subdomain
        out += checker("metadata.name", name)
    if namespaced and not meta.get("namespace"):
        out.append(required("metadata.namespace"))
    if not namespaced and meta.get("namespace"):
        out.append(forbidden("metadata.namespace", "not allowed on this type"))
    labels = meta.get("labels") or {}
    if not isinstance(labels, dict):
        out.append(invalid("metadata.labels", labels, "must be a map of strings"))
    else:
        for key, value in labels.items():
            out += qualified_name("metadata.labels", key)
            out += label_value("metadata.labels", value)
    annotations = meta.get("annotations") or {}
    if not isinstance(annotations, dict):
        out.append(invalid("metadata.annotations", annotations, "must be a map of strings"))
    else:
        size = 0
        for key, value in annotations.items():
            out += qualified_name("metadata.annotations", key.lower())
            size += len(key) + len(str(value))
        if size > ANNOTATIONS_MAX_BYTES:
            out.append(too_long("metadata.annotations", ANNOTATIONS_MAX_BYTES))
    owners = meta.get("ownerReferences") or []
    controllers = 0
    for i, ref in enumerate(owners):
        path = f"metadata.ownerReferences[{i}]"
        if not isinstance(ref, dict):
            out.append(invalid(path, ref, "must be an object"))
            continue
        for key in ("apiVersion", "kind", "name", "uid"):
            if not ref.get(key):
                out.append(invalid(f"{path}.{key}", ref.get(key, ""), f"{key} must not be empty"))
        controllers += 1 if ref.get("controller") else 0
    if controllers > 1:
        out.append(
            invalid("metadata.ownerReferences", owners, "Only one reference can have Controller set to true")
        )
    for i, finalizer in enumerate(meta.get("finalizers") or []):
        out += qualified_name(f"metadata.finalizers[{i}]", finalizer)
    return out


def _timestamp(path: str, value: object) -> list[Cause]:
    if not isinstance(value, str):
        return [invalid(path, value, "must be an RFC 3339 timestamp")]
    try:
        datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return [invalid(path, value, "must be an RFC 3339 timestamp")]
    return []


def taint(path: str, value: object, rules: Rules) -> list[Cause]:
    """A DeviceTaint."""
    if not isinstance(value, dict):
        return [invalid(path, value, "must be an object")]
    out: list[Cause] = []
    if not value.get("key"):
        out.append(required(f"{path}.key"))
    else:
        out += qualified_name(f"{path}.key", value["key"])
    if "value" in value:
        out += label_value(f"{path}.value", value["value"])
    effect = value.get("effect")
    if not effect:
        out.append(required(f"{path}.effect"))
    elif effect not in rules.taint_effects:
        out.append(not_supported(f"{path}.effect", effect, rules.taint_effects))
    if value.get("timeAdded") is not None:
        out += _timestamp(f"{path}.timeAdded", value["timeAdded"])
    return out


def _attribute_name(path: str, name: object) -> list[Cause]:
    if not isinstance(name, str) or not name:
        return [required(path)]
    domain, sep, ident = name.rpartition("/")
    out: list[Cause] = []
    if sep:
        if not domain:
            out.append(invalid(path, name, "the domain must not be empty"))
        elif len(domain) > DEVICE_MAX_DOMAIN_LENGTH:
            out.append(too_long(path, DEVICE_MAX_DOMAIN_LENGTH))
        else:
            out += [invalid(path, domain, c.message.split(": ", 2)[-1]) for c in dns_subdomain(path, domain)]
    if not ident:
        out.append(invalid(path, name, "the name must not be empty"))
    elif len(ident) > DEVICE_MAX_ID_LENGTH:
        out.append(too_long(path, DEVICE_MAX_ID_LENGTH))
    elif not _C_IDENTIFIER.match(ident):
        out.append(invalid(path, ident, C_IDENTIFIER_MSG))
    return out


def _attribute(path: str, value: object) -> list[Cause]:
    if not isinstance(value, dict):
        return [invalid(path, value, "must be an object")]
    kinds = [k for k in ("int", "bool", "string", "version") if value.get(k) is not None]
    if len(kinds) != 1:
        return [invalid(path, value, "exactly one value must be specified")]
    kind = kinds[0]
    item = value[kind]
    if kind == "int" and (
        isinstance(item, bool) or not isinstance(item, int) or not _INT64[0] <= item <= _INT64[1]
    ):
        return [invalid(f"{path}.int", item, "must be a 64-bit integer")]
    if kind == "bool" and not isinstance(item, bool):
        return [invalid(f"{path}.bool", item, "must be a boolean")]
    if kind == "string":
        if not isinstance(item, str):
            return [invalid(f"{path}.string", item, "must be a string")]
        if len(item) > ATTRIBUTE_STRING_MAX:
            return [too_long(f"{path}.string", ATTRIBUTE_STRING_MAX)]
    if kind == "version":
        if not isinstance(item, str):
            return [invalid(f"{path}.version", item, "must be a string")]
        if len(item) > VERSION_MAX:
            return [too_long(f"{path}.version", VERSION_MAX)]
        if not _SEMVER.match(item):
            return [
                invalid(f"{path}.version", item, "must be a string compatible with semver.org spec 2.0.0")
            ]
    return []


def canonical_quantity(value: object) -> str | None:
    """The stored form of a quantity, or None when it does not parse."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return None
    try:
        return Quantity.parse(value).canonical()
    except Exception:
        return None


def _device(path: str, device: object, rules: Rules) -> list[Cause]:
    if not isinstance(device, dict):
        return [invalid(path, device, "must be an object")]
    out: list[Cause] = []
    if not device.get("name"):
        out.append(required(f"{path}.name"))
    else:
        out += dns_label(f"{path}.name", device["name"])
    attributes = device.get("attributes") or {}
    capacity = device.get("capacity") or {}
    if not isinstance(attributes, dict):
        out.append(invalid(f"{path}.attributes", attributes, "must be a map"))
        attributes = {}
    if not isinstance(capacity, dict):
        out.append(invalid(f"{path}.capacity", capacity, "must be a map"))
        capacity = {}
    for name, attr in attributes.items():
        out += _attribute_name(f"{path}.attributes[{name}]", name)
        out += _attribute(f"{path}.attributes[{name}]", attr)
    for name, cap in capacity.items():
        cpath = f"{path}.capacity[{name}]"
        out += _attribute_name(cpath, name)
        if not isinstance(cap, dict) or "value" not in cap:
            out.append(required(f"{cpath}.value"))
        elif canonical_quantity(cap["value"]) is None:
            out.append(
                invalid(
                    f"{cpath}.value",
                    cap["value"],
                    "quantities must match the regular expression "
                    "'^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'",
                )
            )
        elif "requestPolicy" in cap and not device.get("allowMultipleAllocations"):
            out.append(
                forbidden(f"{cpath}.requestPolicy", "allowed only when allowMultipleAllocations is true")
            )
    if len(attributes) + len(capacity) > MAX_ATTRIBUTES_AND_CAPACITIES:
        out.append(
            invalid(
                path,
                len(attributes) + len(capacity),
                "the total number of attributes and capacities must not exceed "
                f"{MAX_ATTRIBUTES_AND_CAPACITIES}",
            )
        )
    taints = device.get("taints") or []
    if not isinstance(taints, list):
        out.append(invalid(f"{path}.taints", taints, "must be a list"))
    else:
        if len(taints) > rules.max_taints:
            out.append(too_many(f"{path}.taints", len(taints), rules.max_taints))
        for j, item in enumerate(taints):
            out += taint(f"{path}.taints[{j}]", item, rules)
    consumes = device.get("consumesCounters") or []
    if isinstance(consumes, list) and len(consumes) > 2:
        out.append(too_many(f"{path}.consumesCounters", len(consumes), 2))
    return out


def resource_slice(obj: JSON, rules: Rules) -> list[Cause]:
    """ResourceSlice rules of the apiserver's validation (metadata checked separately)."""
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return [required("spec")]
    out: list[Cause] = []
    out += driver_name("spec.driver", spec.get("driver"))
    pool = spec.get("pool")
    if not isinstance(pool, dict):
        out.append(required("spec.pool"))
    else:
        pool_name = pool.get("name")
        if not pool_name:
            out.append(required("spec.pool.name"))
        elif not isinstance(pool_name, str):
            out.append(invalid("spec.pool.name", pool_name, "must be a string"))
        elif len(pool_name) > POOL_NAME_MAX_LENGTH:
            out.append(too_long("spec.pool.name", POOL_NAME_MAX_LENGTH))
        else:
            for part in pool_name.split("/"):
                for c in dns_subdomain("spec.pool.name", part):
                    out.append(invalid("spec.pool.name", pool_name, c.message.split(": ", 2)[-1]))
        generation = pool.get("generation", 0)
        if not isinstance(generation, int) or isinstance(generation, bool) or generation < 0:
            out.append(invalid("spec.pool.generation", generation, "must be greater than or equal to 0"))
        count = pool.get("resourceSliceCount", 0)
        if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
            out.append(invalid("spec.pool.resourceSliceCount", count, "must be greater than zero"))
    selection = [
        name
        for name, present in (
            ("`nodeName`", bool(spec.get("nodeName"))),
            ("`nodeSelector`", spec.get("nodeSelector") is not None),
            ("`allNodes`", spec.get("allNodes") is True),
            ("`perDeviceNodeSelection`", spec.get("perDeviceNodeSelection") is True),
        )
        if present
    ]
    choices = "`nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection`"
    if not selection:
        out.append(required("spec", f"exactly one of {choices} is required"))
    elif len(selection) > 1:
        out.append(
            invalid(
                "spec",
                "{" + ", ".join(selection) + "}",
                f"exactly one of {choices} is required, but multiple fields are set",
            )
        )
    if "nodeName" in spec:
        if not spec["nodeName"]:
            out.append(required("spec.nodeName", "must not be empty when set"))
        else:
            out += dns_subdomain("spec.nodeName", spec["nodeName"])
    selector = spec.get("nodeSelector")
    if selector is not None:
        terms = selector.get("nodeSelectorTerms") if isinstance(selector, dict) else None
        if not isinstance(terms, list) or len(terms) != 1:
            out.append(
                invalid(
                    "spec.nodeSelector.nodeSelectorTerms", terms, "must have exactly one node selector term"
                )
            )
    devices = spec.get("devices") or []
    if not isinstance(devices, list):
        return [*out, invalid("spec.devices", devices, "must be a list")]
    counters = spec.get("sharedCounters") or []
    if rules.minor >= 35 and devices and counters:
        out.append(
            invalid(
                "spec", "{`devices`, `sharedCounters`}", "only one of sharedCounters or devices is allowed"
            )
        )
    if isinstance(counters, list):
        if len(counters) > MAX_COUNTER_SETS:
            out.append(too_many("spec.sharedCounters", len(counters), MAX_COUNTER_SETS))
        seen_sets: set[str] = set()
        for i, counter_set in enumerate(counters):
            path = f"spec.sharedCounters[{i}]"
            name = counter_set.get("name") if isinstance(counter_set, dict) else None
            out += dns_label(f"{path}.name", name) if name else [required(f"{path}.name")]
            if name in seen_sets:
                out.append(duplicate(f"{path}.name", name))
            seen_sets.add(str(name))
            entries = counter_set.get("counters") if isinstance(counter_set, dict) else None
            if isinstance(entries, dict) and len(entries) > MAX_COUNTERS_PER_SET:
                out.append(too_many(f"{path}.counters", len(entries), MAX_COUNTERS_PER_SET))
    limit = SLICE_MAX_DEVICES
    if rules.minor >= 35 and any(
        isinstance(d, dict) and (d.get("taints") or d.get("consumesCounters")) for d in devices
    ):
        limit = SLICE_MAX_DEVICES_WITH_TAINTS
    if len(devices) > limit:
        out.append(too_many("spec.devices", len(devices), limit))
    seen: set[str] = set()
    for i, device in enumerate(devices):
        path = f"spec.devices[{i}]"
        out += _device(path, device, rules)
        name = device.get("name") if isinstance(device, dict) else None
        if isinstance(name, str) and name:
            if name in seen:
                out.append(duplicate(f"{path}.name", name))
            seen.add(name)
    return out


def resource_slice_update(new: JSON, old: JSON) -> list[Cause]:
    """Immutable ResourceSlice fields."""
    out: list[Cause] = []
    n, o = new.get("spec") or {}, old.get("spec") or {}
    if n.get("driver") != o.get("driver"):
        out.append(immutable("spec.driver", n.get("driver")))
    if (n.get("pool") or {}).get("name") != (o.get("pool") or {}).get("name"):
        out.append(immutable("spec.pool.name", (n.get("pool") or {}).get("name")))
    if n.get("nodeName") != o.get("nodeName"):
        out.append(immutable("spec.nodeName", n.get("nodeName")))
    return out


def _request(path: str, request: object) -> list[Cause]:
    if not isinstance(request, dict):
        return [invalid(path, request, "must be an object")]
    out: list[Cause] = []
    out += (
        dns_label(f"{path}.name", request.get("name")) if request.get("name") else [required(f"{path}.name")]
    )
    exact, first = request.get("exactly"), request.get("firstAvailable")
    if (exact is None) == (first is None):
        out.append(invalid(path, "", "exactly one of `exactly` or `firstAvailable` is required"))
    if isinstance(exact, dict):
        epath = f"{path}.exactly"
        cls = exact.get("deviceClassName")
        out += (
            dns_subdomain(f"{epath}.deviceClassName", cls) if cls else [required(f"{epath}.deviceClassName")]
        )
        mode = exact.get("allocationMode", "ExactCount")
        if mode not in ("All", "ExactCount"):
            out.append(not_supported(f"{epath}.allocationMode", mode, ["All", "ExactCount"]))
        count = exact.get("count", 1)
        if mode == "ExactCount" and (not isinstance(count, int) or count <= 0):
            out.append(invalid(f"{epath}.count", count, "must be greater than zero"))
        if mode == "All" and "count" in exact:
            out.append(invalid(f"{epath}.count", count, "must not be specified when allocationMode is 'All'"))
    if isinstance(first, list):
        if not first:
            out.append(required(f"{path}.firstAvailable"))
        if len(first) > 8:
            out.append(too_many(f"{path}.firstAvailable", len(first), 8))
    return out


def resource_claim(obj: JSON) -> list[Cause]:
    """ResourceClaim spec basics."""
    spec = obj.get("spec")
    if spec is None:
        return []
    if not isinstance(spec, dict):
        return [invalid("spec", spec, "must be an object")]
    devices = spec.get("devices") or {}
    requests = devices.get("requests") or [] if isinstance(devices, dict) else []
    out: list[Cause] = []
    if len(requests) > CLAIM_MAX_REQUESTS:
        out.append(too_many("spec.devices.requests", len(requests), CLAIM_MAX_REQUESTS))
    seen: set[str] = set()
    for i, request in enumerate(requests):
        out += _request(f"spec.devices.requests[{i}]", request)
        name = request.get("name") if isinstance(request, dict) else None
        if isinstance(name, str):
            if name in seen:
                out.append(duplicate(f"spec.devices.requests[{i}].name", name))
            seen.add(name)
    return out


def resource_claim_status(obj: JSON, old: JSON | None) -> list[Cause]:
    """ResourceClaim status: allocation results and device status entries."""
    status = obj.get("status") or {}
    if not isinstance(status, dict):
        return [invalid("status", status, "must be an object")]
    out: list[Cause] = []
    allocation = status.get("allocation")
    results: list[Any] = []
    if allocation is not None:
        results = (
            ((allocation.get("devices") or {}).get("results") or []) if isinstance(allocation, dict) else []
        )
        if len(results) > ALLOCATION_RESULTS_MAX:
            out.append(too_many("status.allocation.devices.results", len(results), ALLOCATION_RESULTS_MAX))
        for i, result in enumerate(results):
            path = f"status.allocation.devices.results[{i}]"
            if not isinstance(result, dict):
                out.append(invalid(path, result, "must be an object"))
                continue
            for key in ("request", "driver", "pool", "device"):
                if not result.get(key):
                    out.append(required(f"{path}.{key}"))
            if result.get("driver"):
                out += driver_name(f"{path}.driver", result["driver"])
            if result.get("device"):
                out += dns_label(f"{path}.device", result["device"])
        old_alloc = ((old or {}).get("status") or {}).get("allocation")
        if old_alloc is not None and old_alloc != allocation:
            out.append(immutable("status.allocation", "<allocation>"))
    reserved = status.get("reservedFor") or []
    if len(reserved) > RESERVED_FOR_MAX:
        out.append(too_many("status.reservedFor", len(reserved), RESERVED_FOR_MAX))
    if reserved and allocation is None:
        out.append(forbidden("status.reservedFor", "may not be specified when `allocated` is not set"))
    allocated = {
        (r.get("driver"), r.get("pool"), r.get("device"), r.get("shareID"))
        for r in results
        if isinstance(r, dict)
    }
    seen: set[tuple[Any, ...]] = set()
    for i, entry in enumerate(status.get("devices") or []):
        path = f"status.devices[{i}]"
        if not isinstance(entry, dict):
            out.append(invalid(path, entry, "must be an object"))
            continue
        ident = (entry.get("driver"), entry.get("pool"), entry.get("device"), entry.get("shareID"))
        if ident not in allocated:
            out.append(
                invalid(path, f"{ident[0]}/{ident[1]}/{ident[2]}", "must be an allocated device in the claim")
            )
        if ident in seen:
            out.append(duplicate(path, f"{ident[0]}/{ident[1]}/{ident[2]}"))
        seen.add(ident)
        conditions = entry.get("conditions") or []
        if len(conditions) > DEVICE_STATUS_MAX_CONDITIONS:
            out.append(too_many(f"{path}.conditions", len(conditions), DEVICE_STATUS_MAX_CONDITIONS))
        if "data" in entry:
            if not isinstance(entry["data"], dict):
                out.append(invalid(f"{path}.data", "<value>", "must be a valid JSON object"))
            elif len(json.dumps(entry["data"])) > RAW_MAX_BYTES:
                out.append(too_long(f"{path}.data", RAW_MAX_BYTES))
        network = entry.get("networkData") or {}
        if isinstance(network, dict):
            if len(network.get("interfaceName") or "") > 256:
                out.append(too_long(f"{path}.networkData.interfaceName", 256))
            if len(network.get("ips") or []) > 16:
                out.append(too_many(f"{path}.networkData.ips", len(network["ips"]), 16))
            if len(network.get("hardwareAddress") or "") > 128:
                out.append(too_long(f"{path}.networkData.hardwareAddress", 128))
    return out


def device_taint_rule(obj: JSON, rules: Rules) -> list[Cause]:
    """DeviceTaintRule: a valid taint and a valid selector."""
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return [required("spec")]
    out: list[Cause] = []
    if "taint" not in spec:
        out.append(required("spec.taint"))
    else:
        out += taint("spec.taint", spec["taint"], rules)
    selector = spec.get("deviceSelector") or {}
    if isinstance(selector, dict):
        if selector.get("driver"):
            out += driver_name("spec.deviceSelector.driver", selector["driver"])
        if selector.get("device"):
            out += dns_label("spec.deviceSelector.device", selector["device"])
        for key in ("deviceClassName", "selectors"):
            if key in selector and rules.minor >= 35:
                out.append(forbidden(f"spec.deviceSelector.{key}", "no longer supported"))
    conditions = (obj.get("status") or {}).get("conditions") or []
    if len(conditions) > 8:
        out.append(too_many("status.conditions", len(conditions), 8))
    return out


def event(obj: JSON) -> list[Cause]:
    """core/v1 Event basics."""
    out: list[Cause] = []
    involved = obj.get("involvedObject")
    namespace = (obj.get("metadata") or {}).get("namespace")
    if not isinstance(involved, dict):
        out.append(required("involvedObject"))
    elif involved.get("namespace") and involved["namespace"] != namespace:
        out.append(
            invalid("involvedObject.namespace", involved["namespace"], "does not match event.namespace")
        )
    if obj.get("type") and obj["type"] not in ("Normal", "Warning"):
        out.append(not_supported("type", obj["type"], ["Normal", "Warning"]))
    return out


def device_class(obj: JSON) -> list[Cause]:
    """DeviceClass: CEL selectors and opaque config, within their limits."""
    spec = obj.get("spec") or {}
    if not isinstance(spec, dict):
        return [invalid("spec", spec, "must be an object")]
    out: list[Cause] = []
    selectors = spec.get("selectors") or []
    if not isinstance(selectors, list):
        return [invalid("spec.selectors", selectors, "must be a list")]
    if len(selectors) > 32:
        out.append(too_many("spec.selectors", len(selectors), 32))
    for i, selector in enumerate(selectors):
        cel = selector.get("cel") if isinstance(selector, dict) else None
        expression = cel.get("expression") if isinstance(cel, dict) else None
        if not isinstance(expression, str) or not expression.strip():
            out.append(required(f"spec.selectors[{i}].cel.expression"))
        elif len(expression) > 10 * 1024:
            out.append(too_long(f"spec.selectors[{i}].cel.expression", 10 * 1024))
    config = spec.get("config") or []
    if isinstance(config, list) and len(config) > 32:
        out.append(too_many("spec.config", len(config), 32))
    for i, entry in enumerate(config if isinstance(config, list) else []):
        opaque = entry.get("opaque") if isinstance(entry, dict) else None
        if isinstance(opaque, dict):
            out += driver_name(f"spec.config[{i}].opaque.driver", opaque.get("driver"))
            if not isinstance(opaque.get("parameters"), dict):
                out.append(required(f"spec.config[{i}].opaque.parameters", "must be a JSON object"))
            elif len(json.dumps(opaque["parameters"])) > RAW_MAX_BYTES:
                out.append(too_long(f"spec.config[{i}].opaque.parameters", RAW_MAX_BYTES))
    return out
