"""CEL's macros, expanded while parsing into `_Comprehension` and `_Select` nodes.

cel-go parser/macro.go (``has``, ``all``, ``exists``, ``exists_one``/``existsOne``, ``map``,
``filter``), ext/comprehensions.go (two-variable ``all``, ``exists``, ``existsOne``,
``transformList``, ``transformMap``, ``transformMapEntry``), ext/bindings.go (``cel.bind``) and
ext/lists.go (``sortBy``), with their error messages at the argument they concern.
"""

from __future__ import annotations

from agent.core.cel.ast import _Call, _Comprehension, _Ident, _ListLit, _Lit, _Node, _Select

_QUANTIFIERS = {"all": "all", "exists": "exists", "exists_one": "exists_one", "existsOne": "exists_one"}
_TWO_VAR = {**_QUANTIFIERS, "transformList": "transformList", "transformMap": "transformMap"}
_TWO_VAR["transformMapEntry"] = "transformMapEntry"
_ACCUMULATOR = "__result__"
_SIMPLE_NAME = "argument must be a simple name"

_Errors = list[tuple[int, str]]


def _global_macro(errors: _Errors, pos: int, name: str, args: list[_Node]) -> _Node | None:
    if name != "has" or len(args) != 1:
        return None
    arg = args[0]
    if isinstance(arg, _Select) and not arg.test:
        return _Select(pos, arg.operand, arg.field, test=True)
    return _fail(errors, arg.pos, "invalid argument to has() macro")


def _fail(errors: _Errors, pos: int, message: str) -> _Node:
    errors.append((pos, message))
    return _Lit(pos, None)


def _receiver_macro(errors: _Errors, pos: int, target: _Node, name: str, args: list[_Node]) -> _Node | None:
    count = len(args)
    if name == "bind" and count == 3 and isinstance(target, _Ident) and target.name == "cel":
        if not isinstance(args[0], _Ident):
            return _fail(errors, args[0].pos, "cel.bind() variable names must be simple identifiers")
        return _Comprehension(pos, "bind", args[1], args[0].name, None, None, args[2])
    if (name in _QUANTIFIERS or name in ("map", "filter", "sortBy")) and count == 2:
        message = _SIMPLE_NAME if name in _QUANTIFIERS else "argument is not an identifier"
        if name == "sortBy" and not isinstance(target, _ListLit | _Select | _Ident | _Comprehension | _Call):
            return _fail(
                errors,
                target.pos,
                "sortBy can only be applied to a list, identifier, comprehension, call or select expression",
            )
        var = _iteration_var(errors, args[0], message)
        if var is None:
            return _Lit(pos, None)
        return _Comprehension(pos, _QUANTIFIERS.get(name, name), target, var, None, None, args[1])
    if name == "map" and count == 3:
        var = _iteration_var(errors, args[0], "argument is not an identifier")
        if var is None:
            return _Lit(pos, None)
        return _Comprehension(pos, "map", target, var, None, args[1], args[2])
    if name in _TWO_VAR and (count == 3 or (count == 4 and name.startswith("transform"))):
        first = _iteration_var(errors, args[0], _SIMPLE_NAME)
        second = _iteration_var(errors, args[1], _SIMPLE_NAME)
        if first is None or second is None:
            return _Lit(pos, None)
        if first == second:
            return _fail(errors, args[1].pos, f"duplicate variable name: {first}")
        flt = args[2] if count == 4 else None
        return _Comprehension(pos, _TWO_VAR[name], target, first, second, flt, args[-1])
    return None


def _iteration_var(errors: _Errors, arg: _Node, message: str) -> str | None:
    if not isinstance(arg, _Ident):
        errors.append((arg.pos, message))
        return None
    if arg.name == _ACCUMULATOR:
        errors.append((arg.pos, "iteration variable overwrites accumulator variable"))
        return None
    return arg.name
