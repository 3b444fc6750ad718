"""cel-go's type checker for the DRA environment: names, overloads and the result type."""

from __future__ import annotations

from collections.abc import Mapping

from agent.core.cel.ast import _Call, _Comprehension, _Ident, _ListLit, _Lit, _MapLit, _Node, _Select
from agent.core.cel.declarations import _DECLS, _UNSUPPORTED
from agent.core.cel.types import (
    _ATTRIBUTES,
    _CAPACITY,
    _COMPARABLE,
    _DEVICE,
    _T,
    _TYPE_IDENTS,
    _fmt,
    _is_dyn,
    _literal_type,
    _subst,
    _unify,
)


class _Checker:
    """cel-go's checker for the DRA environment: names, overloads and the result type."""

    def __init__(self) -> None:
        self.errors: list[tuple[int, str]] = []
        self.types: dict[int, _T] = {}
        """id(node) -> its type, for the validators."""

    def check(self, node: _Node, scope: Mapping[str, _T]) -> _T:
        result = self.infer(node, scope)
        self.types[id(node)] = result
        return result

    def infer(self, node: _Node, scope: Mapping[str, _T]) -> _T:
        if isinstance(node, _Lit):
            return _literal_type(node.value)
        if isinstance(node, _Ident):
            if node.name in scope:
                return scope[node.name]
            if node.name in _TYPE_IDENTS:
                return "type"
            self.errors.append((node.pos, f"undeclared reference to '{node.name}' (in container '')"))
            return "error"
        if isinstance(node, _Select):
            namespace = node.operand.name if isinstance(node.operand, _Ident) else ""
            if namespace in ("sets", "strings", "cel") and namespace not in scope:
                name = f"{namespace}.{node.field}"
                self.errors.append((node.pos, f"undeclared reference to '{name}' (in container '')"))
                return "error"
            operand = self.check(node.operand, scope)
            result = self.select(node, operand)
            return "bool" if node.test else result
        if isinstance(node, _ListLit):
            types = [self.check(i, scope) for i in node.items]
            return ("list", self.join(node, types))
        if isinstance(node, _MapLit):
            keys = [self.check(k, scope) for k, _ in node.entries]
            values = [self.check(v, scope) for _, v in node.entries]
            return ("map", self.join(node, keys), self.join(node, values))
        if isinstance(node, _Comprehension):
            return self.comprehension(node, scope)
        assert isinstance(node, _Call)
        target = self.check(node.target, scope) if node.target is not None else None
        args = [self.check(a, scope) for a in node.args]
        return self.call(node, target, args)

    def join(self, node: _Node, types: list[_T]) -> _T:
        """The element type of a literal; mixed types are dyn (the validators reject them)."""
        known = [t for t in types if not _is_dyn(t)]
        if not known:
            return "dyn"
        if "error" in known:
            return "error"
        first = known[0]
        return first if all(t == first for t in known[1:]) else "dyn"

    def select(self, node: _Select, operand: _T) -> _T:
        if _is_dyn(operand):
            return "dyn"
        if operand == _DEVICE:
            fields = {"driver": "string", "attributes": _ATTRIBUTES, "capacity": _CAPACITY}
            fields["allowMultipleAllocations"] = "bool"  # DRAConsumableCapacity: on by default in 1.36
            if node.field in fields:
                return fields[node.field]
            self.errors.append((node.pos, f"undefined field '{node.field}'"))
            return "error"
        if isinstance(operand, tuple) and operand[0] == "map":
            return operand[2]
        self.errors.append((node.pos, f"type '{_fmt(operand)}' does not support field selection"))
        return "error"

    def call(self, node: _Call, target: _T | None, args: list[_T]) -> _T:
        name = node.function
        if name in _UNSUPPORTED or (name.startswith("format.")):
            return "dyn"
        overloads = _DECLS.get(name)
        if overloads is None:
            self.errors.append((node.pos, f"undeclared reference to '{name}' (in container '')"))
            return "error"
        member = target is not None
        actual = [target, *args] if member else args
        if any(t == "error" for t in actual):
            return "error"
        if name in ("_&&_", "_||_"):
            # cel-go checks logical operands one by one (checker.go checkCall for logical ops).
            for arg_node, t in zip(node.args, args, strict=True):
                if t != "bool" and not _is_dyn(t):
                    self.errors.append((arg_node.pos, f"expected type 'bool' but found '{_fmt(t)}'"))
            return "bool"
        results = []
        for overload in overloads:
            if overload.member != member or len(overload.params) != len(actual):
                continue
            binding: dict[str, _T] = {}
            if all(_unify(p, a, binding) for p, a in zip(overload.params, actual, strict=True)):
                results.append(_subst(overload.result, binding))
        if not results:
            shown = ", ".join(_fmt(a) for a in args)
            applied = f"{_fmt(target)}.({shown})" if member else f"({shown})"
            self.errors.append((node.pos, f"found no matching overload for '{name}' applied to '{applied}'"))
            return "error"
        return results[0] if all(r == results[0] for r in results) else "dyn"

    def comprehension(self, node: _Comprehension, scope: Mapping[str, _T]) -> _T:
        rng = self.check(node.range, scope)
        inner = dict(scope)
        if node.kind == "bind":
            inner[node.var] = rng
            return self.check(node.body, inner)
        if _is_dyn(rng) and rng != "any":  # a device attribute (AnyType) is not iterable
            key, value = "dyn", "dyn"
        elif isinstance(rng, tuple) and rng[0] == "list":
            key, value = "int", rng[1]
        elif isinstance(rng, tuple) and rng[0] == "map":
            key, value = rng[1], rng[2]
        else:
            self.errors.append(
                (
                    node.range.pos,
                    f"expression of type '{_fmt(rng)}' cannot be range of a comprehension"
                    " (must be list, map, or dynamic)",
                )
            )
            return "error"
        if node.var2 is None:
            inner[node.var] = key if isinstance(rng, tuple) and rng[0] == "map" else value
        else:
            inner[node.var], inner[node.var2] = key, value
        condition = self.check(node.filter, inner) if node.filter is not None else "bool"
        body = self.check(node.body, inner)
        if node.kind in ("all", "exists") and not (_is_dyn(body) or body == "bool"):
            # The expansion's `accu && body` / `accu || body` (cel-go parser/macro.go).
            self.errors.append((node.body.pos, f"expected type 'bool' but found '{_fmt(body)}'"))
        # The expansion's conditional `test ? step : accu`, reported at the macro's call.
        test, accu = condition, _accumulator(node.kind, key, inner.get(node.var), body)
        if node.kind in ("exists_one", "filter"):
            test = body
        if not (_is_dyn(test) or test == "bool") and accu is not None:
            shown = f"{_fmt(test)}, {_fmt(accu)}, {_fmt(accu)}"
            self.errors.append((node.pos, f"found no matching overload for '_?_:_' applied to '({shown})'"))
        if node.kind in ("all", "exists", "exists_one"):
            return "bool"
        if node.kind == "filter":
            return ("list", inner[node.var])
        if node.kind in ("map", "transformList"):
            return ("list", body)
        if node.kind == "sortBy":
            if not (_is_dyn(body) or body in _COMPARABLE):
                shown = f"{_fmt(rng)}.({_fmt(('list', body))})"
                self.errors.append(
                    (node.pos, f"found no matching overload for '@sortByAssociatedKeys' applied to '{shown}'")
                )
                return "error"
            return rng if not _is_dyn(rng) else ("list", "dyn")
        if node.kind == "transformMapEntry":
            if not (_is_dyn(body) or (isinstance(body, tuple) and body[0] == "map")):
                shown = f"(map(dyn, dyn), {_fmt(body)})"
                self.errors.append(
                    (node.pos, f"found no matching overload for 'cel.@mapInsert' applied to '{shown}'")
                )
                return "error"
            return body if not _is_dyn(body) else ("map", "dyn", "dyn")
        return ("map", key, body)  # transformMap


def _accumulator(kind: str, key: _T, element: _T | None, body: _T) -> _T | None:
    """The type of a macro's accumulator, where its expansion tests a condition (else None)."""
    if kind == "exists_one":
        return "int"
    if kind == "filter":
        return ("list", element)
    if kind in ("map", "transformList"):
        return ("list", body)
    if kind == "transformMap":
        return ("map", key, body)
    if kind == "transformMapEntry":
        return body if isinstance(body, tuple) and body[0] == "map" else ("map", "dyn", "dyn")
    return None
