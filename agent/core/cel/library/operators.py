"""Standard CEL operators: equality, ordering, arithmetic with cel-go's overflow checks, ``!`` and ``-``."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from agent.core.cel.errors import _no_overload, _RuntimeError
from agent.core.cel.library.arguments import _want
from agent.core.cel.values import _INT_MAX, _INT_MIN, _UINT_MAX, _DomainMap, _show, _type_name, _UInt


def _check_int(value: int) -> int:
    if not _INT_MIN <= value <= _INT_MAX:
        raise _RuntimeError("integer overflow")
    return value


def _check_uint(value: int) -> _UInt:
    if not 0 <= value <= _UINT_MAX:
        raise _RuntimeError("unsigned integer overflow")
    return _UInt(value)


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _equal(a: Any, b: Any) -> bool:
    if _is_num(a) and _is_num(b):
        if (isinstance(a, float) and math.isnan(a)) or (isinstance(b, float) and math.isnan(b)):
            return False
        if isinstance(a, float) or isinstance(b, float):
            return float(a) == float(b)  # cel-go compares an integer with a double as a double
        return int(a) == int(b)
    if _type_name(a) != _type_name(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return len(a) == len(b) and all(
            any(_equal(k, k2) and _equal(v, b[k2]) for k2 in b) for k, v in a.items()
        )
    return bool(a == b)


def _compare(a: Any, b: Any, name: str = "") -> int:
    if _is_num(a) and _is_num(b):
        if (isinstance(a, float) and math.isnan(a)) or (isinstance(b, float) and math.isnan(b)):
            raise _RuntimeError("NaN values cannot be ordered")
        if isinstance(a, float) or isinstance(b, float):
            fa, fb = float(a), float(b)  # cel-go: an integer against a double, as a double
            return (fa > fb) - (fa < fb)
        return (int(a) > int(b)) - (int(a) < int(b))
    if type(a) is type(b) and isinstance(a, str | bytes | bool):
        return int((a > b) - (a < b))
    # cel-go: a left operand without the Comparer trait (null, list, map, type) names the operator.
    raise _no_overload("" if _is_num(a) or isinstance(a, str | bytes | bool) else name)


def _arith(op: str, a: Any, b: Any) -> Any:
    if op == "_+_":
        if isinstance(a, str) and isinstance(b, str):
            return a + b
        if isinstance(a, bytes) and isinstance(b, bytes):
            return a + b
        if isinstance(a, list) and isinstance(b, list):
            return a + b
    if _is_num(a) and _is_num(b) and _type_name(a) == _type_name(b):
        if isinstance(a, float):
            if op == "_+_":
                return a + b
            if op == "_-_":
                return a - b
            if op == "_*_":
                return a * b
            if op == "_/_":
                if b == 0:
                    return math.copysign(math.inf, a) * math.copysign(1, b) if a else math.nan
                return a / b
            raise _no_overload()
        check = _check_uint if isinstance(a, _UInt) else _check_int
        if op == "_+_":
            return check(a + b)
        if op == "_-_":
            return check(a - b)
        if op == "_*_":
            return check(a * b)
        if op in ("_/_", "_%_"):
            if b == 0:
                raise _RuntimeError("division by zero" if op == "_/_" else "modulus by zero")
            if op == "_/_" and a == _INT_MIN and b == -1:
                raise _RuntimeError("integer overflow")
            quotient = abs(a) // abs(b) * (1 if (a >= 0) == (b >= 0) else -1)  # truncation, as Go
            return check(quotient) if op == "_/_" else check(a - b * quotient)
    raise _no_overload()


def _binary(name: str) -> Callable[..., Any]:
    def op(member: bool, a: Any, b: Any) -> Any:
        if name == "_==_":
            return _equal(a, b)
        if name == "_!=_":
            return not _equal(a, b)
        if name == "@in":
            if isinstance(b, list):
                return any(_equal(a, x) for x in b)
            if isinstance(b, dict):
                return any(_equal(a, k) for k in b)
            raise TypeError
        if name == "_[_]":
            if isinstance(a, list):  # cel-go: an index qualifies an attribute (interpreter/attributes.go)
                if not _is_num(b):
                    raise _RuntimeError(f"unsupported index type '{_type_name(b)}' in list")
                if not float(b).is_integer() or not _INT_MIN <= b <= _INT_MAX:
                    raise _RuntimeError(f"unsupported index value {_show(b)} in list")
                index = int(b)
                if not 0 <= index < len(a):
                    raise _RuntimeError(f"index out of bounds: {_show(b)}")
                return a[index]
            if isinstance(a, dict):
                for key in a:
                    if _equal(key, b):
                        return a[key]
                if isinstance(a, _DomainMap):
                    return {}
                raise _RuntimeError(f"no such key: {_show(b)}")
            raise TypeError
        if name in ("_<_", "_<=_", "_>_", "_>=_"):
            c = _compare(a, b, name)
            return {"_<_": c < 0, "_<=_": c <= 0, "_>_": c > 0, "_>=_": c >= 0}[name]
        return _arith(name, a, b)

    return op


def _not(member: bool, v: Any) -> bool:
    _want(isinstance(v, bool))
    return not v


def _neg(member: bool, v: Any) -> Any:
    _want(_is_num(v) and not isinstance(v, _UInt))
    return -v if isinstance(v, float) else _check_int(-v)
