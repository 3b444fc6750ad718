"""What the scheduler rejects after type-checking: its AST validators and its program planning.

- cel-go cel/validator.go ``ValidateRegexLiterals`` (in the Kubernetes base environment since
  1.29): a literal first argument of ``matches`` that is not a valid regular expression is
  ``invalid matches argument`` at the literal.
- cel-go ext/formatting.go ``stringFormatValidator``: a literal format string applied to a list
  literal is checked clause by clause against the arguments' types.
- Planning (``program instantiation failed``): the Kubernetes regex library's
  ``FindRegexOptimization``/``FindAllRegexOptimization`` and cel-go's ``matches`` optimization
  compile a literal pattern when the program is built.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from agent.core.cel.ast import _Call, _Comprehension, _Ident, _ListLit, _Lit, _MapLit, _Node, _Select
from agent.core.cel.errors import _RuntimeError
from agent.core.cel.library import _FUNCTIONS
from agent.core.cel.library.format import _clause_error, _FormatError, _parse_format
from agent.core.cel.library.regex import _re
from agent.core.cel.types import _T, _TYPE_IDENTS, _fmt, _is_dyn

_CONVERSIONS = frozenset({"int", "uint", "double", "string", "bytes", "bool", "dyn", "type"})


def _calls(node: _Node) -> Iterator[_Call]:
    """Every call in `node`, the node before its children."""
    if isinstance(node, _Call):
        yield node
    for child in _children(node):
        yield from _calls(child)


def _validate(ast: _Node, types: Mapping[int, _T]) -> list[tuple[int, str]]:
    errors = _homogeneous(ast, types, exempt=False)
    for call in _calls(ast):
        if call.function == "matches" and call.args:
            first = call.args[0]
            if isinstance(first, _Lit) and isinstance(first.value, str) and not _compiles(first.value):
                errors.append((first.pos, "invalid matches argument"))
        if (
            call.function == "format"
            and isinstance(call.target, _Lit)
            and isinstance(call.target.value, str)
            and len(call.args) == 1
            and isinstance(call.args[0], _ListLit)
        ):
            errors.extend(_check_format(call, call.target.value, call.args[0], types))
    return errors


def _homogeneous(node: _Node, types: Mapping[int, _T], *, exempt: bool) -> list[tuple[int, str]]:
    """cel-go ValidateHomogeneousAggregateLiterals: a literal's elements (keys, values) of one type.

    Literals anywhere inside a ``format`` call are exempt (the strings extension asks so).
    """
    errors: list[tuple[int, str]] = []
    if not exempt and isinstance(node, _ListLit):
        errors.extend(_mismatch(list(node.items), types))
    if not exempt and isinstance(node, _MapLit):
        errors.extend(_mismatch([k for k, _ in node.entries], types, every=True))
        errors.extend(_mismatch([v for _, v in node.entries], types, every=True))
    exempt = exempt or (isinstance(node, _Call) and node.function == "format")
    for child in _children(node):
        errors.extend(_homogeneous(child, types, exempt=exempt))
    return errors


def _mismatch(items: list[_Node], types: Mapping[int, _T], *, every: bool = False) -> list[tuple[int, str]]:
    errors = []
    first = types.get(id(items[0]), "dyn") if items else None
    for item in items[1:]:
        t = types.get(id(item), "dyn")
        if t != first:
            errors.append((item.pos, f"expected type '{_fmt(first)}' but found '{_fmt(t)}'"))
            if not every:
                break
    return errors


def _children(node: _Node) -> list[_Node]:
    if isinstance(node, _Call):
        return [*([node.target] if node.target is not None else []), *node.args]
    if isinstance(node, _Select):
        return [node.operand]
    if isinstance(node, _ListLit):
        return list(node.items)
    if isinstance(node, _MapLit):
        return [c for entry in node.entries for c in entry]
    if isinstance(node, _Comprehension):
        return [c for c in (node.range, node.filter, node.body) if c is not None]
    return []


def _compiles(pattern: str) -> bool:
    try:
        _re(pattern)
    except _RuntimeError:
        return False
    return True


def _check_format(call: _Call, text: str, args: _ListLit, types: Mapping[int, _T]) -> list[tuple[int, str]]:
    used = 0

    def verify(index: int, verb: str, precision: int | None) -> None:
        nonlocal used
        used += 1
        arg = args.items[index]
        bad = _bad_argument(arg, verb, types)
        if bad is not None:
            node, message = bad
            raise _FormatError(node.pos, message)

    try:
        _parse_format(text, verify, len(args.items), checking=True)
    except _FormatError as error:
        return [(error.pos if error.pos >= 0 else call.pos, error.message)]
    if len(args.items) > used:
        message = f"too many arguments supplied to string.format (expected {used}, got {len(args.items)})"
        return [(call.pos, message)]
    return []


_VERB_TYPES = {
    "d": ("int", "uint"),
    "f": ("double", "string"),
    "e": ("double", "string"),
    "b": ("int", "uint", "bool"),
    "x": ("int", "uint", "string", "bytes"),
    "X": ("int", "uint", "string", "bytes"),
    "o": ("int", "uint"),
}
_STRING_TYPES = ("int", "uint", "double", "bool", "string", "bytes", "type", "null_type")


def _bad_argument(arg: _Node, verb: str, types: Mapping[int, _T]) -> tuple[_Node, str] | None:
    t = types.get(id(arg), "dyn")
    if t == "any":  # a device attribute (AnyType): no clause takes it (the referee says so)
        return arg, _clause_error(verb, "google.protobuf.Any")
    if verb == "s":
        if not (_is_dyn(t) or t in _STRING_TYPES or (isinstance(t, tuple) and t[0] in ("list", "map"))):
            return arg, _clause_error("s", str(t))  # the runtime type name: `null_type`
        children: list[_Node] = []
        if isinstance(arg, _ListLit):
            children = list(arg.items)
        elif isinstance(arg, _MapLit):
            children = [c for entry in arg.entries for c in entry]
        for child in children:
            bad = _bad_argument(child, "s", types)
            if bad is not None:
                return bad
        return None
    if _is_dyn(t) or t in _VERB_TYPES[verb]:
        return None
    return arg, _clause_error(verb, str(t) if not isinstance(t, tuple) else t[0])


def _constant(node: _Node) -> bool:
    """Whether cel-go folds `node` into a constant when it plans the program (interpreter/
    decorators.go decOptimize: literals of constants and conversions of a constant, bottom up)."""
    if isinstance(node, _Lit):
        return True
    if isinstance(node, _Ident):
        return node.name in _TYPE_IDENTS  # a type name is planned as a constant
    if isinstance(node, _ListLit):
        return all(_constant(i) for i in node.items)
    if isinstance(node, _MapLit):
        return all(_constant(k) and _constant(v) for k, v in node.entries)
    if isinstance(node, _Call):
        conversion = node.function in _CONVERSIONS and node.target is None and len(node.args) == 1
        return conversion and _constant(node.args[0])
    return False


def _bad_qualifier(index: _Node) -> str:
    """The Go type of a constant index cel-go cannot make a qualifier of (interpreter/
    attributes.go newQualifier), else ``""``."""
    while isinstance(index, _Call) and index.function == "dyn" and len(index.args) == 1:
        index = index.args[0]
    if not _constant(index):
        return ""
    if isinstance(index, _ListLit):
        return "*types.baseList"
    if isinstance(index, _MapLit):
        return "*types.baseMap"
    if isinstance(index, _Call) and index.function == "bytes":
        return "types.Bytes"
    if isinstance(index, _Lit) and (index.value is None or isinstance(index.value, bytes)):
        return "types.Null" if index.value is None else "types.Bytes"
    return ""


def _plan_errors(ast: _Node) -> str | None:
    """The first error building the program reports.

    cel-go's ``OptOptimize`` folds a conversion of a constant (``int('x')``) and compiles a literal
    pattern while planning, so their errors come before any evaluation.
    """
    for call in _calls(ast):
        if call.function == "_[_]" and (bad := _bad_qualifier(call.args[1])):
            return f"invalid qualifier type: {bad}"
        if call.function in _CONVERSIONS and len(call.args) == 1 and isinstance(call.args[0], _Lit):
            try:
                _FUNCTIONS[call.function](False, call.args[0].value)
            except _RuntimeError as error:
                return error.message
            except (TypeError, ValueError):
                return "no such overload"
        pattern: _Node | None = None
        if call.function in ("find", "findAll") and call.target is not None and call.args:
            pattern = call.args[0]
        elif call.function == "matches" and call.target is None and len(call.args) == 2:
            pattern = call.args[1]
        if isinstance(pattern, _Lit) and isinstance(pattern.value, str):
            try:
                _re(pattern.value)
            except _RuntimeError as error:
                return error.message
    return None
