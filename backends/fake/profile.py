"""Fake-backend profiles: YAML files describing the drivers and devices of a pretend node.

Format (every field other than ``name`` is optional; unknown fields are refused)::

    description: 8x A100 with two GPUs in MIG mode
    drivers:
      - name: gpu.nvidia.com        # DRA driver name
        vendor: nvidia              # nvidia | amd | generic: shapes device nodes and env in prepare()
        devices:
          - name: gpu-0
            parent: gpu-0           # the physical GPU (MIG devices, partitions); lost together
            uuid: GPU-...           # metric labels
            pciBusID: "0000:07:00.0"
            product: NVIDIA A100-SXM4-80GB
            attributes:             # typed, as in a ResourceSlice
              type: {string: gpu}
              cardIndex: {int: 1}
              driverVersion: {version: 550.54.15}   # normalized with agent.core.semver
            capacity:
              memory: 80Gi

A profile is a shipped name (``nvidia-a100-8x``, ``nvidia-h100-8x``, ``amd-mi300x-8x``, ``amd-mi300x-8x-cpx``,
``mixed``) or a path to a file. Every problem raises `ProfileError` with one line naming the
file, the field path and the value.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from agent.core.boundedfile import MIB, BoundedFileError, parse_yaml, read_text
from agent.core.errors import BackendError, DeviceModelError, QuantityError, VersionError
from agent.core.model import AttributeValue, Device, Version
from agent.core.quantity import Quantity
from agent.core.semver import normalize_version

VENDORS = ("nvidia", "amd", "generic")
_TOP_FIELDS = frozenset({"description", "drivers"})
_DRIVER_FIELDS = frozenset({"name", "vendor", "devices"})
_DEVICE_FIELDS = frozenset({"name", "parent", "uuid", "pciBusID", "product", "attributes", "capacity"})
MAX_PROFILE_BYTES = 4 * MIB
"""The largest shipped profile (64 partitions) is about 54 KiB."""
_ATTRIBUTE_TYPES = ("string", "int", "bool", "version")


class ProfileError(BackendError):
    """A fake-backend profile cannot be loaded; the message names file, field path and value."""

    def __init__(self, source: str, path: str, problem: str) -> None:
        self.source = source
        self.path = path
        super().__init__(f"profile {source}: {path}: {problem}" if path else f"profile {source}: {problem}")


@dataclass(frozen=True)
class DriverProfile:
    """The devices of one DRA driver in a profile."""

    name: str
    vendor: str
    devices: tuple[Device, ...]


@dataclass(frozen=True)
class Profile:
    """A loaded profile: where it came from and its drivers."""

    source: str
    description: str
    drivers: tuple[DriverProfile, ...]


def shipped_profiles() -> list[str]:
    """Names of the profiles shipped with the package."""
    folder = resources.files("backends.fake").joinpath("profiles")
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


def load_profile(name_or_path: str) -> Profile:
    """Load a shipped profile by name, or a profile file by path."""
    if name_or_path in shipped_profiles():
        text = resources.files("backends.fake").joinpath("profiles", f"{name_or_path}.yaml").read_text()
        return parse_profile(text, name_or_path)
    path = Path(name_or_path)
    try:
        text = read_text(path, max_bytes=MAX_PROFILE_BYTES, what="YAML profile")
    except BoundedFileError as error:
        hint = (
            f"; give a shipped profile ({', '.join(shipped_profiles())}) or the path of a YAML file"
            if error.reason == "unreadable"
            else f"; expected {error.accepted}"
        )
        raise ProfileError(name_or_path, "", error.problem + hint) from None
    return parse_profile(text, str(path))


def parse_profile(text: str, source: str) -> Profile:
    """Parse and validate profile YAML; `source` names it in errors."""
    try:
        data = parse_yaml(text, source, what="YAML profile")
    except BoundedFileError as error:
        raise ProfileError(source, "", f"{error.problem}; expected {error.accepted}") from None
    top = _mapping(source, "", data, _TOP_FIELDS)
    description = top.get("description", "")
    if not isinstance(description, str):
        raise ProfileError(source, "description", f"{description!r} must be a string")
    drivers_raw = top.get("drivers")
    if not isinstance(drivers_raw, list) or not drivers_raw:
        raise ProfileError(source, "drivers", f"{drivers_raw!r} must be a non-empty list of drivers")
    drivers = tuple(_driver(source, f"drivers[{i}]", raw) for i, raw in enumerate(drivers_raw))
    names = [d.name for d in drivers]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ProfileError(source, f"drivers[{i}].name", f"{name!r} appears twice")
    return Profile(source, description, drivers)


def _mapping(source: str, path: str, raw: object, allowed: frozenset[str]) -> Mapping[str, Any]:
    if not isinstance(raw, dict):
        raise ProfileError(source, path or "top level", f"{_short(raw)} must be a mapping")
    for key in raw:
        if key not in allowed:
            raise ProfileError(
                source,
                f"{path}.{key}" if path else str(key),
                f"unknown field (allowed: {', '.join(sorted(allowed))})",
            )
    return raw


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _string(source: str, path: str, raw: object) -> str:
    if not isinstance(raw, str):
        raise ProfileError(source, path, f"{_short(raw)} must be a string")
    return raw


def _driver(source: str, path: str, raw: object) -> DriverProfile:
    data = _mapping(source, path, raw, _DRIVER_FIELDS)
    name = _string(source, f"{path}.name", data.get("name"))
    vendor = _string(source, f"{path}.vendor", data.get("vendor", "generic"))
    if vendor not in VENDORS:
        raise ProfileError(source, f"{path}.vendor", f"{vendor!r} must be one of {', '.join(VENDORS)}")
    devices_raw = data.get("devices", [])
    if not isinstance(devices_raw, list):
        raise ProfileError(source, f"{path}.devices", f"{_short(devices_raw)} must be a list")
    devices = tuple(
        _device(source, f"{path}.devices[{j}]", name, raw_dev) for j, raw_dev in enumerate(devices_raw)
    )
    seen: set[str] = set()
    for j, device in enumerate(devices):
        if device.name in seen:
            raise ProfileError(source, f"{path}.devices[{j}].name", f"{device.name!r} appears twice")
        seen.add(device.name)
    return DriverProfile(name, vendor, devices)


def _attribute(source: str, path: str, raw: object) -> AttributeValue:
    if not isinstance(raw, dict) or len(raw) != 1:
        raise ProfileError(
            source, path, f"{_short(raw)} must be one typed value: {{string|int|bool|version: VALUE}}"
        )
    kind, value = next(iter(raw.items()))
    where = f"{path}.{kind}"
    if kind == "string":
        return _string(source, where, value)
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProfileError(source, where, f"{_short(value)} must be an integer")
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise ProfileError(source, where, f"{_short(value)} must be true or false")
        return value
    if kind == "version":
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise ProfileError(source, where, f"{_short(value)} must be a version string")
        try:
            return Version(normalize_version(str(value)))
        except VersionError as error:
            raise ProfileError(source, path, f"{str(value)!r} is not a version: {error}") from None
    choices = ", ".join(_ATTRIBUTE_TYPES)
    raise ProfileError(source, path, f"unknown attribute type {kind!r} (use one of {choices})")


def _device(source: str, path: str, driver: str, raw: object) -> Device:
    data = _mapping(source, path, raw, _DEVICE_FIELDS)
    name = _string(source, f"{path}.name", data.get("name"))
    texts = {
        key: _string(source, f"{path}.{key}", data.get(key, ""))
        for key in ("parent", "uuid", "pciBusID", "product")
    }
    attrs_raw = data.get("attributes", {})
    if not isinstance(attrs_raw, dict):
        raise ProfileError(source, f"{path}.attributes", f"{_short(attrs_raw)} must be a mapping")
    attributes = {
        str(key): _attribute(source, f"{path}.attributes.{key}", value) for key, value in attrs_raw.items()
    }
    caps_raw = data.get("capacity", {})
    if not isinstance(caps_raw, dict):
        raise ProfileError(source, f"{path}.capacity", f"{_short(caps_raw)} must be a mapping")
    capacity: dict[str, Quantity] = {}
    for key, value in caps_raw.items():
        if isinstance(value, bool) or not isinstance(value, str | int):
            raise ProfileError(source, f"{path}.capacity.{key}", f"{_short(value)} must be a quantity")
        try:
            capacity[str(key)] = Quantity.parse(value)
        except QuantityError as error:
            raise ProfileError(source, f"{path}.capacity.{key}", str(error)) from None
    try:
        return Device(
            name=name,
            driver=driver,
            attributes=attributes,
            capacity=capacity,
            uuid=texts["uuid"],
            pci_bus_id=texts["pciBusID"],
            product=texts["product"],
            parent=texts["parent"],
        )
    except DeviceModelError as error:
        raise ProfileError(source, f"{path} ({name})", f"{error.field}: {error.problem}") from None
