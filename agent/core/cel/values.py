"""CEL values: the Kubernetes quantity and semver types, ``uint``, types as values, device maps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agent.core.quantity import Quantity
from agent.core.semver import is_semver


class CelQuantity:
    """A Kubernetes quantity inside CEL (``kubernetes.Quantity``)."""

    __slots__ = ("quantity",)

    def __init__(self, quantity: Quantity) -> None:
        self.quantity = quantity

    def cmp(self, other: CelQuantity) -> int:
        a, b = self.quantity.value, other.quantity.value
        return (a > b) - (a < b)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CelQuantity) and self.quantity.value == other.quantity.value

    def __hash__(self) -> int:
        return hash(self.quantity.value)

    def __repr__(self) -> str:
        return f"quantity({self.quantity.canonical()!r})"


class CelSemver:
    """A semantic version inside CEL (``kubernetes.Semver``): semver 2.0.0 precedence."""

    __slots__ = ("parts", "pre", "text")

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
        pre = tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in self.pre)
        return (*self.parts, 1 if not self.pre else 0, pre)

    def cmp(self, other: CelSemver) -> int:
        a, b = self._key(), other._key()
        return (a > b) - (a < b)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CelSemver) and self.cmp(other) == 0

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"semver({self.text!r})"


class _UInt(int):
    """A CEL ``uint``."""


@dataclass(frozen=True)
class _TypeValue:
    """A CEL type as a value (``type(1) == int``)."""

    name: str


class _DomainMap(dict[str, Any]):
    """``device.attributes`` / ``device.capacity``: an unknown domain reads as an empty map."""


_INT_MIN, _INT_MAX = -(2**63), 2**63 - 1
_UINT_MAX = 2**64 - 1


def _type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, _UInt):
        return "uint"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "double"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bytes):
        return "bytes"
    if value is None:
        return "null_type"
    if isinstance(value, list):
        return "list"
    if isinstance(value, dict):
        return "map"
    if isinstance(value, CelQuantity):
        return "kubernetes.Quantity"
    if isinstance(value, CelSemver):
        return "kubernetes.Semver"
    if isinstance(value, _TypeValue):
        return "type"
    return "unknown"


def _go_type(value: Any) -> str:
    """The Go type of a cel-go value, as its panics and iteration errors name it."""
    name = _type_name(value)
    if name in ("bool", "int", "uint", "double", "string", "bytes"):
        return f"types.{name.capitalize()}"
    return {"null_type": "types.Null", "type": "*types.Type"}.get(name, name)


def _show(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


# ------------------------------------------------------------------------------ the functions
