"""The apiserver's validation rules, written independently of the agent's own model
(upstream `pkg/apis/resource/validation/validation.go`).

Validation runs on the stored (v1) form, so field paths in errors use v1 paths; the apiserver
normalises v1beta1 ``spec.devices[i].basic.`` paths the same way.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from agent.core.quantity import Quantity
from agent.emulator.errors import Cause
from agent.emulator.resources import minor_of

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
#: ``BindingConditionsMaxSize`` and ``BindingFailureConditionsMaxSize``.
MAX_BINDING_CONDITIONS = 4


def _fmt(value: object) -> str:
    if value is None:
        return "null"
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
        out.append(invalid(path, value, "must be no more than 63 bytes"))
    if not _DNS_LABEL.match(value):
        out.append(invalid(path, value, DNS_LABEL_MSG))
    return out


def dns_subdomain(path: str, value: object) -> list[Cause]:
    """RFC 1123 subdomain."""
    if not isinstance(value, str):
        return [invalid(path, value, DNS_SUBDOMAIN_MSG)]
    out = []
    if len(value) > 253:
        out.append(invalid(path, value, "must be no more than 253 bytes"))
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
            out.append(invalid(path, value, "name part must be no more than 63 bytes"))
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
        out.append(invalid(path, value, "must be no more than 63 bytes"))
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


def pool_name(path: str, value: object) -> list[Cause]:
    """``validatePoolName``: at most 253 bytes, each ``/``-separated part a DNS subdomain."""
    if not value:
        return [required(path)]
    if not isinstance(value, str):
        return [invalid(path, value, "must be a string")]
    out: list[Cause] = []
    if len(value) > POOL_NAME_MAX_LENGTH:
        out.append(too_long(path, POOL_NAME_MAX_LENGTH))
    for part in value.split("/"):
        out += [invalid(path, part, c.message.split(": ", 2)[-1]) for c in dns_subdomain(path, part)]
    return out


def c_identifier(path: str, value: str, limit: int) -> list[Cause]:
    """``validateCIdentifier``: at most ``limit`` bytes and a C identifier."""
    out: list[Cause] = []
    if len(value) > limit:
        out.append(too_long(path, limit))
    if not _C_IDENTIFIER.match(value):
        out.append(invalid(path, value, C_IDENTIFIER_MSG))
    return out


def semver_ok(value: str) -> bool:
    """Whether a string is a semver.org 2.0.0 version (the apiserver's ``semverRe``)."""
    return bool(_SEMVER.match(value))


def uid(path: str, value: object) -> list[Cause]:
    """``validateUID``: what google/uuid ``Validate`` accepts, then RFC 4122 normalized form."""
    text = value if isinstance(value, str) else str(value)
    problem = _uuid_problem(text)
    if problem:
        return [invalid(path, text, f"error validating uid: {problem}")]
    if len(text) != 36 or text != text.lower():
        return [
            invalid(
                path,
                text,
                "uid must be in RFC 4122 normalized form, `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` "
                "with lowercase hexadecimal characters",
            )
        ]
    return []


def _uuid_problem(text: str) -> str:
    body = text
    if len(text) == 45:
        if text[:9].lower() != "urn:uuid:":
            return f"invalid urn prefix: {json.dumps(text[:9])}"
        body = text[9:]
    elif len(text) == 38:
        body = text[1:37]
    elif len(text) == 32:
        return "" if _HEX.match(text) else "invalid UUID format"
    elif len(text) != 36:
        return f"invalid UUID length: {len(text)}"
    dashes = all(body[i] == "-" for i in (8, 13, 18, 23))
    return "" if dashes and _HEX.match(body.replace("-", "")) else "invalid UUID format"


_HEX = re.compile(r"^[0-9a-fA-F]{32}$")


def node_selector(path: str, selector: object) -> list[Cause]:
    """core ``ValidateNodeSelector`` (label values checked: ``allowInvalidLabelValue`` is false)."""
    if not isinstance(selector, dict):
        return [invalid(path, selector, "must be an object")]
    terms = selector.get("nodeSelectorTerms") or []
    terms_path = f"{path}.nodeSelectorTerms"
    if not terms:
        return [required(terms_path, "must have at least one node selector term")]
    out: list[Cause] = []
    for i, raw_term in enumerate(terms if isinstance(terms, list) else []):
        term = raw_term if isinstance(raw_term, dict) else {}
        for j, expression in enumerate(term.get("matchExpressions") or []):
            out += _selector_requirement(f"{terms_path}[{i}].matchExpressions[{j}]", expression)
        for j, requirement in enumerate(term.get("matchFields") or []):
            out += _field_requirement(f"{terms_path}[{i}].matchFields[{j}]", requirement)
    return out


def _selector_requirement(path: str, rq: object) -> list[Cause]:
    rq = rq if isinstance(rq, dict) else {}
    operator, values = rq.get("operator", ""), rq.get("values") or []
    out: list[Cause] = []
    if operator in ("In", "NotIn"):
        if not values:
            out.append(required(f"{path}.values", "must be specified when `operator` is 'In' or 'NotIn'"))
    elif operator in ("Exists", "DoesNotExist"):
        if values:
            out.append(
                forbidden(
                    f"{path}.values", "may not be specified when `operator` is 'Exists' or 'DoesNotExist'"
                )
            )
    elif operator in ("Gt", "Lt"):
        if len(values) != 1:
            out.append(
                required(f"{path}.values", "must be specified single value when `operator` is 'Lt' or 'Gt'")
            )
    else:
        out.append(invalid(f"{path}.operator", operator, "not a valid selector operator"))
    out += qualified_name(f"{path}.key", rq.get("key", ""))
    for i, value in enumerate(values):
        out += label_value(f"{path}.values[{i}]", value)
    return out


def _field_requirement(path: str, rq: object) -> list[Cause]:
    rq = rq if isinstance(rq, dict) else {}
    operator, values = rq.get("operator", ""), rq.get("values") or []
    out: list[Cause] = []
    if operator in ("In", "NotIn"):
        if len(values) != 1:
            out.append(
                required(
                    f"{path}.values",
                    "must be only one value when `operator` is 'In' or 'NotIn' for node field selector",
                )
            )
    else:
        out.append(invalid(f"{path}.operator", operator, "not a valid selector operator"))
    if rq.get("key") != "metadata.name":
        out.append(invalid(f"{path}.key", rq.get("key", ""), "not a valid field selector key"))
    else:
        for i, value in enumerate(values):
            out += [
                invalid(f"{path}.values[{i}]", value, c.message.split(": ", 2)[-1])
                for c in dns_subdomain(f"{path}.values[{i}]", value)
            ]
    return out


@dataclass(frozen=True)
class Rules:
    """What differs between releases and feature gates."""

    release: str
    gates: Mapping[str, bool]

    @property
    def minor(self) -> int:
        """The minor release number (34 for 1.34)."""
        return minor_of(self.release)

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


def canonical_quantity(value: object) -> str | None:
    """The stored form of a quantity, or None when it does not parse."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return None
    try:
        return Quantity.parse(value).canonical()
    except Exception:
        return None


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


def _request_names(spec: object) -> dict[str, set[str]]:
    """Request name -> its subrequest names (``gatherRequestNames``)."""
    devices = spec.get("devices") if isinstance(spec, dict) else None
    requests = devices.get("requests") if isinstance(devices, dict) else None
    names: dict[str, set[str]] = {}
    for request in requests if isinstance(requests, list) else []:
        if isinstance(request, dict):
            subs = request.get("firstAvailable") or []
            names[str(request.get("name"))] = {str(s.get("name")) for s in subs if isinstance(s, dict)}
    return names


def _request_ref(path: str, name: object, names: dict[str, set[str]]) -> list[Cause]:
    """``validateRequestNameRef``: ``request`` or ``request/subrequest`` of this claim."""
    text = name if isinstance(name, str) else ""
    why = (
        "must be the name of a request in the claim or the name of a request and a subrequest "
        "separated by '/'"
    )
    segments = text.split("/")
    if len(segments) > 2:
        return [invalid(path, text, why)]
    out: list[Cause] = []
    for segment in segments:
        out += dns_label(path, segment) if segment else [required(path)]
    known = segments[0] in names and (len(segments) == 1 or segments[1] in names[segments[0]])
    if not known:
        out.append(invalid(path, text, why))
    return out


def _allocation_result(path: str, result: JSON, names: dict[str, set[str]]) -> list[Cause]:
    """``validateDeviceRequestAllocationResult``."""
    out = _request_ref(f"{path}.request", result.get("request"), names)
    out += driver_name(f"{path}.driver", result.get("driver"))
    out += pool_name(f"{path}.pool", result.get("pool"))
    device = result.get("device")
    out += dns_label(f"{path}.device", device) if device else [required(f"{path}.device")]
    out += binding_parameters(path, result.get("bindingConditions"), result.get("bindingFailureConditions"))
    if result.get("shareID") is not None:
        out += uid(f"{path}.shareID", result["shareID"])
    return out


def binding_parameters(path: str, conditions: object, failures: object) -> list[Cause]:
    """``validateDeviceBindingParameters`` (devices and allocation results alike)."""
    cond = conditions if isinstance(conditions, list) else []
    fail = failures if isinstance(failures, list) else []
    out: list[Cause] = []
    for field, items in (("bindingConditions", cond), ("bindingFailureConditions", fail)):
        if len(items) > MAX_BINDING_CONDITIONS:
            out.append(too_many(f"{path}.{field}", len(items), MAX_BINDING_CONDITIONS))
        else:
            for i, item in enumerate(items):
                out += qualified_name(f"{path}.{field}[{i}]", item)
    for field, items in (("bindingConditions", cond), ("bindingFailureConditions", fail)):
        seen: set[Any] = set()
        for i, item in enumerate(items):
            if item in seen:
                out.append(duplicate(f"{path}.{field}[{i}]", item))
            seen.add(item)
            if field == "bindingFailureConditions" and item in cond:
                out.append(
                    invalid(
                        f"{path}.{field}[{i}]",
                        item,
                        "bindingFailureConditions must not overlap with bindingConditions",
                    )
                )
    if not cond and fail:
        out.append(
            invalid(
                f"{path}.bindingConditions",
                conditions,
                "bindingConditions are required to use bindingFailureConditions",
            )
        )
    if not fail and cond:
        out.append(
            invalid(
                f"{path}.bindingFailureConditions",
                failures,
                "bindingFailureConditions are required to use bindingConditions",
            )
        )
    return out


def _device_id(entry: JSON) -> tuple[Any, ...]:
    return (entry.get("driver"), entry.get("pool"), entry.get("device"), entry.get("shareID"))


@dataclass(frozen=True)
class _SharedDeviceID:
    """``structured.SharedDeviceID`` as a field error prints it (Go's JSON of the struct)."""

    ident: tuple[Any, ...]

    def __str__(self) -> str:
        driver, pool, device, share = self.ident
        fields = {"Driver": driver, "Pool": pool, "Device": device, "ShareID": share or ""}
        return json.dumps(fields, separators=(",", ":"))


def _shown_id(ident: tuple[Any, ...]) -> _SharedDeviceID:
    return _SharedDeviceID(ident)


_CONDITION_STATUSES = ["False", "True", "Unknown"]
_CONDITION_REASON = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")


def conditions(path: str, items: object) -> list[Cause]:
    """metav1 ``ValidateConditions``: unique types, known status, transition time and reason set."""
    out: list[Cause] = []
    seen: set[Any] = set()
    for i, raw in enumerate(items if isinstance(items, list) else []):
        cpath = f"{path}[{i}]"
        condition = raw if isinstance(raw, dict) else {}
        kind = condition.get("type", "")
        if kind in seen:
            out.append(duplicate(f"{cpath}.type", kind))
        seen.add(kind)
        out += qualified_name(f"{cpath}.type", kind)
        if condition.get("status") not in _CONDITION_STATUSES:
            out.append(not_supported(f"{cpath}.status", condition.get("status", ""), _CONDITION_STATUSES))
        generation = condition.get("observedGeneration", 0)
        if isinstance(generation, int) and generation < 0:
            out.append(
                invalid(f"{cpath}.observedGeneration", generation, "must be greater than or equal to zero")
            )
        if not condition.get("lastTransitionTime"):
            out.append(required(f"{cpath}.lastTransitionTime"))
        reason = condition.get("reason", "")
        if not reason:
            out.append(required(f"{cpath}.reason"))
        elif not isinstance(reason, str) or not _CONDITION_REASON.match(reason):
            out.append(
                invalid(
                    f"{cpath}.reason",
                    reason,
                    "a condition reason must start with alphabetic character, optionally followed by a "
                    "string of alphanumeric characters or '_,:', and must end with an alphanumeric "
                    "character or '_'",
                )
            )
        elif len(reason) > 1024:
            out.append(too_long(f"{cpath}.reason", 1024))
        if len(str(condition.get("message", ""))) > 32 * 1024:
            out.append(too_long(f"{cpath}.message", 32 * 1024))
    return out


def resource_claim_status(obj: JSON, old: JSON | None) -> list[Cause]:
    """``validateResourceClaimStatusUpdate``: consumers, device status, then the allocation."""
    status = obj.get("status") or {}
    if not isinstance(status, dict):
        return [invalid("status", status, "must be an object")]
    old_status = ((old or {}).get("status") or {}) if old is not None else {}
    names = _request_names(obj.get("spec"))
    out: list[Cause] = []
    reserved = status.get("reservedFor") or []
    if len(reserved) > RESERVED_FOR_MAX:
        out.append(too_many("status.reservedFor", len(reserved), RESERVED_FOR_MAX))
    else:
        uids: set[Any] = set()
        for i, raw in enumerate(reserved):
            ref = raw if isinstance(raw, dict) else {}
            for key in ("resource", "name", "uid"):
                if not ref.get(key):
                    out.append(required(f"status.reservedFor[{i}].{key}"))
        for i, ref in enumerate(reserved):
            ident = ref.get("uid") if isinstance(ref, dict) else None
            if ident in uids:
                out.append(duplicate(f"status.reservedFor[{i}]", ident))
            uids.add(ident)
    allocation = status.get("allocation")
    results = ((allocation.get("devices") or {}).get("results") or []) if isinstance(allocation, dict) else []
    allocated = {_device_id(r) for r in results if isinstance(r, dict)}
    seen: set[tuple[Any, ...]] = set()
    for i, entry in enumerate(status.get("devices") or []):
        path = f"status.devices[{i}]"
        if not isinstance(entry, dict):
            out.append(invalid(path, entry, "must be an object"))
            continue
        out += driver_name(f"{path}.driver", entry.get("driver"))
        out += pool_name(f"{path}.pool", entry.get("pool"))
        out += (
            dns_label(f"{path}.device", entry.get("device"))
            if entry.get("device")
            else [required(f"{path}.device")]
        )
        if entry.get("shareID") is not None:
            out += uid(f"{path}.shareID", entry["shareID"])
        ident = _device_id(entry)
        if ident not in allocated:
            out.append(invalid(path, _shown_id(ident), "must be an allocated device in the claim"))
        items = entry.get("conditions") or []
        if len(items) > DEVICE_STATUS_MAX_CONDITIONS:
            out.append(too_many(f"{path}.conditions", len(items), DEVICE_STATUS_MAX_CONDITIONS))
        out += conditions(f"{path}.conditions", items)
        if entry.get("data") is not None:  # validateRawExtension on the bytes as sent (JSON null: no data)
            if not isinstance(entry["data"], dict):
                out.append(invalid(f"{path}.data", "<value omitted>", "must be a valid JSON object"))
            elif len(json.dumps(entry["data"], separators=(",", ":"))) > RAW_MAX_BYTES:
                out.append(too_long(f"{path}.data", RAW_MAX_BYTES))
        network = entry.get("networkData") or {}
        if isinstance(network, dict):
            if len(network.get("interfaceName") or "") > 256:
                out.append(too_long(f"{path}.networkData.interfaceName", 256))
            if len(network.get("hardwareAddress") or "") > 128:
                out.append(too_long(f"{path}.networkData.hardwareAddress", 128))
            out += interface_addresses(f"{path}.networkData.ips", network.get("ips") or [])
    for i, entry in enumerate(status.get("devices") or []):
        if isinstance(entry, dict):
            ident = _device_id(entry)
            if ident in seen:
                out.append(duplicate(f"status.devices[{i}]", _shown_id(ident)))
            seen.add(ident)
    if reserved and allocation is None:
        out.append(forbidden("status.reservedFor", "may not be specified when `allocated` is not set"))
    old_allocation = old_status.get("allocation")
    if old_allocation is not None and allocation is not None:
        if old_allocation != allocation:
            out.append(immutable("status.allocation", "<allocation>"))
    elif allocation is not None:
        if len(results) > ALLOCATION_RESULTS_MAX:
            out.append(too_many("status.allocation.devices.results", len(results), ALLOCATION_RESULTS_MAX))
        else:
            for i, result in enumerate(results):
                path = f"status.allocation.devices.results[{i}]"
                if isinstance(result, dict):
                    out += _allocation_result(path, result, names)
                else:
                    out.append(invalid(path, result, "must be an object"))
        configs = (
            ((allocation.get("devices") or {}).get("config") or []) if isinstance(allocation, dict) else []
        )
        for i, config in enumerate(configs if isinstance(configs, list) else []):
            out += allocation_config(f"status.allocation.devices.config[{i}]", config, names)
        selector = allocation.get("nodeSelector") if isinstance(allocation, dict) else None
        if selector is not None:
            out += node_selector("status.allocation.nodeSelector", selector)
    return out


#: ``NetworkDeviceDataMaxIPs``.
MAX_IPS = 16
_CIDR_MSG = "must be a valid address in CIDR form, (e.g. 10.9.8.7/24 or 2001:db8::1/64)"


def interface_address(path: str, value: object) -> list[Cause]:
    """apimachinery ``IsValidInterfaceAddress``: ``ParseCIDRSloppy`` (IPv4 octets may carry leading
    zeros), then the canonical ``ip/prefix`` form."""
    text = value if isinstance(value, str) else ""
    address, slash, prefix = text.partition("/")
    if ":" not in address:
        octets = address.split(".")
        if len(octets) == 4 and all(o.isdigit() and len(o) <= 3 for o in octets):
            address = ".".join(str(int(o)) for o in octets)
    try:
        if not slash or not prefix.isdigit():
            raise ValueError(text)
        iface = ipaddress.ip_interface(f"{address}/{int(prefix)}")
    except ValueError:
        return [invalid(path, value, _CIDR_MSG)]
    ip, length = iface.ip, iface.network.prefixlen
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        # Go's net.IP keeps a mapped IPv4 address as IPv4: "::ffff:1.2.3.4/120" is "1.2.3.4/24".
        ip, length = ip.ipv4_mapped, max(length - 96, 0)
    canonical = f"{ip}/{length}"
    if text != canonical:
        return [invalid(path, value, f"must be in canonical form ({json.dumps(canonical)})")]
    return []


def interface_addresses(path: str, items: object) -> list[Cause]:
    """``validateNetworkDeviceData``'s ``ips``: a set of at most 16 interface addresses."""
    if not isinstance(items, list):
        return [invalid(path, items, "must be a list")]
    if len(items) > MAX_IPS:
        return [too_many(path, len(items), MAX_IPS)]
    out: list[Cause] = []
    for i, item in enumerate(items):
        out += interface_address(f"{path}[{i}]", item)
    seen: set[Any] = set()
    for i, item in enumerate(items):
        if item in seen:
            out.append(duplicate(f"{path}[{i}]", item))
        seen.add(item)
    return out


_CONFIG_SOURCES = ["FromClaim", "FromClass"]


def allocation_config(path: str, config: object, names: dict[str, set[str]]) -> list[Cause]:
    """``validateDeviceAllocationConfiguration``: source, request references, opaque config."""
    if not isinstance(config, dict):
        return [invalid(path, config, "must be an object")]
    out: list[Cause] = []
    source = config.get("source") or ""
    if not source:
        out.append(required(f"{path}.source"))
    elif source not in _CONFIG_SOURCES:
        out.append(not_supported(f"{path}.source", source, _CONFIG_SOURCES))
    requests = config.get("requests") or []
    if isinstance(requests, list) and len(requests) > CLAIM_MAX_REQUESTS:
        out.append(too_many(f"{path}.requests", len(requests), CLAIM_MAX_REQUESTS))
    elif isinstance(requests, list):
        seen: set[Any] = set()
        for i, name in enumerate(requests):
            out += _request_ref(f"{path}.requests[{i}]", name, names)
        for i, name in enumerate(requests):
            if name in seen:
                out.append(duplicate(f"{path}.requests[{i}]", name))
            seen.add(name)
    opaque = config.get("opaque")
    if not isinstance(opaque, dict):
        out.append(required(f"{path}.opaque"))
    else:
        out += driver_name(f"{path}.opaque.driver", opaque.get("driver"))
        if not isinstance(opaque.get("parameters"), dict):
            out.append(required(f"{path}.opaque.parameters"))
    return out


def extended_resource_name(value: object) -> bool:
    """core ``IsExtendedResourceName``: outside ``kubernetes.io/``, not ``requests.``-prefixed, and a
    qualified name once ``requests.`` is put in front (so the name part is at most 54 bytes)."""
    if not isinstance(value, str) or "/" not in value or "kubernetes.io/" in value:
        return False
    if value.startswith("requests."):
        return False
    return not qualified_name("", f"requests.{value}")


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
    extended = spec.get("extendedResourceName")
    if extended is not None and not extended_resource_name(extended):
        out.append(invalid("spec.extendedResourceName", extended, "must be a valid extended resource name"))
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
