"""The functions of the scheduler's CEL environment, one module per library; `_FUNCTIONS` maps names to them.

Each function takes ``(member, *values)``; a TypeError, AttributeError, IndexError, KeyError or
ValueError it raises is reported as ``no such overload``, a `_RuntimeError` with its own message.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agent.core.cel.library.format import _format
from agent.core.cel.library.lists import _is_sorted, _min_max, _sum
from agent.core.cel.library.listsext import _distinct, _flatten, _range, _reverse, _slice, _sort
from agent.core.cel.library.operators import _binary, _neg, _not
from agent.core.cel.library.quantity import (
    _as_float,
    _as_integer,
    _compare_to,
    _greater,
    _is_integer,
    _is_quantity,
    _less,
    _plus_minus,
    _quantity,
    _sign,
)
from agent.core.cel.library.regex import _find, _find_all
from agent.core.cel.library.semver import _is_semver, _part, _semver
from agent.core.cel.library.sets import _sets_contains, _sets_equivalent, _sets_intersects
from agent.core.cel.library.standard import (
    _contains,
    _dyn,
    _ends,
    _matches,
    _size,
    _starts,
    _to_bool,
    _to_bytes,
    _to_double,
    _to_int,
    _to_string,
    _to_uint,
    _type,
)
from agent.core.cel.library.strings import (
    _char_at,
    _index_of,
    _join,
    _last_index_of,
    _lower,
    _quote,
    _replace,
    _split,
    _substring,
    _trim,
    _upper,
)

_FUNCTIONS: dict[str, Callable[..., Any]] = {
    **{op: _binary(op) for op in ("_==_", "_!=_", "@in", "_[_]", "_<_", "_<=_", "_>_", "_>=_")},
    **{op: _binary(op) for op in ("_+_", "_-_", "_*_", "_/_", "_%_")},
    "!_": _not,
    "-_": _neg,
    "size": _size,
    "contains": _contains,
    "startsWith": _starts,
    "endsWith": _ends,
    "matches": _matches,
    "int": _to_int,
    "uint": _to_uint,
    "double": _to_double,
    "string": _to_string,
    "bytes": _to_bytes,
    "bool": _to_bool,
    "dyn": _dyn,
    "type": _type,
    "charAt": _char_at,
    "indexOf": _index_of,
    "lastIndexOf": _last_index_of,
    "lowerAscii": _lower,
    "upperAscii": _upper,
    "replace": _replace,
    "split": _split,
    "substring": _substring,
    "trim": _trim,
    "join": _join,
    "format": _format,
    "strings.quote": _quote,
    "sets.contains": _sets_contains,
    "sets.equivalent": _sets_equivalent,
    "sets.intersects": _sets_intersects,
    "slice": _slice,
    "flatten": _flatten,
    "sort": _sort,
    "reverse": _reverse,
    "distinct": _distinct,
    "lists.range": _range,
    "isSorted": _is_sorted,
    "sum": _sum,
    "min": _min_max(largest=False),
    "max": _min_max(largest=True),
    "find": _find,
    "findAll": _find_all,
    "quantity": _quantity,
    "isQuantity": _is_quantity,
    "sign": _sign,
    "asInteger": _as_integer,
    "asApproximateFloat": _as_float,
    "isInteger": _is_integer,
    "add": _plus_minus(1),
    "sub": _plus_minus(-1),
    "compareTo": _compare_to,
    "isGreaterThan": _greater,
    "isLessThan": _less,
    "semver": _semver,
    "isSemver": _is_semver,
    "major": _part(0),
    "minor": _part(1),
    "patch": _part(2),
}


# --------------------------------------------------------------------------------- the device
