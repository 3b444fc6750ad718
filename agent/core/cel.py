"""Kubernetes DRA CEL device selectors, evaluated as the scheduler's allocator does (cel-python).

- ``device.driver``; ``device.attributes['<domain>'].<name>`` and
  ``device.capacity['<domain>'].<name>``. Names without a domain belong to the driver's domain.
  An unknown domain gives an empty map; an unknown name inside a domain is an evaluation error
  (as in Kubernetes, where it aborts the allocation), so ``has(...)`` guards work as usual.
- ``quantity('40Gi')`` with ``compareTo``, ``isGreaterThan``, ``isLessThan``, ``add``, ``sub``,
  ``asInteger``, ``asApproximateFloat``, ``isInteger``, ``sign``; and ``isQuantity``.
- ``semver('1.2.3')`` (Kubernetes' name) and ``version('1.2.3')`` (the name DRA guides use), with
  ``compareTo``, ``isGreaterThan``, ``isLessThan``, ``major``, ``minor``, ``patch``; ``isSemver``.
  Version attributes are such values.

API (``dra-agent explain`` and the tests use it):

- ``matches(expression, device, driver=None) -> bool``: evaluate one selector on an
  `agent.core.model.Device` or a slice device dict (``agent.kube.slices.device_to_api`` output; pass the
  slice's ``driver`` then).
- ``compile_check(expression)``: raise `CelCompileError` when the expression does not compile.
- ``referenced_values(expression, device, driver)``: the attribute and capacity values the
  expression reads, as text (``<absent>`` when the device lacks them), to show why it was false.
- ``match_attribute(name, devices) -> bool``: the ``matchAttribute`` constraint: every device
  has attribute `name` and all values are equal.
- ``CelError``: raised for compile errors (`CelCompileError`), evaluation errors and non-bool results.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any

import celpy
from celpy import celtypes
from celpy.celparser import CELParseError
from celpy.evaluation import CELEvalError

from agent.core.model import AttributeValue, Device, Version
from agent.core.quantity import Quantity
from agent.core.semver import is_semver

__all__ = [
    "CelCompileError",
    "CelError",
    "CelQuantity",
    "CelSemver",
    "compile_check",
    "match_attribute",
    "matches",
    "referenced_values",
]


class CelError(Exception):
    """The expression does not compile, fails at runtime or does not return a bool."""


class CelCompileError(CelError):
    """The expression does not compile."""


class CelQuantity:
    """A Kubernetes quantity inside CEL."""

    def __init__(self, quantity: Quantity) -> None:
        self.quantity = quantity

    def cmp(self, other: object) -> int:
        if not isinstance(other, CelQuantity):
            raise TypeError(f"cannot compare a quantity with {type(other).__name__}")
        a, b = self.quantity.value, other.quantity.value
        return (a > b) - (a < b)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CelQuantity) and self.quantity.value == other.quantity.value

    def __hash__(self) -> int:
        return hash(self.quantity.value)

    def __repr__(self) -> str:
        return f"quantity({self.quantity.canonical()!r})"


class CelSemver:
    """A semantic version inside CEL (precedence of MAJOR.MINOR.PATCH and pre-release)."""

    def __init__(self, text: str) -> None:
        if not is_semver(text):
            raise ValueError(f"{text!r} is not a semantic version")
        self.text = text
        core, _, _build = text.partition("+")
        numbers, _, pre = core.partition("-")
        major, minor, patch = (int(p) for p in numbers.split("."))
        self.parts = (major, minor, patch)
        self.pre = tuple(pre.split(".")) if pre else ()

    def _key(self) -> tuple[Any, ...]:
        # Semver precedence: a release sorts after its pre-releases; numeric identifiers sort
        # numerically and before alphanumeric ones.
        pre = tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in self.pre)
        return (*self.parts, 1 if not self.pre else 0, pre)

    def cmp(self, other: object) -> int:
        if not isinstance(other, CelSemver):
            raise TypeError(f"cannot compare a version with {type(other).__name__}")
        a, b = self._key(), other._key()
        return (a > b) - (a < b)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CelSemver) and self.cmp(other) == 0

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"semver({self.text!r})"


class _DomainMap(celtypes.MapType):
    """``device.attributes``: an unknown domain reads as an empty map, as in Kubernetes."""

    def __missing__(self, key: object) -> celtypes.MapType:
        return celtypes.MapType({})


def _quantity(text: object) -> CelQuantity:
    return CelQuantity(Quantity.parse(str(text)))


def _is_quantity(text: object) -> celtypes.BoolType:
    try:
        Quantity.parse(str(text))
    except Exception:
        return celtypes.BoolType(False)
    return celtypes.BoolType(True)


def _semver(text: object) -> CelSemver:
    return CelSemver(str(text))


def _is_semver(text: object) -> celtypes.BoolType:
    return celtypes.BoolType(is_semver(str(text)))


def _compare_to(a: object, b: object) -> celtypes.IntType:
    if isinstance(a, CelQuantity | CelSemver):
        return celtypes.IntType(a.cmp(b))
    raise TypeError(f"compareTo is not defined on {type(a).__name__}")


def _is_greater(a: object, b: object) -> celtypes.BoolType:
    return celtypes.BoolType(int(_compare_to(a, b)) > 0)


def _is_less(a: object, b: object) -> celtypes.BoolType:
    return celtypes.BoolType(int(_compare_to(a, b)) < 0)


def _q(value: object, what: str) -> Quantity:
    if not isinstance(value, CelQuantity):
        raise TypeError(f"{what} is not defined on {type(value).__name__}")
    return value.quantity


def _as_quantity(value: object) -> Quantity:
    if isinstance(value, CelQuantity):
        return value.quantity
    if isinstance(value, int):
        return Quantity(Fraction(value))
    raise TypeError(f"expected a quantity or an int, got {type(value).__name__}")


def _add(a: object, b: object) -> CelQuantity:
    q = _q(a, "add")
    return CelQuantity(Quantity(q.value + _as_quantity(b).value, q.format))


def _sub(a: object, b: object) -> CelQuantity:
    q = _q(a, "sub")
    return CelQuantity(Quantity(q.value - _as_quantity(b).value, q.format))


def _as_integer(a: object) -> celtypes.IntType:
    value = _q(a, "asInteger").value
    if value.denominator != 1:
        raise ValueError(f"quantity {value} is not an integer")
    return celtypes.IntType(value.numerator)


def _as_float(a: object) -> celtypes.DoubleType:
    return celtypes.DoubleType(float(_q(a, "asApproximateFloat").value))


def _is_integer(a: object) -> celtypes.BoolType:
    return celtypes.BoolType(_q(a, "isInteger").value.denominator == 1)


def _sign(a: object) -> celtypes.IntType:
    value = _q(a, "sign").value
    return celtypes.IntType((value > 0) - (value < 0))


def _version_part(index: int) -> Callable[[object], celtypes.IntType]:
    def part(a: object) -> celtypes.IntType:
        if not isinstance(a, CelSemver):
            raise TypeError(f"not a version: {type(a).__name__}")
        return celtypes.IntType(a.parts[index])

    return part


_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "quantity": _quantity,
    "isQuantity": _is_quantity,
    "semver": _semver,
    "version": _semver,
    "isSemver": _is_semver,
    "compareTo": _compare_to,
    "isGreaterThan": _is_greater,
    "isLessThan": _is_less,
    "add": _add,
    "sub": _sub,
    "asInteger": _as_integer,
    "asApproximateFloat": _as_float,
    "isInteger": _is_integer,
    "sign": _sign,
    "major": _version_part(0),
    "minor": _version_part(1),
    "patch": _version_part(2),
}


@functools.lru_cache(maxsize=256)
def _program(expression: str) -> Any:
    env = celpy.Environment()
    try:
        ast = env.compile(expression)
    except CELParseError as error:
        raise CelCompileError(f"cannot compile {expression!r}: {error}") from error
    return env.program(ast, functions=_FUNCTIONS)


def _cel_attribute(value: AttributeValue | Mapping[str, Any]) -> Any:
    if isinstance(value, Mapping):
        # The API shape: {"string": ...} / {"int": ...} / {"bool": ...} / {"version": ...}.
        ((kind, raw),) = value.items()
        if kind == "version":
            return CelSemver(str(raw))
        value = raw
    if isinstance(value, bool):
        return celtypes.BoolType(value)
    if isinstance(value, int):
        return celtypes.IntType(value)
    if isinstance(value, Version):
        return CelSemver(value.value)
    return celtypes.StringType(str(value))


def _cel_capacity(value: Quantity | Mapping[str, Any] | str) -> CelQuantity:
    if isinstance(value, Quantity):
        return CelQuantity(value)
    if isinstance(value, Mapping):
        return CelQuantity(Quantity.parse(str(value["value"])))
    return CelQuantity(Quantity.parse(str(value)))


def _grouped(items: Mapping[str, Any], driver: str, convert: Callable[[Any], Any]) -> _DomainMap:
    groups: dict[str, dict[Any, Any]] = {}
    for name, value in items.items():
        domain, sep, ident = name.rpartition("/")
        groups.setdefault(domain if sep else driver, {})[celtypes.StringType(ident)] = convert(value)
    return _DomainMap({celtypes.StringType(d): celtypes.MapType(m) for d, m in groups.items()})


def _device_fields(
    device: Device | Mapping[str, Any], driver: str | None
) -> tuple[str, Mapping[str, Any], Mapping[str, Any]]:
    if isinstance(device, Device):
        return device.driver, device.attributes, device.capacity
    body = device.get("basic", device)
    if not driver:
        raise CelError("a slice device dict needs the slice's driver: matches(expr, device, driver=...)")
    return driver, body.get("attributes") or {}, body.get("capacity") or {}


def _activation(device: Device | Mapping[str, Any], driver: str | None) -> dict[str, Any]:
    drv, attributes, capacity = _device_fields(device, driver)
    return {
        "device": celtypes.MapType(
            {
                celtypes.StringType("driver"): celtypes.StringType(drv),
                celtypes.StringType("attributes"): _grouped(attributes, drv, _cel_attribute),
                celtypes.StringType("capacity"): _grouped(capacity, drv, _cel_capacity),
            }
        )
    }


def matches(expression: str, device: Device | Mapping[str, Any], driver: str | None = None) -> bool:
    """Evaluate the CEL device selector `expression` on `device`.

    `device` is an `agent.core.model.Device` or a slice device dict (then `driver` is required).
    Raises `CelError` when the expression does not compile, fails at runtime (an unknown
    attribute, a type mismatch) or returns something other than a bool.
    """
    program = _program(expression)
    try:
        result = program.evaluate(_activation(device, driver))
    except CelError:
        raise
    except Exception as error:
        raise CelError(f"evaluating {expression!r}: {error}") from error
    if isinstance(result, CELEvalError):
        raise CelError(f"evaluating {expression!r}: {result}")
    if not isinstance(result, celtypes.BoolType | bool):
        raise CelError(f"{expression!r} returned {type(result).__name__}, not bool")
    return bool(result)


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
    """Raise `CelCompileError` when `expression` does not compile."""
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
        seen[f"{domain}/{ident}"] = "<absent>" if value is None else _text(value)
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
