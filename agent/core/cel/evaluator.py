"""The interpreter: evaluates a checked syntax tree, counting the runtime cost as cel-go does.

cel-go plans each macro as a fold over its range (parser/macro.go, ext/comprehensions.go) and its
tracker (interpreter/runtimecost.go) charges the fold's own steps: the accumulator's identifier,
``@not_strictly_false``, the ``[x]`` list built per element, the ``_+_`` that appends it. Those
are charged here per iteration (`_FOLD_STEP`), so ``xs.map(x, f(x))`` costs what it does in the
scheduler. Constant list and map literals, ``in`` over a constant list and conversions of a
constant are folded when cel-go plans the program (``OptOptimize``) and cost nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agent.core.cel.ast import _Call, _Comprehension, _Ident, _ListLit, _Lit, _MapLit, _Node, _Select
from agent.core.cel.cost import LIST_CREATE_COST, MAP_CREATE_COST, SELECT_COST, _call_cost, _self_compare
from agent.core.cel.declarations import _UNSUPPORTED
from agent.core.cel.errors import COST_LIMIT, _no_overload, _RuntimeError
from agent.core.cel.library import _FUNCTIONS
from agent.core.cel.library.listsext import _sort_by_keys
from agent.core.cel.types import _TYPE_IDENTS
from agent.core.cel.validators import _constant
from agent.core.cel.values import _DomainMap, _go_type, _type_name, _TypeValue

# Per element: (before the body, after a true/kept body, after a false/dropped body).
_FOLD_STEP = {
    "all": (2 + 1, 0, 0),  # @not_strictly_false(accu), then accu && body
    "exists": (3 + 1, 0, 0),  # @not_strictly_false(!accu), then accu || body
    "exists_one": (0, 2, 0),  # body ? accu + 1 : accu (a branch's accu is not seen)
    "filter": (0, 13, 0),  # body ? accu + [x] : accu
}


# The accumulators that start as an empty list or map literal (the quantifiers' are constants).
_ACCUMULATOR_INIT = {"map": LIST_CREATE_COST, "filter": LIST_CREATE_COST, "transformList": LIST_CREATE_COST}
_ACCUMULATOR_INIT |= {"transformMap": MAP_CREATE_COST, "transformMapEntry": MAP_CREATE_COST}


class _Cost:
    __slots__ = ("limit", "spent")

    def __init__(self, limit: int = COST_LIMIT) -> None:
        self.spent = 0
        self.limit = limit

    def charge(self, amount: int = 1) -> None:
        self.spent += amount
        if self.spent > self.limit:
            raise _RuntimeError("operation cancelled: actual cost limit exceeded")


def _attribute(node: _Node) -> bool:
    """Whether cel-go plans `node` as an attribute (interpreter/attributes.go): a variable, a
    selection or index of one, a conditional. An attribute used as an index is resolved as a
    qualifier without a cost of its own."""
    if isinstance(node, _Ident):
        return node.name not in _TYPE_IDENTS
    if isinstance(node, _Select):
        return not node.test
    return isinstance(node, _Call) and node.function in ("_[_]", "_?_:_")


def _relative(operand: _Node) -> bool:
    """Whether a selection or index of `operand` starts a relative attribute, which costs one more
    than its qualifiers (cel-go's evalAttr is observed): any operand but a variable, a conditional
    or another selection or index (the chain's first link pays)."""
    if isinstance(operand, _Ident) or (isinstance(operand, _Select) and not operand.test):
        return False
    return not (isinstance(operand, _Call) and operand.function in ("_[_]", "_?_:_"))


def _constant_set(node: _Node) -> bool:
    """``x in [..]`` over constants of primitive types is planned as a set lookup."""
    return isinstance(node, _ListLit) and all(
        isinstance(i, _Lit) and not isinstance(i.value, bytes) for i in node.items
    )


class _Interpreter:
    def __init__(self, cost: _Cost, *, optimize: bool = True) -> None:
        self.cost = cost
        self.optimize = optimize
        """cel-go's ``OptOptimize`` (the scheduler sets it): constants folded when planning."""

    def constant(self, node: _Node) -> bool:
        return self.optimize and _constant(node)

    def eval(self, node: _Node, scope: Mapping[str, Any]) -> Any:
        if isinstance(node, _Lit):
            return node.value
        if isinstance(node, _Ident):
            if node.name in scope:
                self.cost.charge(SELECT_COST)
                return scope[node.name]
            return _TypeValue(node.name)  # a type name: a constant
        if isinstance(node, _Call) and self.constant(node):
            return self.folded(node, scope)
        if isinstance(node, _Select):
            return self.select(node, scope)
        if isinstance(node, _ListLit):
            items = [self.eval(i, scope) for i in node.items]
            if not self.constant(node):
                self.cost.charge(LIST_CREATE_COST)
            return items
        if isinstance(node, _MapLit):
            return self.map_literal(node, scope)
        if isinstance(node, _Comprehension):
            return self.comprehension(node, scope)
        assert isinstance(node, _Call)
        return self.call(node, scope)

    def folded(self, node: _Call, scope: Mapping[str, Any]) -> Any:
        """A constant folded when the program is planned: evaluated without a cost."""
        spending, self.cost = self.cost, _Cost()
        try:
            return self.call(node, scope)
        finally:
            self.cost = spending

    def branch(self, node: _Node, scope: Mapping[str, Any]) -> Any:
        """A conditional's branch: cel-go plans it as an attribute of the conditional, so a
        branch's root identifier is read without the tracker seeing it (its selections are)."""
        if isinstance(node, _Ident) and node.name in scope:
            return scope[node.name]
        if isinstance(node, _Select):
            return self.select(node, scope, root=True)
        return self.eval(node, scope)

    def select(self, node: _Select, scope: Mapping[str, Any], *, root: bool = False) -> Any:
        operand = self.branch(node.operand, scope) if root else self.eval(node.operand, scope)
        if not node.test:  # presence tests are free in the Kubernetes environment
            self.cost.charge(SELECT_COST)
        if _relative(node.operand):
            self.cost.charge(SELECT_COST)
        if isinstance(operand, dict):
            if node.test:
                return node.field in operand
            if node.field in operand:
                return operand[node.field]
            if isinstance(operand, _DomainMap):
                return {}
            raise _RuntimeError(f"no such key: {node.field}")
        raise _no_overload()

    def map_literal(self, node: _MapLit, scope: Mapping[str, Any]) -> dict[Any, Any]:
        out: dict[Any, Any] = {}
        for k, v in node.entries:
            key = self.eval(k, scope)
            if not isinstance(key, str | int | bool):
                raise _RuntimeError(f"unsupported key type: {_type_name(key)}")
            out[key] = self.eval(v, scope)  # cel-go keeps the last of repeated keys
        if not self.constant(node):
            self.cost.charge(MAP_CREATE_COST)
        return out

    def call(self, node: _Call, scope: Mapping[str, Any]) -> Any:
        name = node.function
        if name in ("_&&_", "_||_"):
            return self.logical(node, scope, stop=name == "_||_")
        if name == "_?_:_":
            cond = self.eval(node.args[0], scope)
            if not isinstance(cond, bool):
                raise _no_overload()
            return self.branch(node.args[1] if cond else node.args[2], scope)
        # cel-go passes an error on as a value: the call that receives it, or fails, is still
        # charged (what a `||`, `&&` or comprehension that absorbs the error adds up).
        index = (not _attribute(node.args[1])) + _relative(node.args[0]) if name == "_[_]" else 0
        try:
            target = self.eval(node.target, scope) if node.target is not None else None
            args = [self.eval(a, scope) for a in node.args]
        except _RuntimeError as error:
            if not error.message.startswith("operation cancelled"):
                self.cost.charge(index if name == "_[_]" else 1)
            raise
        if name in _UNSUPPORTED or name.startswith("format."):
            raise _RuntimeError(
                f"function '{name}' is in the scheduler's CEL environment, but not evaluated here"
            )
        impl = _FUNCTIONS.get(name)
        values = [target, *args] if node.target is not None else args
        if name == "_[_]":  # an index is a qualifier of an attribute, charged before the lookup
            self.cost.charge(index)
        try:
            if impl is None:
                raise _dispatch_error(name, values)
            try:
                result = impl(node.target is not None, *values)
            except (TypeError, AttributeError, IndexError, KeyError, ValueError):
                raise _dispatch_error(name, values) from None
        except _RuntimeError:
            if name != "_[_]":
                self.cost.charge(1)
            raise
        if name == "@in" and self.optimize and _constant_set(node.args[1]):
            pass  # a set lookup, not a call
        elif name != "_[_]":
            self.cost.charge(_call_cost(name, values, result))
        return result

    def logical(self, node: _Call, scope: Mapping[str, Any], *, stop: bool) -> bool:
        """``&&``/``||``: an error or a non-bool is absorbed when the other side decides."""
        error: _RuntimeError | None = None
        for arg in node.args:
            try:
                value = self.eval(arg, scope)
            except _RuntimeError as e:
                if e.message.startswith("operation cancelled"):
                    raise
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

    def comprehension(self, node: _Comprehension, scope: Mapping[str, Any]) -> Any:
        rng = self.eval(node.range, scope)
        inner = dict(scope)
        if node.kind == "bind":
            if not self.optimize:  # the fold's range, an empty list literal
                self.cost.charge(LIST_CREATE_COST)
            inner[node.var] = rng
            return self.eval(node.body, inner)
        if node.kind == "sortBy":
            return self.sort_by(node, rng, inner)
        if isinstance(rng, list):
            pairs: list[tuple[Any, Any]] = list(enumerate(rng))
        elif isinstance(rng, dict):
            pairs = [(k, k if node.var2 is None else v) for k, v in rng.items()]
        else:
            raise _RuntimeError(f"got '{_go_type(rng)}', expected iterable type")
        if not self.optimize:  # the accumulator's empty literal is built, not folded
            self.cost.charge(_ACCUMULATOR_INIT.get(node.kind, 0))
        fold = _Fold(self, node, inner)
        for key, value in pairs:
            if node.var2 is None:
                inner[node.var] = value
            else:
                inner[node.var], inner[node.var2] = key, value
            if fold.step(key):
                break
        self.cost.charge(SELECT_COST)  # the result: the accumulator
        return fold.result()

    def sort_by(self, node: _Comprehension, rng: Any, inner: dict[str, Any]) -> list[Any]:
        if not isinstance(rng, list):
            raise _no_overload("sortBy")
        self.cost.charge(3 * SELECT_COST)  # the bound input twice, the mapped keys
        if not self.optimize:  # the bind's empty range and the keys' accumulator, built
            self.cost.charge(2 * LIST_CREATE_COST)
        keys = []
        for value in rng:
            inner[node.var] = value
            self.cost.charge(_MAP_STEP)
            keys.append(self.eval(node.body, inner))
        self.cost.charge(_self_compare(keys))
        return _sort_by_keys(rng, keys)


_MAP_STEP = 1 + LIST_CREATE_COST + 1  # accu + [f(x)]: the accumulator, the list, the append


class _Fold:
    """One comprehension's accumulator, stepped once per element, with cel-go's per-step cost."""

    def __init__(self, interpreter: _Interpreter, node: _Comprehension, scope: dict[str, Any]) -> None:
        self.interpreter = interpreter
        self.node = node
        self.scope = scope
        self.error: _RuntimeError | None = None
        self.hits = 0
        self.stopped = False
        self.results: list[Any] = []
        self.mapped: dict[Any, Any] = {}

    def step(self, key: Any) -> bool:
        """Evaluate the body for the current element; True when the fold stops."""
        node, cost = self.node, self.interpreter.cost
        kind = node.kind
        if self.stopped:  # cel-go evaluates the loop condition once more, then leaves
            cost.charge(_FOLD_STEP[kind][0] - 1)
            return True
        if kind in ("all", "exists", "exists_one"):
            return self.quantify(kind)
        if node.filter is not None:
            keep = self.interpreter.eval(node.filter, self.scope)
            if not isinstance(keep, bool):
                raise _no_overload()
            if not keep:  # filter ? ... : accu: the accumulator branch is not seen
                return False
        if kind == "filter":
            ok = self.interpreter.eval(node.body, self.scope)
            if not isinstance(ok, bool):
                raise _no_overload()
            cost.charge(_FOLD_STEP[kind][1] if ok else _FOLD_STEP[kind][2])
            if ok:
                self.results.append(self.scope[node.var])
        elif kind in ("map", "transformList"):
            cost.charge(_MAP_STEP)
            self.results.append(self.interpreter.eval(node.body, self.scope))
        elif kind == "transformMap":
            cost.charge(3 * SELECT_COST)  # @mapInsert(accu, key, f): accu, key, the call
            self.insert(key, self.interpreter.eval(node.body, self.scope))
        else:  # transformMapEntry
            cost.charge(2 * SELECT_COST)  # @mapInsert(accu, entry): accu, the call
            entry = self.interpreter.eval(node.body, self.scope)
            if not isinstance(entry, dict):
                raise _no_overload("cel.@mapInsert")
            for k, v in entry.items():
                self.insert(k, v)
        return False

    def insert(self, key: Any, value: Any) -> None:
        if key in self.mapped:
            raise _RuntimeError(f"insert failed: key {_key_text(key)} already exists")
        self.mapped[key] = value

    def quantify(self, kind: str) -> bool:
        before, true_cost, false_cost = _FOLD_STEP[kind]
        cost = self.interpreter.cost
        cost.charge(before)
        try:
            ok = self.interpreter.eval(self.node.body, self.scope)
        except _RuntimeError as e:
            if e.message.startswith("operation cancelled") or kind == "exists_one":
                raise
            self.error = self.error or e
            return False
        if not isinstance(ok, bool):
            if kind == "exists_one":
                raise _no_overload()
            self.error = self.error or _no_overload()
            return False
        cost.charge(true_cost if ok else false_cost)
        self.hits += ok
        if (kind == "all" and not ok) or (kind == "exists" and ok):
            self.stopped = True
        return False

    def result(self) -> Any:
        kind = self.node.kind
        if kind == "all":
            if self.stopped:
                return False
        elif kind == "exists":
            if self.stopped:
                return True
        elif kind == "exists_one":
            self.interpreter.cost.charge(1)  # accu == 1
            return self.hits == 1
        else:
            return self.mapped if kind in ("transformMap", "transformMapEntry") else self.results
        if self.error is not None:
            raise self.error
        return kind == "all"


def _dispatch_error(name: str, values: list[Any]) -> _RuntimeError:
    """cel-go's message when no overload takes the arguments at runtime: an operator's trait
    (``Int.Add`` and the like) says ``no such overload``; a function's guard
    (common/decls/decls.go MaybeNoSuchOverload) names it with the arguments' types."""
    if name.startswith("_") or name in ("-_", "!_", "@in"):
        return _no_overload()
    return _no_overload(f"{name}({', '.join(_type_name(v) for v in values)})")


def _key_text(key: Any) -> str:
    if isinstance(key, bool):
        return "true" if key else "false"
    return str(key)
