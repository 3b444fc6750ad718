"""The ``device`` variable: an `agent.core.model.Device` or a slice device dict as CEL values."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from agent.core.cel.errors import CelError
from agent.core.cel.values import CelQuantity, CelSemver, _DomainMap
from agent.core.errors import QuantityError
from agent.core.model import AttributeValue, Device, Version
from agent.core.quantity import Quantity


def _cel_attribute(value: AttributeValue | Mapping[str, Any]) -> Any:
    if isinstance(value, Mapping):
        # The API shape: {"string": ...} / {"int": ...} / {"bool": ...} / {"version": ...}.
        ((kind, raw),) = value.items()
        if kind == "version":
            return CelSemver(str(raw))
        if kind == "int":
            return int(raw)
        if kind == "bool":
            return bool(raw)
        value = raw
    if isinstance(value, bool | int):
        return value
    if isinstance(value, Version):
        return CelSemver(value.value)
    return str(value)


def _cel_capacity(value: Quantity | Mapping[str, Any] | str) -> CelQuantity:
    if isinstance(value, Quantity):
        return CelQuantity(value)
    if isinstance(value, Mapping):
        return CelQuantity(Quantity.parse(str(value["value"])))
    return CelQuantity(Quantity.parse(str(value)))


def _grouped(items: Mapping[str, Any], driver: str, convert: Callable[[Any], Any]) -> _DomainMap:
    groups = _DomainMap()
    for name, value in items.items():
        domain, sep, ident = str(name).partition("/")
        if not sep:
            domain, ident = driver, str(name)
        groups.setdefault(domain, {})[ident] = convert(value)
    return groups


def _device_fields(
    device: Device | Mapping[str, Any], driver: str | None
) -> tuple[str, Mapping[str, Any], Mapping[str, Any]]:
    if isinstance(device, Device):
        return device.driver, device.attributes, device.capacity
    body = device.get("basic", device)
    if not driver:
        raise CelError("a slice device dict needs the slice's driver: matches(expr, device, driver=...)")
    return driver, body.get("attributes") or {}, body.get("capacity") or {}


def _multiple(device: Device | Mapping[str, Any]) -> bool:
    """``device.allowMultipleAllocations`` (DRAConsumableCapacity, beta and on by default in 1.36)."""
    if isinstance(device, Device):
        return device.allow_multiple_allocations
    return bool(device.get("basic", device).get("allowMultipleAllocations", False))


def _activation(device: Device | Mapping[str, Any], driver: str | None) -> dict[str, Any]:
    drv, attributes, capacity = _device_fields(device, driver)
    try:
        attrs = _grouped(attributes, drv, _cel_attribute)
        caps = _grouped(capacity, drv, _cel_capacity)
    except (ValueError, QuantityError, TypeError, KeyError) as error:
        raise CelError(f"device {drv}: an attribute or capacity is not valid: {error}") from None
    fields = {
        "driver": drv,
        "allowMultipleAllocations": _multiple(device),
        "attributes": attrs,
        "capacity": caps,
    }
    return {"device": fields}
