"""The Kubernetes lists library: ``isSorted``, ``sum``, ``min``, ``max``, ``indexOf``, ``lastIndexOf``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agent.core.cel.errors import _RuntimeError
from agent.core.cel.library.arguments import _l, _want
from agent.core.cel.library.operators import _arith, _compare, _equal, _is_num


def _list_index_of(items: list[Any], value: Any, *, last: bool) -> int:
    indices = range(len(items) - 1, -1, -1) if last else range(len(items))
    for index in indices:
        if _equal(items[index], value):
            return index
    return -1


def _comparable(items: list[Any]) -> None:
    for x in items[1:]:
        _compare(items[0], x)


def _is_sorted(member: bool, items: Any) -> bool:
    values = _l(items)
    _comparable(values)
    return all(_compare(values[i], values[i + 1]) <= 0 for i in range(len(values) - 1))


def _sum(member: bool, items: Any) -> Any:
    values = _l(items)
    if not values:
        return 0
    total = values[0]
    for v in values[1:]:
        total = _arith("_+_", total, v)
    _want(_is_num(total))
    return total


def _min_max(largest: bool) -> Callable[..., Any]:
    def pick(member: bool, items: Any) -> Any:
        values = _l(items)
        if not values:
            raise _RuntimeError(f"{'max' if largest else 'min'}(list) argument must not be empty")
        best = values[0]
        for v in values[1:]:
            c = _compare(v, best)
            if (c > 0 and largest) or (c < 0 and not largest):
                best = v
        return best

    return pick
