"""The vendor-neutral device model, with the API server's ResourceSlice limits enforced.

A backend turns vendor data into `Device` values; the core turns them into ResourceSlices,
taints and the kubelet's health stream. Construction fails with `DeviceModelError` naming the
device and the field, so an invalid device never reaches the API server.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from agent.core.errors import DeviceModelError
from agent.core.quantity import Quantity
from agent.core.semver import MAX_VERSION_LENGTH, is_semver

MAX_ATTRIBUTES_AND_CAPACITIES = 32
MAX_STRING_LENGTH = 64
MAX_ID_LENGTH = 32
MAX_DOMAIN_LENGTH = 63
MAX_DRIVER_NAME_LENGTH = 63
MAX_DEVICE_NAME_LENGTH = 63
# Partitionable devices (KEP-4815), as `resource.k8s.io/v1` types.go of 1.35+ bounds them.
MAX_COUNTER_SETS_PER_SLICE = 8
MAX_COUNTERS_PER_SET = 32
MAX_CONSUMPTIONS_PER_DEVICE = 2
MAX_COUNTERS_PER_CONSUMPTION = 32
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def is_dns_label(value: str) -> bool:
    """RFC 1123 label: lower case alphanumerics and '-', at most 63 characters."""
    return len(value) <= MAX_DEVICE_NAME_LENGTH and _DNS_LABEL.match(value) is not None


def is_dns_subdomain(value: str) -> bool:
    """RFC 1123 subdomain: dot-separated labels, at most 253 characters."""
    return 0 < len(value) <= 253 and all(_DNS_LABEL.match(part) for part in value.split("."))


def check_driver_name(value: str) -> str | None:
    """Return why `value` is not a valid DRA driver name, or None when it is."""
    if not value:
        return "must not be empty"
    if len(value) > MAX_DRIVER_NAME_LENGTH:
        return f"must be at most {MAX_DRIVER_NAME_LENGTH} characters"
    if not is_dns_subdomain(value.lower()):
        return "must be a DNS subdomain such as gpu.example.com"
    return None


def check_qualified_name(value: str) -> str | None:
    """Return why `value` is not a valid attribute or capacity name, or None when it is."""
    domain, sep, ident = value.rpartition("/")
    if sep and (not domain or len(domain) > MAX_DOMAIN_LENGTH or not is_dns_subdomain(domain)):
        return f"domain {domain!r} must be a DNS subdomain of at most {MAX_DOMAIN_LENGTH} characters"
    if not ident or len(ident) > MAX_ID_LENGTH or not _C_IDENTIFIER.match(ident):
        return f"{ident!r} must be a C identifier of at most {MAX_ID_LENGTH} characters"
    return None


@dataclass(frozen=True)
class Version:
    """A `version` attribute value; must already be valid semver (see `agent.core.semver`)."""

    value: str

    def __str__(self) -> str:
        return self.value


AttributeValue = bool | int | str | Version


class HealthStatus(enum.Enum):
    """Health of one device, as the kubelet's health stream knows it."""

    HEALTHY = "Healthy"
    UNHEALTHY = "Unhealthy"
    UNKNOWN = "Unknown"


class Severity(enum.IntEnum):
    """How bad a health condition is; higher is worse, so conditions sort by it."""

    INFO = 1
    WARNING = 2
    CRITICAL = 3

    @property
    def label(self) -> str:
        """Lower-case name for logs, metrics and config."""
        return self.name.lower()


@dataclass(frozen=True)
class HealthCondition:
    """One active cause of a device's health state (an XID, a lost GPU, no monitoring...)."""

    condition: str
    severity: Severity
    value: str = ""
    message: str = ""
    since: float = 0.0
    held_effect: str = ""
    """The taint effect published for this condition before an agent restart ("" when none):
    a stricter policy after the restart does not apply to it (`agent.health.taints`)."""


