"""The interpreter: evaluates a checked syntax tree, counting cel-go's runtime cost.

The cost is counted per evaluated node plus per-character costs of string functions, which
approximates cel-go's tracker; the scheduler's limit (`COST_LIMIT`) is enforced with cel-go's message.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from agent.core.cel.ast import _Call, _Comprehension, _Ident, _ListLit, _Lit, _MapLit, _Node, _Select
from agent.core.cel.declarations import _UNSUPPORTED
from agent.core.cel.errors import COST_LIMIT, _no_overload, _RuntimeError
from agent.core.cel.library import _FUNCTIONS
from agent.core.cel.values import _DomainMap, _show, _type_name, _TypeValue


class _Cost:
    __slots__ = ("spent",)

    def __init__(self) -> None:
        self.spent = 0

    def charge(self, amount: int = 1) -> None:
        self.spent += amount
        if self.spent > COST_LIMIT:
            raise _RuntimeError("operation cancelled: actual cost limit exceeded")


def _strcost(*values: Any) -> int:
    """cel-go charges string functions 0.1 per character, rounded up."""
    return sum(math.ceil(len(v) * 0.1) for v in values if isinstance(v, str | bytes | list))


class _Interpreter:
    def __init__(self, cost: _Cost) -> None:
        self.cost = cost

    def eval(self, node: _Node, scope: Mapping[str, Any]) -> Any:
        cost = self.cost
        if isinstance(node, _Lit):
            return node.value
        cost.charge()
        if isinstance(node, _Ident):
            if node.name in scope:
                return scope[node.name]
            return _TypeValue(node.name)
        if isinstance(node, _Select):
            operand = self.eval(node.operand, scope)
            if isinstance(operand, dict):
                if node.test:
                    return node.field in operand
                if node.field in operand:
                    return operand[node.field]
                if isinstance(operand, _DomainMap):
                    return {}
                raise _RuntimeError(f"no such key: {node.field}")
            raise _no_overload()
        if isinstance(node, _ListLit):
            return [self.eval(i, scope) for i in node.items]
        if isinstance(node, _MapLit):
            out: dict[Any, Any] = {}
            for k, v in node.entries:
                key = self.eval(k, scope)
                if not isinstance(key, str | int | bool) or isinstance(key, float):
                    raise _RuntimeError(f"unsupported key type: {_type_name(key)}")
                if key in out:
                    raise _RuntimeError(f"Failed with repeated key: {_show(key)}")
                out[key] = self.eval(v, scope)
            return out
        if isinstance(node, _Comprehension):
            return self.comprehension(node, scope)
        assert isinstance(node, _Call)
        return self.call(node, scope)

    def call(self, node: _Call, scope: Mapping[str, Any]) -> Any:
        name = node.function
        if name in ("_&&_", "_||_"):
            stop = name == "_||_"  # the value that decides the result
            error: _RuntimeError | None = None
            for arg in node.args:
                try:
                    value = self.eval(arg, scope)
                except _RuntimeError as e:
                    error = error or e
                    continue
                if not isinstance(value, bool):
                    error = error or _no_overload()
                    continue
                if value is stop:
                    return stop
            if error is not None:
                raise error
            return not stop
        if name == "_?_:_":
            cond = self.eval(node.args[0], scope)
            if not isinstance(cond, bool):
                raise _no_overload()
            return self.eval(node.args[1] if cond else node.args[2], scope)
        target = self.eval(node.target, scope) if node.target is not None else None
        args = [self.eval(a, scope) for a in node.args]
        if name in _UNSUPPORTED or name.startswith("format."):
            raise _RuntimeError(
                f"function '{name}' is in the scheduler's CEL environment, but not evaluated here"
            )
        impl = _FUNCTIONS.get(name)
        if impl is None:
            raise _no_overload(name)
        values = [target, *args] if node.target is not None else args
        self.cost.charge(_strcost(*values))
        try:
            return impl(node.target is not None, *values)
        except _RuntimeError:
            raise
        except (TypeError, AttributeError, IndexError, KeyError, ValueError):
            raise _no_overload(name) from None

    def comprehension(self, node: _Comprehension, scope: Mapping[str, Any]) -> Any:
        rng = self.eval(node.range, scope)
        inner = dict(scope)
        if node.kind == "bind":
            inner[node.var] = rng
            return self.eval(node.body, inner)
        if isinstance(rng, list):
            pairs: list[tuple[Any, Any]] = list(enumerate(rng))
            one_var = [v for _, v in pairs]
        elif isinstance(rng, dict):
            pairs = list(rng.items())
            one_var = [k for k, _ in pairs]
        else:
            raise _no_overload()
        error: _RuntimeError | None = None
        hits = 0
        results: list[Any] = []
        mapped: dict[Any, Any] = {}
        for index, (key, value) in enumerate(pairs):
            self.cost.charge()
            if node.var2 is None:
                inner[node.var] = one_var[index]
            else:
                inner[node.var], inner[node.var2] = key, value
            if node.kind in ("all", "exists", "exists_one"):
                try:
                    ok = self.eval(node.body, inner)
                except _RuntimeError as e:
                    error = error or e
                    continue
                if not isinstance(ok, bool):
                    error = error or _no_overload()
                    continue
                if node.kind == "all" and not ok:
                    return False
                if node.kind == "exists" and ok:
                    return True
                hits += ok
                continue
            if node.filter is not None:
                keep = self.eval(node.filter, inner)
                if not isinstance(keep, bool):
                    raise _no_overload()
                if not keep:
                    continue
            if node.kind == "filter":
                keep = self.eval(node.body, inner)
                if not isinstance(keep, bool):
                    raise _no_overload()
                if keep:
                    results.append(inner[node.var])
            elif node.kind in ("map", "transformList"):
                results.append(self.eval(node.body, inner))
            else:  # transformMap
                mapped[key] = self.eval(node.body, inner)
        if node.kind in ("all", "exists", "exists_one"):
            if error is not None:
                raise error
            return {"all": True, "exists": False}.get(node.kind, hits == 1)
        return mapped if node.kind == "transformMap" else results
