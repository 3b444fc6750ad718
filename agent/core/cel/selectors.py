"""Device selectors and constraints: evaluate, compile-check, what an expression reads, ``matchAttribute``."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from agent.core.cel.device import _activation, _device_fields
from agent.core.cel.errors import CelError, _cap, _RuntimeError
from agent.core.cel.evaluator import _Cost, _Interpreter
from agent.core.cel.program import _program
from agent.core.cel.values import _type_name
from agent.core.model import AttributeValue, Device
from agent.core.quantity import Quantity


def matches(expression: str, device: Device | Mapping[str, Any], driver: str | None = None) -> bool:
    """Evaluate the CEL device selector `expression` on `device`.

    `device` is an `agent.core.model.Device` or a slice device dict (then `driver` is required).
    Raises `CelError` (with the scheduler's message) when the expression does not compile, fails
    at runtime or returns something other than a bool.
    """
    program = _program(expression)
    scope = _activation(device, driver)
    try:
        result = _Interpreter(_Cost()).eval(program.ast, scope)
    except _RuntimeError as error:
        raise CelError(error.message) from None
    except RecursionError:
        raise CelError("operation cancelled: actual cost limit exceeded") from None
    if not isinstance(result, bool):
        name = _type_name(result)
        raise CelError(
            f"CEL result of type {name} could not be converted to bool: "
            f"type conversion error from '{name}' to 'bool'"
        )
    return result


def match_attribute(name: str, devices: Sequence[Device]) -> bool:
    """The ``matchAttribute`` constraint: all `devices` have attribute `name`, all equal.

    `name` is fully qualified (``resource.kubernetes.io/pcieRoot``) or in the driver's domain
    (``gpu.nvidia.com/productName``); the driver's own attributes are stored without domain.
    """
    values: list[AttributeValue] = []
    for device in devices:
        domain, _, ident = name.rpartition("/")
        value = device.attributes.get(name)
        if value is None and domain == device.driver:
            value = device.attributes.get(ident)
        if value is None:
            return False
        values.append(value)
    return all(v == values[0] for v in values)


def compile_check(expression: str) -> None:
    """Raise `CelCompileError` when the scheduler would not compile `expression`."""
    _program(expression)


_REFERENCE = re.compile(r"""device\.(attributes|capacity)\[\s*["']([^"']+)["']\s*\]\.([A-Za-z_]\w*)""")


def referenced_values(
    expression: str, device: Device | Mapping[str, Any], driver: str | None = None
) -> dict[str, str]:
    """``domain/name`` -> the value `expression` reads from `device` (``<absent>`` when missing)."""
    drv, attributes, capacity = _device_fields(device, driver)
    seen: dict[str, str] = {}
    if "device.driver" in expression:
        seen["driver"] = drv
    for kind, domain, ident in _REFERENCE.findall(expression):
        table = attributes if kind == "attributes" else capacity
        value = table.get(f"{domain}/{ident}")
        if value is None and domain == drv:
            value = table.get(ident)
        seen[f"{domain}/{ident}"] = "<absent>" if value is None else _cap(_text(value))
    return seen


def _text(value: Any) -> str:
    if isinstance(value, Mapping):
        if "value" in value:
            return str(value["value"])
        ((_, raw),) = value.items()
        return str(raw)
    if isinstance(value, Quantity):
        return value.canonical()
    return str(value)