@dataclass(frozen=True)
class DeviceHealth:
    """The health of one device: derived from its active conditions."""

    conditions: tuple[HealthCondition, ...] = ()

    @property
    def status(self) -> HealthStatus:
        """Critical -> unhealthy; warning (e.g. unmonitored) -> unknown; info only -> healthy."""
        worst = max((c.severity for c in self.conditions), default=None)
        if worst is Severity.CRITICAL:
            return HealthStatus.UNHEALTHY
        if worst is Severity.WARNING:
            return HealthStatus.UNKNOWN
        return HealthStatus.HEALTHY

    @property
    def message(self) -> str:
        """A short human summary of the active conditions."""
        return "; ".join(
            f"{c.condition}{'=' + c.value if c.value else ''}{': ' + c.message if c.message else ''}"
            for c in sorted(self.conditions, key=lambda c: -c.severity)
        )


HEALTHY = DeviceHealth()


def _check_counters(owner: str, where: str, counters: Mapping[str, Quantity], limit: int) -> None:
    if not counters:
        raise DeviceModelError(owner, where, "must name at least one counter")
    if len(counters) > limit:
        raise DeviceModelError(owner, where, f"{len(counters)} counters, at most {limit}")
    for key, value in counters.items():
        if not is_dns_label(key):
            raise DeviceModelError(owner, f"{where}[{key}]", "counter names must be lowercase DNS labels")
        if not isinstance(value, Quantity):
            raise DeviceModelError(owner, f"{where}[{key}]", "must be an agent.core.quantity.Quantity")


@dataclass(frozen=True)
class CounterSet:
    """Shared counters of one piece of hardware (a GPU's memory and compute slices, engines).

    Published in the pool's ``sharedCounters``; devices that use part of the hardware consume
    from it (`CounterConsumption`), and the scheduler never over-commits a counter.
    """

    name: str
    counters: Mapping[str, Quantity]

    def __post_init__(self) -> None:
        object.__setattr__(self, "counters", MappingProxyType(dict(self.counters)))
        if not is_dns_label(self.name):
            raise DeviceModelError(self.name, "counterSet.name", "must be a lowercase DNS label")
        _check_counters(self.name, "counterSet.counters", self.counters, MAX_COUNTERS_PER_SET)


@dataclass(frozen=True)
class CounterConsumption:
    """What one device takes from one `CounterSet` when it is allocated."""

    counter_set: str
    counters: Mapping[str, Quantity]

    def __post_init__(self) -> None:
        object.__setattr__(self, "counters", MappingProxyType(dict(self.counters)))


@dataclass(frozen=True)
class RequestPolicy:
    """A capacity's ``requestPolicy`` (consumable capacity): a default and a range or a list of values."""

    default: Quantity
    min: Quantity | None = None
    max: Quantity | None = None
    step: Quantity | None = None
    values: tuple[Quantity, ...] = ()

    def to_api(self) -> dict[str, object]:
        """The API form: ``{default, validRange: {min, max, step}}`` or ``{default, validValues}``."""
        out: dict[str, object] = {"default": self.default.canonical()}
        if self.values:
            out["validValues"] = [v.canonical() for v in self.values]
        elif self.min is not None:
            valid_range = {"min": self.min.canonical()}
            if self.max is not None:
                valid_range["max"] = self.max.canonical()
            if self.step is not None:
                valid_range["step"] = self.step.canonical()
            out["validRange"] = valid_range
        return out


@dataclass(frozen=True)
class Device:
    """One allocatable device of one driver on this node.

    `attributes` and `capacity` use names without the driver's domain for the driver's own
    attributes (``productName``) and fully qualified names otherwise
    (``resource.kubernetes.io/pciBusID``). `uuid`, `pci_bus_id` and `product` label metrics.
    """

    name: str
    driver: str
    attributes: Mapping[str, AttributeValue] = field(default_factory=dict)
    capacity: Mapping[str, Quantity] = field(default_factory=dict)
    health: DeviceHealth = HEALTHY
    uuid: str = ""
    pci_bus_id: str = ""
    product: str = ""
    parent: str = ""
    allow_multiple_allocations: bool = False
    """Shareable by several claims at once (consumable capacity, see `agent.core.sharing`)."""
    request_policies: Mapping[str, RequestPolicy] = field(default_factory=dict)
    """``requestPolicy`` per capacity name; only with `allow_multiple_allocations`."""
    consumes_counters: tuple[CounterConsumption, ...] = ()
    """Counters this device takes when allocated (partitionable devices such as MIG placements)."""
    counter_sets: tuple[CounterSet, ...] = ()
    """Counter sets of the hardware this device stands for (the whole GPU of a partitionable GPU).

    They are published in the pool next to the devices, not as part of this device."""

    def __post_init__(self) -> None:
        # Freeze the maps so a Device is a true value.
        object.__setattr__(self, "attributes", MappingProxyType(dict(self.attributes)))
        object.__setattr__(self, "capacity", MappingProxyType(dict(self.capacity)))
        object.__setattr__(self, "request_policies", MappingProxyType(dict(self.request_policies)))
        object.__setattr__(self, "consumes_counters", tuple(self.consumes_counters))
        object.__setattr__(self, "counter_sets", tuple(self.counter_sets))
        validate_device(self)


