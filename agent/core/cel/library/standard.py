"""Standard CEL functions: ``size``, ``contains``, ``startsWith``, ``endsWith``, ``matches``, conversions."""

from __future__ import annotations

import math
from typing import Any

from agent.core.cel.errors import _RuntimeError
from agent.core.cel.library.arguments import _s, _want
from agent.core.cel.library.gotext import _go_g
from agent.core.cel.library.operators import _check_int, _check_uint
from agent.core.cel.library.regex import _re
from agent.core.cel.values import _INT_MIN, _UINT_MAX, _type_name, _TypeValue, _UInt


def _size(member: bool, v: Any) -> int:
    if isinstance(v, str):
        return len(v)
    _want(isinstance(v, bytes | list | dict))
    return len(v)


def _contains(member: bool, s: Any, sub: Any) -> bool:
    return _s(sub) in _s(s)


def _starts(member: bool, s: Any, p: Any) -> bool:
    return _s(s).startswith(_s(p))


def _ends(member: bool, s: Any, p: Any) -> bool:
    return _s(s).endswith(_s(p))


def _matches(member: bool, s: Any, p: Any) -> bool:
    return _re(p).search(_s(s)) is not None


def _to_int(member: bool, v: Any) -> int:
    if isinstance(v, bool):
        raise TypeError
    if isinstance(v, int):
        return _check_int(int(v))
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v) or not _INT_MIN < v < 2.0**63:
            raise _RuntimeError("integer overflow")  # cel-go doubleToInt64Checked
        return int(v)
    if isinstance(v, str):
        try:
            return _check_int(int(v, 10))
        except ValueError:
            raise _RuntimeError(f'strconv.ParseInt: parsing "{v}": invalid syntax') from None
    raise TypeError


def _to_uint(member: bool, v: Any) -> _UInt:
    if isinstance(v, bool):
        raise TypeError
    if isinstance(v, int):
        if not 0 <= v <= _UINT_MAX:
            raise _RuntimeError("unsigned integer overflow")
        return _UInt(v)
    if isinstance(v, float):
        if math.isnan(v) or not 0 <= v < 2.0**64:
            raise _RuntimeError("unsigned integer overflow")  # cel-go doubleToUint64Checked
        return _UInt(int(v))
    if isinstance(v, str):
        try:
            return _check_uint(int(v, 10))
        except ValueError:
            raise _RuntimeError(f'strconv.ParseUint: parsing "{v}": invalid syntax') from None
    raise TypeError


def _to_double(member: bool, v: Any) -> float:
    if isinstance(v, bool):
        raise TypeError
    if isinstance(v, int | float):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            raise _RuntimeError(f'strconv.ParseFloat: parsing "{v}": invalid syntax') from None
    raise TypeError


def _to_string(member: bool, v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | str):
        return str(v)
    if isinstance(v, float):
        return _go_g(v)
    if isinstance(v, bytes):
        try:
            return v.decode("utf-8")
        except UnicodeDecodeError:
            raise _RuntimeError("invalid UTF-8 in bytes, cannot convert to string") from None
    raise TypeError


def _to_bytes(member: bool, v: Any) -> bytes:
    if isinstance(v, bytes):
        return v
    return _s(v).encode("utf-8")


def _to_bool(member: bool, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    text = _s(v)
    if text in ("true", "True", "TRUE", "t", "1"):
        return True
    if text in ("false", "False", "FALSE", "f", "0"):
        return False
    raise _RuntimeError("type conversion error from 'string' to 'bool'")


def _dyn(member: bool, v: Any) -> Any:
    return v


def _type(member: bool, v: Any) -> _TypeValue:
    return _TypeValue(_type_name(v))
