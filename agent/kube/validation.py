"""Pre-publish checks: every device entry of a ResourceSlice against the API server's rules
(limits and formats of upstream `pkg/apis/resource/validation`).

The API server rejects a whole slice when one device breaks a rule; checking first lets the
publisher leave out just that device (with a log, an Event and a metric) and publish the rest.
Checks work on the API dicts that will be written, so nothing that bypassed `agent.core.model`
reaches the server unchecked.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent.core.errors import QuantityError
from agent.core.model import (
    INT64_MAX,
    INT64_MIN,
    MAX_ATTRIBUTES_AND_CAPACITIES,
    MAX_STRING_LENGTH,
    check_driver_name,
    check_qualified_name,
    is_dns_label,
    is_dns_subdomain,
)
from agent.core.quantity import Quantity
from agent.core.semver import MAX_VERSION_LENGTH, is_semver
from agent.health.taints import EFFECT_NO_EXECUTE, EFFECT_NO_SCHEDULE, EFFECT_NONE, ClusterTaintSupport

MAX_DEVICES_PER_SLICE = 128
MAX_POOL_NAME_LENGTH = 253
MAX_LABEL_VALUE_LENGTH = 63
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")


@dataclass(frozen=True)
class Problem:
    """Why one device (or the slice, when `device` is empty) breaks a rule."""

    device: str
    field: str
    message: str
    reason: str
    """A short metric label: ``name``, ``attributes``, ``capacity``, ``taints``..."""

    def __str__(self) -> str:
        where = f"device {self.device!r}: " if self.device else ""
        return f"{where}{self.field}: {self.message}"


def _check_label_name(key: str) -> str | None:
    prefix, sep, name = key.rpartition("/")
    if sep and (not prefix or len(prefix) > 253 or not is_dns_subdomain(prefix)):
        return f"prefix {prefix!r} must be a DNS subdomain"
    if not name or len(name) > 63 or not _LABEL_NAME.match(name):
        return f"name {name!r} must be at most 63 characters of alphanumerics, '-', '_' or '.'"
    return None


def _check_label_value(value: str) -> str | None:
    if value and (len(value) > MAX_LABEL_VALUE_LENGTH or not _LABEL_NAME.match(value)):
        return f"{value!r} must be a label value (at most 63 alphanumerics, '-', '_' or '.')"
    return None


def _flat(entry: Mapping[str, Any]) -> Mapping[str, Any]:
    basic = entry.get("basic")
    return basic if isinstance(basic, Mapping) else entry


def check_attribute_value(value: Any) -> str | None:
    """Why an attribute value dict is invalid, or None."""
    if not isinstance(value, Mapping) or len(value) != 1:
        return "must have exactly one of int, bool, string or version"
    kind, item = next(iter(value.items()))
    if kind == "bool":
        return None if isinstance(item, bool) else "bool must be true or false"
    if kind == "int":
        if isinstance(item, bool) or not isinstance(item, int) or not INT64_MIN <= item <= INT64_MAX:
            return f"{item!r} is not an int64"
        return None
    if kind == "string":
        if not isinstance(item, str) or len(item) > MAX_STRING_LENGTH:
            return f"string must be at most {MAX_STRING_LENGTH} characters"
        return None
    if kind == "version":
        if not isinstance(item, str) or len(item) > MAX_VERSION_LENGTH or not is_semver(item):
            return f"{item!r} is not a semver 2.0.0 version"
        return None
    return f"unknown value type {kind!r}"


def check_taints(taints: Any, support: ClusterTaintSupport) -> str | None:
    """Why a device's taint list is invalid for this cluster, or None."""
    if not isinstance(taints, list):
        return "must be a list"
    if len(taints) > support.max_taints_per_device:
        return f"{len(taints)} taints, the cluster accepts at most {support.max_taints_per_device}"
    effects = {EFFECT_NO_SCHEDULE, EFFECT_NO_EXECUTE} | ({EFFECT_NONE} if support.none_effect else set())
    for taint in taints:
        if not isinstance(taint, Mapping):
            return "each taint must be an object"
        key = str(taint.get("key", ""))
        problem = _check_label_name(key)
        if problem:
            return f"taint key {key!r}: {problem}"
        problem = _check_label_value(str(taint.get("value", "")))
        if problem:
            return f"taint {key!r} value {problem}"
        effect = taint.get("effect")
        if effect not in effects:
            return f"taint {key!r} effect {effect!r} must be one of {', '.join(sorted(effects))}"
    return None


