"""ResourceSlice validation as the apiserver does it, per served release and feature gates.

Written from upstream ``pkg/apis/resource/validation/validation.go`` (``validateResourceSliceSpec``,
``validateDevice``, ``validateCounterSet``, ``validateDeviceCounterConsumption``,
``validateRequestPolicy``, ``validateDeviceBindingParameters``, ``validateQualifiedName``) and the
1.36 answers recorded in ``dra-1.36-verified-shapes.md``. Field paths and messages are the
apiserver's, so tests can compare them with a real cluster's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from agent.core.quantity import Quantity
from agent.emulator.errors import Cause
from agent.emulator.validation import (
    ATTRIBUTE_STRING_MAX,
    DEVICE_MAX_ID_LENGTH,
    MAX_ATTRIBUTES_AND_CAPACITIES,
    MAX_COUNTER_SETS,
    MAX_COUNTERS_PER_SET,
    SLICE_MAX_DEVICES,
    SLICE_MAX_DEVICES_WITH_TAINTS,
    VERSION_MAX,
    Rules,
    binding_parameters,
    c_identifier,
    canonical_quantity,
    dns_label,
    dns_subdomain,
    driver_name,
    duplicate,
    forbidden,
    immutable,
    invalid,
    node_selector,
    pool_name,
    required,
    semver_ok,
    taint,
    too_long,
    too_many,
)

JSON = dict[str, Any]

#: ``ResourceSliceMaxDeviceCounterConsumptionsPerDevice`` and ``...CountersPerDeviceCounterConsumption``.
MAX_CONSUMES_COUNTERS = 2
MAX_COUNTERS_PER_CONSUMPTION = 32
#: ``CapacityRequestPolicyDiscreteMaxOptions``.
MAX_VALID_VALUES = 10
#: ``ResourceSliceMaxAttributeValuesPerDevice``: list items count one by one.
MAX_ATTRIBUTE_VALUES = 48
#: The list-valued attribute fields of ``DRAListTypeAttributes`` (1.36).
LIST_ATTRIBUTE_FIELDS = ("bools", "ints", "strings", "versions")
_NODE_CHOICES = "`nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection`"
_DEVICE_NODE_CHOICES = (
    "exactly one of `nodeName`, `nodeSelector`, or `allNodes` is required when "
    "`perDeviceNodeSelection` is set to true in the ResourceSlice spec"
)


def resource_slice(obj: JSON, old: JSON | None, rules: Rules) -> list[Cause]:
    """``validateResourceSliceSpec`` (metadata is checked separately)."""
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return [required("spec")]
    old_spec = old.get("spec") if old is not None else None
    out: list[Cause] = []
    out += driver_name("spec.driver", spec.get("driver"))
    out += _pool(spec.get("pool"))
    if isinstance(old_spec, dict):
        out += _immutable_fields(spec, old_spec)
    out += _node_selection(spec)
    devices = spec.get("devices")
    counters = spec.get("sharedCounters")
    if rules.minor >= 35 and devices is not None and counters is not None:
        # An empty list still counts as set: Go decodes [] into a non-nil slice.
        out.append(invalid("spec", "", "only one of `sharedCounters` or `devices` is allowed"))
    if devices is not None and not isinstance(devices, list):
        return [*out, invalid("spec.devices", devices, "must be a list")]
    out += _devices(devices or [], old_spec if isinstance(old_spec, dict) else None, spec, rules)
    if counters is not None:
        out += _counter_sets(counters)
    return out


def _pool(pool: object) -> list[Cause]:
    if not isinstance(pool, dict):
        return [required("spec.pool")]
    out = pool_name("spec.pool.name", pool.get("name"))
    count = pool.get("resourceSliceCount", 0)
    if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
        out.append(invalid("spec.pool.resourceSliceCount", count, "must be greater than zero"))
    generation = pool.get("generation", 0)
    if not isinstance(generation, int) or isinstance(generation, bool) or generation < 0:
        out.append(invalid("spec.pool.generation", generation, "must be greater than or equal to zero"))
    return out


def _immutable_fields(spec: JSON, old: JSON) -> list[Cause]:
    out: list[Cause] = []
    if (spec.get("pool") or {}).get("name") != (old.get("pool") or {}).get("name"):
        out.append(immutable("spec.pool.name", (spec.get("pool") or {}).get("name")))
    for key in ("driver", "nodeName"):
        if spec.get(key) != old.get(key):
            out.append(immutable(f"spec.{key}", spec.get(key)))
    return out


def _node_selection(spec: JSON) -> list[Cause]:
    out: list[Cause] = []
    chosen: list[str] = []
    if "nodeName" in spec:
        if not spec["nodeName"]:
            out.append(required("spec.nodeName", "must not be empty when set"))
        else:
            chosen.append("`nodeName`")
            out += dns_subdomain("spec.nodeName", spec["nodeName"])
    if spec.get("nodeSelector") is not None:
        chosen.append("`nodeSelector`")
        out += node_selector("spec.nodeSelector", spec["nodeSelector"])
        terms = (
            spec["nodeSelector"].get("nodeSelectorTerms") if isinstance(spec["nodeSelector"], dict) else None
        )
        if not isinstance(terms, list) or len(terms) != 1:
            out.append(
                invalid(
                    "spec.nodeSelector.nodeSelectorTerms", terms, "must have exactly one node selector term"
                )
            )
    for key in ("allNodes", "perDeviceNodeSelection"):
        if key in spec:
            if spec[key] is True:
                chosen.append(f"`{key}`")
            else:
                out.append(invalid(f"spec.{key}", spec[key], "must be either unset or set to true"))
    if not chosen:
        out.append(required("spec", f"exactly one of {_NODE_CHOICES} is required"))
    elif len(chosen) > 1:
        out.append(
            invalid(
                "spec",
                "{" + ", ".join(chosen) + "}",
                f"exactly one of {_NODE_CHOICES} is required, but multiple fields are set",
            )
        )
    return out


def _has_list_attributes(device: JSON) -> bool:
    attributes = device.get("attributes")
    return isinstance(attributes, dict) and any(
        isinstance(a, dict) and any(a.get(k) is not None for k in LIST_ATTRIBUTE_FIELDS)
        for a in attributes.values()
    )


def _devices(devices: list[Any], old_spec: JSON | None, spec: JSON, rules: Rules) -> list[Cause]:
    limit = SLICE_MAX_DEVICES
    advanced = [
        d
        for d in devices
        if isinstance(d, dict) and (d.get("taints") or d.get("consumesCounters") or _has_list_attributes(d))
    ]
    if rules.minor >= 35 and advanced:
        limit = SLICE_MAX_DEVICES_WITH_TAINTS
    if len(devices) > limit:
        return [too_many("spec.devices", len(devices), limit)]
    old_devices = {d.get("name"): d for d in ((old_spec or {}).get("devices") or []) if isinstance(d, dict)}
    per_device = spec.get("perDeviceNodeSelection") is True
    out: list[Cause] = []
    seen: set[str] = set()
    for i, device in enumerate(devices):
        path = f"spec.devices[{i}]"
        if not isinstance(device, dict):
            out.append(invalid(path, device, "must be an object"))
            continue
        out += _device(path, device, old_devices.get(device.get("name")), per_device, rules)
        name = device.get("name")
        if isinstance(name, str) and name:
            if name in seen:
                out.append(duplicate(f"{path}.name", name))
            seen.add(name)
    return out


def _device(path: str, device: JSON, old: JSON | None, per_device: bool, rules: Rules) -> list[Cause]:
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
    total = len(attributes) + len(capacity)
    if total > MAX_ATTRIBUTES_AND_CAPACITIES:
        out.append(
            invalid(
                path,
                total,
                "the total number of attributes and capacities must not exceed "
                f"{MAX_ATTRIBUTES_AND_CAPACITIES}",
            )
        )
    values = sum(_value_count(a) for a in attributes.values())
    if values > MAX_ATTRIBUTE_VALUES:
        out.append(
            invalid(
                path, values, f"the total number of attribute values must not exceed {MAX_ATTRIBUTE_VALUES}"
            )
        )
    for name, attribute in attributes.items():
        out += attribute_name(f"{path}.attributes", name)
        out += _attribute(f"{path}.attributes[{name}]", attribute)
    if old is None or (old.get("capacity") or {}) != capacity:
        shared = device.get("allowMultipleAllocations") is True
        for name, cap in capacity.items():
            out += attribute_name(f"{path}.capacity", name)
            out += _capacity(
                f"{path}.capacity[{name}]", cap, shared, rules.gate("DRAFractionalCapacityRange")
            )
    taints = device.get("taints") or []
    if old is None or (old.get("taints") or []) != taints:
        if not isinstance(taints, list):
            out.append(invalid(f"{path}.taints", taints, "must be a list"))
        elif len(taints) > rules.max_taints:
            out.append(too_many(f"{path}.taints", len(taints), rules.max_taints))
        else:
            for j, item in enumerate(taints):
                out += taint(f"{path}.taints[{j}]", item, rules)
    if device.get("consumesCounters") is not None:
        out += _consumptions(f"{path}.consumesCounters", device["consumesCounters"])
    out += _device_node_selection(path, device, per_device)
    out += binding_parameters(path, device.get("bindingConditions"), device.get("bindingFailureConditions"))
    return out


def _value_count(attribute: object) -> int:
    """``numEntriesDeviceAttribute``: a scalar counts once, a list by its items."""
    if not isinstance(attribute, dict):
        return 1
    items = sum(len(attribute[k]) for k in LIST_ATTRIBUTE_FIELDS if isinstance(attribute.get(k), list))
    return items or 1


def attribute_name(path: str, name: object) -> list[Cause]:
    """``validateQualifiedName``: ``[domain/]id``; the domain follows the driver-name rule.

    Up to 1.36 a name with more than one slash is not checked at all (an upstream TODO), so
    ``a.com/b/c`` is accepted, as a real 1.36 apiserver does.
    """
    if not isinstance(name, str):
        return [invalid(path, name, "must be a string")]
    parts = name.split("/")
    if len(parts) == 1:
        return c_identifier(path, parts[0], DEVICE_MAX_ID_LENGTH)
    if len(parts) != 2:
        return []
    out: list[Cause] = []
    if not parts[0]:
        out.append(invalid(path, "", "the domain must not be empty"))
    else:
        out += driver_name(path, parts[0])
    if not parts[1]:
        out.append(invalid(path, "", "the name must not be empty"))
    else:
        out += c_identifier(path, parts[1], DEVICE_MAX_ID_LENGTH)
    return out


def _attribute(path: str, value: object) -> list[Cause]:
    """``validateDeviceAttribute``: exactly one of the scalar (or, from 1.36, list) fields."""
    if not isinstance(value, dict):
        return [invalid(path, value, "must be an object")]
    present = [
        k for k in ("bool", "int", "string", "version", *LIST_ATTRIBUTE_FIELDS) if value.get(k) is not None
    ]
    out: list[Cause] = []
    if "string" in present:
        out += _string_value(f"{path}.string", value["string"])
    if "version" in present:
        out += _version_value(f"{path}.version", value["version"])
    if "int" in present:
        item = value["int"]
        if isinstance(item, bool) or not isinstance(item, int) or not -(2**63) <= item < 2**63:
            out.append(invalid(f"{path}.int", item, "must be a 64-bit integer"))
    for kind in LIST_ATTRIBUTE_FIELDS:
        if kind in present:
            items = value[kind]
            if not isinstance(items, list) or not items:
                out.append(invalid(f"{path}.{kind}", items, "must not be empty if specified"))
                continue
            for i, item in enumerate(items):
                if kind == "strings":
                    out += _string_value(f"{path}.strings[{i}]", item)
                elif kind == "versions":
                    out += _version_value(f"{path}.versions[{i}]", item)
    if not present:
        out.append(invalid(path, "", "exactly one value must be specified"))
    elif len(present) > 1:
        out.append(invalid(path, value, "exactly one value must be specified"))
    return out


def _string_value(path: str, value: object) -> list[Cause]:
    if not isinstance(value, str):
        return [invalid(path, value, "must be a string")]
    return [too_long(path, ATTRIBUTE_STRING_MAX)] if len(value) > ATTRIBUTE_STRING_MAX else []


def _version_value(path: str, value: object) -> list[Cause]:
    if not isinstance(value, str):
        return [invalid(path, value, "must be a string")]
    out: list[Cause] = []
    if not semver_ok(value):
        out.append(invalid(path, value, "must be a string compatible with semver.org spec 2.0.0"))
    if len(value) > VERSION_MAX:
        out.append(too_long(path, VERSION_MAX))
    return out


def _quantity(value: object) -> Quantity | None:
    canonical = canonical_quantity(value)
    return Quantity.parse(canonical) if canonical is not None else None


def _capacity(path: str, cap: object, shared: bool, fractional: bool = False) -> list[Cause]:
    """A capacity; ``value`` defaults to 0 (a real 1.36 apiserver accepts ``{}``)."""
    if not isinstance(cap, dict):
        return [invalid(path, cap, "must be an object")]
    value = _quantity(cap.get("value", "0"))
    if value is None:
        return [
            invalid(
                f"{path}.value",
                cap["value"],
                "quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'",
            )
        ]
    policy = cap.get("requestPolicy")
    if policy is None:
        return []
    if not shared:
        return [forbidden(f"{path}.requestPolicy", "allowMultipleAllocations must be true")]
    return request_policy(f"{path}.requestPolicy", value, policy, fractional)


def request_policy(path: str, capacity: Quantity, policy: object, fractional: bool = False) -> list[Cause]:
    """``validateRequestPolicy`` and its range/values helpers: integer arithmetic on
    ``Quantity.Value()`` (rounded up) as in 1.36, milli-unit arithmetic when ``fractional``
    (``DRAFractionalCapacityRange``, beta and on in 1.37) and the range has a fractional bound or step."""
    if not isinstance(policy, dict):
        return [invalid(path, policy, "must be an object")]
    values = policy.get("validValues") or []
    valid_range = policy.get("validRange")
    if values and valid_range is not None:
        return [
            forbidden(
                path,
                'exactly one policy can be specified, cannot specify "validValues" and "validRange" '
                "at the same time",
            )
        ]
    default = _quantity(policy["default"]) if policy.get("default") is not None else None
    if values:
        if default is None:
            return [required(f"{path}.default", "required when validValues is defined")]
        return _valid_values(f"{path}.validValues", default, capacity, values, fractional)
    if valid_range is not None:
        if default is None:
            return [required(f"{path}.default", "required when validRange is defined")]
        return _valid_range(f"{path}.validRange", default, capacity, valid_range, fractional)
    return []


def _value(quantity: Quantity) -> int:
    """``Quantity.Value()``: the integer value, rounded up."""
    return math.ceil(quantity.value)


def _valid_values(
    path: str, default: Quantity, capacity: Quantity, raw: list[Any], fractional: bool = False
) -> list[Cause]:
    values = [q for q in (_quantity(v) for v in raw) if q is not None]
    out: list[Cause] = []
    for i in range(len(values) - 1):
        if values[i + 1] < values[i]:
            out.append(
                invalid(f"{path}[{i + 1}]", str(values[i + 1]), "values must be sorted in ascending order")
            )
    found = False
    if len(values) > MAX_VALID_VALUES:
        out.append(too_many(path, len(values), MAX_VALID_VALUES))
    else:
        seen: set[Any] = set()
        for i, option in enumerate(values):
            if capacity < option:
                out.append(
                    invalid(f"{path}[{i}]", str(option), f"option is larger than capacity value: {capacity}")
                )
            found = found or option.value == default.value
            # quantityKey: Value() as a decimal string; with DRAFractionalCapacityRange the exact value.
            key: Any = option.value if fractional else _value(option)
            if key in seen:
                out.append(duplicate(f"{path}[{i}]", str(option) if fractional else str(key)))
            seen.add(key)
    if not found:
        out.append(invalid(path, str(default), "default value is not valid according to the requestPolicy"))
    return out


#: ``MaxMilliValue``: the largest milli value a 64-bit integer holds.
_MAX_MILLI = (2**63 - 1) // 1000


def _milli_ok(quantity: Quantity) -> bool:
    milli = quantity.value * 1000
    return milli.denominator == 1 and abs(milli) <= _MAX_MILLI


def _valid_range(
    path: str, default: Quantity, capacity: Quantity, raw: object, fractional: bool = False
) -> list[Cause]:
    if not isinstance(raw, dict) or raw.get("min") is None:
        return [required(f"{path}.min", "required when validRange is defined")]
    low = _quantity(raw["min"])
    high = _quantity(raw["max"]) if raw.get("max") is not None else None
    step = _quantity(raw["step"]) if raw.get("step") is not None else None
    if low is None:
        return []
    out: list[Cause] = []
    milli = fractional and any(q is not None and q.value.denominator != 1 for q in (low, high, step))
    if milli:
        named = (("default", default), ("min", low), ("max", high), ("step", step))
        out = [
            invalid(f"{path}.{name}", str(q), "value cannot be represented as a milli value")
            for name, q in named
            if q is not None and not _milli_ok(q)
        ]
        if out:
            return out
    if capacity < low:
        out.append(invalid(f"{path}.min", str(low), f"min is larger than capacity value: {capacity}"))
    if default < low:
        out.append(invalid(f"{path}.min", str(default), f"default is less than min: {low}"))
    if high is not None:
        if high < low:
            out.append(invalid(f"{path}.max", str(low), f"min is larger than max: {high}"))
        if capacity < high:
            out.append(invalid(f"{path}.max", str(high), f"max is larger than capacity value: {capacity}"))
        if high < default:
            out.append(invalid(f"{path}.max", str(default), f"default is more than max: {high}"))
    if step is not None:
        if step.value <= 0:
            # A real 1.36.2 apiserver panics here (integer divide by zero, a 500); 422 is saner.
            out.append(invalid(f"{path}.step", str(step), "must be greater than zero"))
            return out
        one_step = Quantity(low.value + step.value, low.format)
        if capacity < one_step:
            out.append(
                invalid(
                    f"{path}.step",
                    str(step),
                    f"one step {one_step} is larger than capacity value: {capacity}",
                )
            )
        for value in (default, high):
            if value is None:
                continue
            if milli:
                aligned = ((value.value - low.value) * 1000) % (step.value * 1000) == 0
            else:
                step_value = _value(step)
                aligned = step_value != 0 and (_value(value) - _value(low)) % step_value == 0
            if not aligned:
                out.append(
                    invalid(
                        f"{path}.step",
                        str(value),
                        f"value is not a multiple of a given step ({step}) from ({low})",
                    )
                )
    return out


def _counters(path: str, counters: object, limit: int) -> list[Cause]:
    """A counter map: required, at most ``limit`` entries, DNS-label keys, parseable values."""
    if not counters:
        return [required(path)]
    if not isinstance(counters, dict):
        return [invalid(path, counters, "must be a map")]
    if len(counters) > limit:
        return [too_many(path, len(counters), limit)]
    out: list[Cause] = []
    for key, counter in counters.items():
        out += dns_label(path, key)
        value = counter.get("value") if isinstance(counter, dict) else None
        if value is not None and canonical_quantity(value) is None:
            out.append(invalid(f"{path}[{key}].value", value, "must be a quantity"))
    return out


def _counter_sets(sets: object) -> list[Cause]:
    """``validateCounterSet`` over ``spec.sharedCounters`` (a set keyed by name)."""
    if not isinstance(sets, list):
        return [invalid("spec.sharedCounters", sets, "must be a list")]
    if len(sets) > MAX_COUNTER_SETS:
        return [too_many("spec.sharedCounters", len(sets), MAX_COUNTER_SETS)]

    def one(path: str, item: JSON) -> list[Cause]:
        name = item.get("name")
        out = dns_label(f"{path}.name", name) if name else [required(f"{path}.name")]
        return out + _counters(f"{path}.counters", item.get("counters"), MAX_COUNTERS_PER_SET)

    return _keyed_set("spec.sharedCounters", sets, "name", one)


def _consumptions(path: str, items: object) -> list[Cause]:
    """``validateDeviceCounterConsumption`` over a device's ``consumesCounters`` (keyed by counterSet)."""
    if not isinstance(items, list):
        return [invalid(path, items, "must be a list")]
    if len(items) > MAX_CONSUMES_COUNTERS:
        return [too_many(path, len(items), MAX_CONSUMES_COUNTERS)]

    def one(item_path: str, item: JSON) -> list[Cause]:
        name = item.get("counterSet")
        out = dns_label(f"{item_path}.counterSet", name) if name else [required(f"{item_path}.counterSet")]
        return out + _counters(f"{item_path}.counters", item.get("counters"), MAX_COUNTERS_PER_CONSUMPTION)

    return _keyed_set(path, items, "counterSet", one)


