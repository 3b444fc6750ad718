"""The Kubernetes quantity library, and ``compareTo``/``isGreaterThan``/``isLessThan``.

The three comparisons serve both quantities and semantic versions.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from agent.core.cel.errors import _RuntimeError
from agent.core.cel.library.arguments import _i, _s, _want
from agent.core.cel.values import _INT_MAX, _INT_MIN, CelQuantity, CelSemver
from agent.core.errors import QuantityError
from agent.core.quantity import Quantity

_QUANTITY_ERROR = (
    "quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"
)


_QUANTITY_FORM = re.compile(r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$")


def _quantity(member: bool, text: Any) -> CelQuantity:
    value = _s(text)
    try:
        return CelQuantity(Quantity.parse(value))
    except QuantityError:
        form = _QUANTITY_FORM.match(value)
        if form is None:
            raise _RuntimeError(_QUANTITY_ERROR) from None
        if form.group(1).count(".") > 1 or form.group(1).strip("+-") in ("", "."):
            raise _RuntimeError("unable to parse numeric part of quantity") from None
        # resource.ParseQuantity's ErrSuffix
        raise _RuntimeError("unable to parse quantity's suffix") from None


def _is_quantity(member: bool, text: Any) -> bool:
    try:
        Quantity.parse(_s(text))
    except QuantityError:
        return False
    return True


def _q(value: Any) -> Quantity:
    _want(isinstance(value, CelQuantity))
    return value.quantity  # type: ignore[no-any-return]


def _sign(member: bool, a: Any) -> int:
    value = _q(a).value
    return (value > 0) - (value < 0)


def _as_integer(member: bool, a: Any) -> int:
    value = _q(a).value
    if value.denominator != 1 or not _INT_MIN <= value <= _INT_MAX:
        raise _RuntimeError("cannot convert value to integer")
    return value.numerator


def _as_float(member: bool, a: Any) -> float:
    return float(_q(a).value)


def _is_integer(member: bool, a: Any) -> bool:
    value = _q(a).value
    return value.denominator == 1 and _INT_MIN <= value <= _INT_MAX


def _plus_minus(sign: int) -> Callable[..., CelQuantity]:
    def op(member: bool, a: Any, b: Any) -> CelQuantity:
        q = _q(a)
        other = b.quantity.value if isinstance(b, CelQuantity) else Fraction(_i(b))
        return CelQuantity(Quantity(q.value + sign * other, q.format))

    return op


def _compare_to(member: bool, a: Any, b: Any) -> int:
    _want(type(a) is type(b) and isinstance(a, CelQuantity | CelSemver))
    return int(a.cmp(b))


def _greater(member: bool, a: Any, b: Any) -> bool:
    return _compare_to(member, a, b) > 0


def _less(member: bool, a: Any, b: Any) -> bool:
    return _compare_to(member, a, b) < 0