def validate_device(device: Device) -> None:
    """Raise `DeviceModelError` if `device` breaks a ResourceSlice rule of the API server."""
    name = device.name
    if not is_dns_label(name):
        raise DeviceModelError(
            name, "name", "must be a DNS label: lower case letters, digits and '-', at most 63 characters"
        )
    problem = check_driver_name(device.driver)
    if problem:
        raise DeviceModelError(name, "driver", f"{device.driver!r} {problem}")
    total = len(device.attributes) + len(device.capacity)
    if total > MAX_ATTRIBUTES_AND_CAPACITIES:
        raise DeviceModelError(
            name, "attributes", f"{total} attributes and capacities, at most {MAX_ATTRIBUTES_AND_CAPACITIES}"
        )
    for key, value in device.attributes.items():
        where = f"attributes[{key}]"
        problem = check_qualified_name(key)
        if problem:
            raise DeviceModelError(name, where, problem)
        if isinstance(value, bool):
            continue
        if isinstance(value, int):
            if not INT64_MIN <= value <= INT64_MAX:
                raise DeviceModelError(name, where, f"{value} does not fit in int64")
        elif isinstance(value, str):
            if len(value) > MAX_STRING_LENGTH:
                raise DeviceModelError(
                    name, where, f"string of {len(value)} characters, at most {MAX_STRING_LENGTH}"
                )
        elif isinstance(value, Version):
            if len(value.value) > MAX_VERSION_LENGTH or not is_semver(value.value):
                raise DeviceModelError(
                    name,
                    where,
                    f"{value.value!r} is not semver 2.0.0 (use agent.core.semver.normalize_version)",
                )
        else:
            raise DeviceModelError(name, where, f"unsupported type {type(value).__name__}")
    for key, quantity in device.capacity.items():
        problem = check_qualified_name(key)
        if problem:
            raise DeviceModelError(name, f"capacity[{key}]", problem)
        if not isinstance(quantity, Quantity):
            raise DeviceModelError(name, f"capacity[{key}]", "must be an agent.core.quantity.Quantity")
    for key in device.request_policies:
        if key not in device.capacity:
            raise DeviceModelError(name, f"capacity[{key}].requestPolicy", "names no capacity of the device")
        if not device.allow_multiple_allocations:
            raise DeviceModelError(
                name, f"capacity[{key}].requestPolicy", "allowMultipleAllocations must be true"
            )
    _validate_counters(device)


def _validate_counters(device: Device) -> None:
    name = device.name
    if len(device.consumes_counters) > MAX_CONSUMPTIONS_PER_DEVICE:
        raise DeviceModelError(
            name,
            "consumesCounters",
            f"{len(device.consumes_counters)} entries, at most {MAX_CONSUMPTIONS_PER_DEVICE}",
        )
    seen: set[str] = set()
    for i, consumption in enumerate(device.consumes_counters):
        where = f"consumesCounters[{i}]"
        if not is_dns_label(consumption.counter_set):
            raise DeviceModelError(name, f"{where}.counterSet", "must be a lowercase DNS label")
        if consumption.counter_set in seen:
            raise DeviceModelError(name, f"{where}.counterSet", f"{consumption.counter_set!r} appears twice")
        seen.add(consumption.counter_set)
        _check_counters(name, f"{where}.counters", consumption.counters, MAX_COUNTERS_PER_CONSUMPTION)
    if len({s.name for s in device.counter_sets}) != len(device.counter_sets):
        raise DeviceModelError(name, "counterSets", "a counter set name appears twice")