def _keyed_set(
    path: str, items: list[Any], key: str, check: Callable[[str, JSON], list[Cause]]
) -> list[Cause]:
    """``validateSet``: each item checked, then a ``Duplicate value`` at the index of a repeated key."""
    out: list[Cause] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            out.append(invalid(f"{path}[{i}]", item, "must be an object"))
            continue
        out += check(f"{path}[{i}]", item)
    seen: set[Any] = set()
    for i, item in enumerate(items):
        value = item.get(key) if isinstance(item, dict) else None
        if value in seen:
            out.append(duplicate(f"{path}[{i}]", value))
        seen.add(value)
    return out


def _device_node_selection(path: str, device: JSON, per_device: bool) -> list[Cause]:
    has_any = any(device.get(k) is not None for k in ("nodeName", "nodeSelector", "allNodes"))
    if not per_device:
        if has_any:
            return [
                invalid(
                    path,
                    None,
                    "`nodeName`, `nodeSelector` and `allNodes` can only be set if `perDeviceNodeSelection` "
                    "is set to true in the ResourceSlice spec",
                )
            ]
        return []
    out: list[Cause] = []
    chosen: list[str] = []
    if device.get("nodeName") is not None:
        if device["nodeName"]:
            chosen.append("`nodeName`")
            out += dns_subdomain(f"{path}.nodeName", device["nodeName"])
        else:
            out.append(invalid(f"{path}.nodeName", "", "must not be empty"))
    if device.get("nodeSelector") is not None:
        chosen.append("`nodeSelector`")
        out += node_selector(f"{path}.nodeSelector", device["nodeSelector"])
    if device.get("allNodes") is not None:
        if device["allNodes"] is True:
            chosen.append("`allNodes`")
        else:
            out.append(invalid(f"{path}.allNodes", device["allNodes"], "must be either unset or set to true"))
    if not chosen:
        out.append(required(path, _DEVICE_NODE_CHOICES))
    elif len(chosen) > 1:
        out.append(invalid(path, "{" + ", ".join(chosen) + "}", _DEVICE_NODE_CHOICES))
    return out
