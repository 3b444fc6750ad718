"""cel-go's lists extension, version 3 (ext/lists.go), in the Kubernetes base environment since 1.34.

``slice``, ``flatten``, ``sort``, ``reverse``, ``distinct``, ``lists.range``; ``sortBy`` is a macro
whose keys are sorted here (`_sort_by_keys`, cel-go's ``@sortByAssociatedKeys``).
"""

from __future__ import annotations

import functools
from typing import Any

from agent.core.cel.errors import MAX_LIST, _RuntimeError
from agent.core.cel.library.arguments import _i, _l
from agent.core.cel.library.operators import _compare, _equal
from agent.core.cel.values import _go_type, _type_name


def _slice(member: bool, items: Any, start: Any, end: Any) -> list[Any]:
    values, begin, stop = _l(items), _i(start), _i(end)
    if begin < 0 or stop < 0:
        raise _RuntimeError(f"cannot slice({begin}, {stop}), negative indexes not supported")
    if begin > stop:
        raise _RuntimeError(
            f"cannot slice({begin}, {stop}), start index must be less than or equal to end index"
        )
    if len(values) < stop:
        raise _RuntimeError(f"cannot slice({begin}, {stop}), list is length {len(values)}")
    return values[begin:stop]


def _flatten(member: bool, items: Any, *depth: Any) -> list[Any]:
    if not isinstance(items, list):  # cel-go ext/lists.go names the receiver's type
        shown = {"list": "list(dyn)", "map": "map(dyn, dyn)"}.get(_type_name(items), _type_name(items))
        args = _type_name(depth[0]) if depth else ""
        raise _RuntimeError(f"no such overload: {shown}.flatten({args})")
    if depth and _type_name(depth[0]) != "int":  # cel-go v0.26 panics on the type assertion
        raise _RuntimeError(
            f"internal error: interface conversion: ref.Val is {_go_type(depth[0])}, not types.Int"
        )
    level = _i(depth[0]) if depth else 1
    if level < 0:
        raise _RuntimeError("level must be non-negative")
    return _flattened(_l(items), level)


def _flattened(values: list[Any], level: int) -> list[Any]:
    out: list[Any] = []
    for value in values:
        if isinstance(value, list) and level > 0:
            out.extend(_flattened(value, level - 1))
        else:
            out.append(value)
    return out


def _range(member: bool, n: Any) -> list[int]:
    count = _i(n)
    if count > MAX_LIST:
        raise _RuntimeError("operation cancelled: actual cost limit exceeded")
    return list(range(max(count, 0)))


def _reverse(member: bool, items: Any) -> list[Any]:
    return _l(items)[::-1]


def _distinct(member: bool, items: Any) -> list[Any]:
    unique: list[Any] = []
    for value in _l(items):
        if not any(_equal(value, seen) for seen in unique):
            unique.append(value)
    return unique


def _sort(member: bool, items: Any) -> list[Any]:
    values = _l(items)
    return _sort_by_keys(values, values)


def _sort_by_keys(values: list[Any], keys: list[Any]) -> list[Any]:
    """cel-go's sortListByAssociatedKeys: a stable sort of `values` by `keys`, keys of one type."""
    if len(values) != len(keys):
        raise _RuntimeError(
            "@sortByAssociatedKeys() expected a list of the same size as the associated keys list, "
            f"but got {len(values)} and {len(keys)} elements respectively"
        )
    if not values:
        return values
    kind = _type_name(keys[0])
    if kind not in ("int", "uint", "double", "bool", "string", "bytes"):
        raise _RuntimeError("list elements must be comparable")
    if any(_type_name(k) != kind for k in keys):
        raise _RuntimeError("list elements must have the same type")

    def order(a: int, b: int) -> int:
        return _compare(keys[a], keys[b])

    indices = sorted(range(len(values)), key=functools.cmp_to_key(order))
    return [values[i] for i in indices]