def check_device_entry(entry: Mapping[str, Any], support: ClusterTaintSupport) -> Problem | None:
    """The first rule a ``spec.devices[]`` entry breaks, or None when the API server will accept it."""
    name = entry.get("name")
    device = name if isinstance(name, str) else repr(name)
    if not isinstance(name, str) or not is_dns_label(name):
        return Problem(
            device, "name", "must be a DNS label: lower case letters, digits and '-', ≤ 63", "name"
        )
    body = _flat(entry)
    attributes = body.get("attributes") or {}
    capacity = body.get("capacity") or {}
    if not isinstance(attributes, Mapping) or not isinstance(capacity, Mapping):
        return Problem(device, "attributes", "attributes and capacity must be maps", "attributes")
    if len(attributes) + len(capacity) > MAX_ATTRIBUTES_AND_CAPACITIES:
        return Problem(
            device,
            "attributes",
            f"{len(attributes) + len(capacity)} attributes and capacities, at most "
            f"{MAX_ATTRIBUTES_AND_CAPACITIES}",
            "attributes",
        )
    for key, value in attributes.items():
        problem = check_qualified_name(str(key)) or check_attribute_value(value)
        if problem:
            return Problem(device, f"attributes[{key}]", problem, "attributes")
    for key, value in capacity.items():
        problem = check_qualified_name(str(key))
        if problem is None:
            raw = value.get("value") if isinstance(value, Mapping) else None
            try:
                Quantity.parse(raw if isinstance(raw, str | int) else "")
            except QuantityError:
                problem = f"{raw!r} is not a quantity"
        if problem:
            return Problem(device, f"capacity[{key}]", problem, "capacity")
    if "taints" in body:
        problem = check_taints(body["taints"], support)
        if problem:
            return Problem(device, "taints", problem, "taints")
    return None


def check_slice_spec(
    *,
    driver: str,
    node_name: str,
    pool_name: str,
    device_count: int,
    max_devices: int = MAX_DEVICES_PER_SLICE,
) -> list[Problem]:
    """Slice-level rules (driver, node, pool, device count); problems here block the whole pool."""
    problems: list[Problem] = []
    driver_problem = check_driver_name(driver)
    if driver_problem:
        problems.append(Problem("", "spec.driver", f"{driver!r} {driver_problem}", "driver"))
    if not node_name or not is_dns_subdomain(node_name):
        problems.append(Problem("", "spec.nodeName", f"{node_name!r} is not a valid node name", "node"))
    if (
        not pool_name
        or len(pool_name) > MAX_POOL_NAME_LENGTH
        or not all(is_dns_subdomain(p) for p in pool_name.split("/"))
    ):
        problems.append(Problem("", "spec.pool.name", f"{pool_name!r} is not a valid pool name", "pool"))
    if device_count > max_devices:
        problems.append(
            Problem("", "spec.devices", f"{device_count} devices, at most {max_devices}", "count")
        )
    return problems


def partition_entries(
    entries: Sequence[Mapping[str, Any]], support: ClusterTaintSupport
) -> tuple[list[Mapping[str, Any]], list[Problem]]:
    """Split device entries into the valid ones and the problems of the others.

    Duplicate device names are problems too (the second and later entries are left out).
    """
    valid: list[Mapping[str, Any]] = []
    problems: list[Problem] = []
    seen: set[str] = set()
    for entry in entries:
        problem = check_device_entry(entry, support)
        if problem is None and entry["name"] in seen:
            problem = Problem(str(entry["name"]), "name", "duplicate device name in the pool", "duplicate")
        if problem is not None:
            problems.append(problem)
            continue
        seen.add(str(entry["name"]))
        valid.append(entry)
    return valid, problems
