"""cel-go's runtime cost of one function call, as the scheduler's tracker counts it.

cel-go interpreter/runtimecost.go (``costCall``: per-overload trackers, then the Kubernetes
estimator, then the standard library's string costs, else 1), the Kubernetes estimator
(k8s.io/apiserver/pkg/cel/library/cost.go ``CallCost``) and the trackers of cel-go's sets and
lists extensions. Identifiers, selections and index qualifiers cost 1, constants nothing, a list
literal 10 and a map literal 30 (common/cost.go); `agent.core.cel.evaluator` charges those.
"""

from __future__ import annotations

import math
from typing import Any

from agent.core.cel.values import CelQuantity, CelSemver

SELECT_COST = 1
LIST_CREATE_COST = 10
MAP_CREATE_COST = 30
_STRING_FACTOR = 0.1
_REGEX_FACTOR = 0.25

_STRING_LINEAR = frozenset({"lowerAscii", "upperAscii", "substring", "trim", "quantity", "isQuantity"})
_STRING_LINEAR |= {"semver", "isSemver", "startsWith", "endsWith", "strings.quote", "format"}
_UNIT = frozenset(
    {"sign", "asInteger", "isInteger", "asApproximateFloat", "isGreaterThan", "isLessThan", "compareTo"}
) | {"add", "sub", "major", "minor", "patch"}
_TRAVERSAL = frozenset({"isSorted", "sum", "max", "min", "indexOf", "lastIndexOf"})
_SETS = {"sets.contains": 1, "sets.intersects": 1, "sets.equivalent": 2}


def _size(value: Any) -> int:
    """cel-go's actualSize: the size of a string, bytes, list or map, else 1."""
    if isinstance(value, str | bytes | list | dict):
        return len(value)
    return 1


def _strcost(size: int | float) -> int:
    return math.ceil(size * _STRING_FACTOR)


def _traversal(value: Any) -> int:
    """The Kubernetes estimator's traversalCost (truncated, not rounded up; a string by its UTF-8
    length, as Go's len)."""
    if isinstance(value, str):
        return int(len(value.encode()) * _STRING_FACTOR)
    if isinstance(value, bytes):
        return int(len(value) * _STRING_FACTOR)
    if isinstance(value, list):
        return sum(_traversal(v) for v in value)
    if isinstance(value, dict):
        return sum(_traversal(k) + _traversal(v) for k, v in value.items())
    return 1


def _list_call(factor: float, size: int) -> int:
    """cel-go ext/lists.go trackAllocatingListCall."""
    return int(size * factor) + 1 + LIST_CREATE_COST


def _self_compare(values: list[Any]) -> int:
    factor = 2.0
    if values and isinstance(values[0], str | bytes):
        factor += _STRING_FACTOR
    return _list_call(factor, len(values) * len(values))


def _call_cost(name: str, values: list[Any], result: Any) -> int:
    """The cost of calling `name` with `values` (the target first) that returned `result`."""
    first = values[0] if values else None
    if name in _SETS and len(values) == 2:
        return 1 + int(_size(values[0]) * _size(values[1]) * _SETS[name])
    if name in ("slice", "lists.range", "reverse"):
        return _list_call(1, _size(result))
    if name == "flatten":
        return _list_call(float(values[1]) if len(values) == 2 else 1.0, _size(first))
    if name in ("distinct", "sort") and isinstance(first, list):
        return _self_compare(first)
    if name in _TRAVERSAL and values:
        return _traversal(first)
    if name in _STRING_LINEAR and values:
        return _strcost(_size(first))
    if name in ("replace", "split") and values:
        return _strcost(_size(first) * 2)
    if name == "join":
        return _strcost(_size(result) * 2)
    if name in ("find", "findAll", "matches") and len(values) >= 2:
        return _strcost(1 + _size(values[0])) * math.ceil(_size(values[1]) * _REGEX_FACTOR)
    if name in _UNIT:
        return 1
    if name in ("_==_", "_!=_"):
        if isinstance(first, CelQuantity | CelSemver):
            return 1
        return _strcost(min(_size(values[0]), _size(values[1])))
    if name in ("_<_", "_<=_", "_>_", "_>=_") and isinstance(first, str | bytes):
        return _strcost(min(_size(values[0]), _size(values[1])))
    if name == "@in" and isinstance(values[1], list):
        return _size(values[1])
    if name == "_+_" and isinstance(first, str | bytes):
        return _strcost(_size(values[0]) + _size(values[1]))
    if name == "contains" and len(values) == 2:
        return _strcost(_size(values[0])) * _strcost(_size(values[1]))
    if name in ("string", "bytes") and isinstance(first, str | bytes) and not isinstance(result, type(first)):
        return _strcost(_size(first))
    return 1
