"""CEL types as the checker sees them, and the unification of overload parameters with arguments."""

from __future__ import annotations

from typing import Any

from agent.core.cel.values import _type_name

_T = Any  # a type: "int", "string", ..., "dyn", ("list", T), ("map", K, V)

_QTY = "kubernetes.Quantity"
_SEMVER = "kubernetes.Semver"
_DEVICE = "kubernetes.DRADevice"
_ATTRIBUTES = ("map", "string", ("map", "string", "any"))
_CAPACITY = ("map", "string", ("map", "string", _QTY))
_NUMERIC = ("int", "uint", "double")
_COMPARABLE = ("int", "uint", "double", "bool", "string", "bytes")
"""What the lists libraries order (cel-go ext/lists.go comparableTypes, less duration and timestamp)."""


def _fmt(t: _T) -> str:
    if isinstance(t, tuple):
        if t[0] == "list":
            return f"list({_fmt(t[1])})"
        return f"map({_fmt(t[1])}, {_fmt(t[2])})"
    return "null" if t == "null_type" else str(t)  # cel-go's checker names the null type "null"


def _is_dyn(t: _T) -> bool:
    return t in ("dyn", "any", "error")


_TYPE_IDENTS = frozenset(
    {"int", "uint", "double", "string", "bytes", "bool", "list", "map", "null_type", "type"}
)


def _subst(t: _T, binding: dict[str, _T]) -> _T:
    if isinstance(t, tuple):
        return (t[0], *(_subst(x, binding) for x in t[1:]))
    if t in ("A", "B"):
        return binding.get(t, "dyn")
    return t


def _unify(param: _T, arg: _T, binding: dict[str, _T]) -> bool:
    if param in ("A", "B"):
        bound = binding.get(param)
        if bound is None or _is_dyn(bound):
            binding[param] = arg
            return True
        if _is_dyn(arg):
            return True
        # No numeric or null leniency: cel-go's checker rejects `1 == 1.0`, `1 == null`, `1 in [1.0]`.
        return _unify(bound, arg, binding)
    if _is_dyn(arg) or _is_dyn(param):
        return True
    if isinstance(param, tuple):
        if not isinstance(arg, tuple) or arg[0] != param[0]:
            return False
        return all(_unify(p, a, binding) for p, a in zip(param[1:], arg[1:], strict=True))
    return bool(param == arg)


def _literal_type(value: Any) -> _T:
    return _type_name(value) if value is not None else "null_type"
