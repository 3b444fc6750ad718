"""Kubernetes DRA CEL device selectors, checked and evaluated as the scheduler does.

The scheduler compiles a selector with the environment of
``k8s.io/dynamic-resource-allocation/cel/compile.go``: the Kubernetes base environment
(``k8s.io/apiserver/pkg/cel/environment/base.go``) plus the ``device`` variable, the semver
library and ``cel.bind``. This module parses with cel-python's grammar, then type-checks and
evaluates with its own checker and interpreter so that what a user sees is what the scheduler
reports:

- compile errors (``compilation failed: ERROR: <input>:1:53: undeclared reference to 'foo'
  (in container '')``, ``found no matching overload for '_+_' applied to '(string, int)'``,
  ``must evaluate to bool or the unknown type, not string``);
- runtime errors (``no such key: index``, ``no such overload``, ``division by zero``,
  ``integer overflow``, ``operation cancelled: actual cost limit exceeded``);
- no Python state in any message (messages are built here, capped to `MAX_MESSAGE`).

The functions: standard CEL (operators, ``size``, ``contains``, ``startsWith``, ``endsWith``,
``matches`` (RE2), conversions, ``has``/``all``/``exists``/``exists_one``/``map``/``filter``
macros); cel-go's strings extension version 2 (``charAt``, ``indexOf``, ``lastIndexOf``,
``lowerAscii``, ``upperAscii``, ``replace``, ``split``, ``substring``, ``trim``, ``join``,
``format``, ``strings.quote``); the sets extension (``sets.contains``, ``sets.equivalent``,
``sets.intersects``); two-variable comprehensions (``all``, ``exists``, ``existsOne``,
``transformList``, ``transformMap``); ``cel.bind``; and the Kubernetes libraries lists
(``isSorted``, ``sum``, ``min``, ``max``, ``indexOf``, ``lastIndexOf``), regex (``find``,
``findAll``), quantity and semver (with the ``normalize`` argument of version 1).

Gaps (declared, so they compile, but evaluation reports that explain does not evaluate them):
the URL, IP/CIDR, format (``format.*``), image and authz libraries, durations and timestamps.
Optional types (``.?field``, ``[?key]``) do not parse. The runtime cost is counted per evaluated
node plus per-character costs of string functions, which approximates cel-go's tracker; the
scheduler's limit (1,000,000) is enforced with cel-go's message. The API server's admission-time
*estimated* cost check is not repeated.

API (``dra-agent explain`` and the tests use it):

- ``matches(expression, device, driver=None) -> bool``: evaluate one selector on an
  `agent.core.model.Device` or a slice device dict (pass the slice's ``driver`` then).
- ``compile_check(expression)``: raise `CelCompileError` when the scheduler would not compile it.
- ``referenced_values(expression, device, driver)``: the attribute and capacity values the
  expression reads, as text (``<absent>`` when the device lacks them), to show why it was false.
- ``match_attribute(name, devices) -> bool``: the ``matchAttribute`` constraint.
- ``CelError``: compile errors (`CelCompileError`), runtime errors and non-bool results; its
  message is the scheduler's wording.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import lark
import re2  # type: ignore[import-untyped]
from celpy.celparser import CELParseError, CELParser

from agent.core.errors import QuantityError
from agent.core.model import AttributeValue, Device, Version
from agent.core.quantity import Quantity
from agent.core.semver import is_semver

__all__ = [
    "COST_LIMIT",
    "MAX_MESSAGE",
    "CelCompileError",
    "CelError",
    "CelQuantity",
    "CelSemver",
    "compile_check",
    "match_attribute",
    "matches",
    "referenced_values",
]

COST_LIMIT = 1_000_000
"""resourceapi.CELSelectorExpressionMaxCost: the scheduler's runtime cost limit per selector."""

MAX_MESSAGE = 512
"""The longest CEL message shown (a compile error's first line, a runtime error)."""

MAX_EXPRESSION = 10 * 1024
"""resourceapi.CELSelectorExpressionMaxLength."""

MAX_LIST = 1_000_000
"""No list or string built while evaluating may grow past this (the cost limit stops it first)."""


class CelError(Exception):
    """The expression does not compile, fails at runtime or does not return a bool."""

    def __init__(self, message: str) -> None:
        super().__init__(_cap(message))


class CelCompileError(CelError):
    """The expression does not compile (the message starts with ``compilation failed: ``)."""


class _RuntimeError(Exception):
    """A CEL runtime error value; its text is cel-go's."""

    def __init__(self, message: str) -> None:
        super().__init__(_cap(message))
        self.message = _cap(message)


def _cap(message: str) -> str:
    message = "".join(c if c.isprintable() or c == "\n" else "?" for c in message)
    return message if len(message) <= MAX_MESSAGE else message[: MAX_MESSAGE - 3] + "..."


# ------------------------------------------------------------------------------------- values


class CelQuantity:
    """A Kubernetes quantity inside CEL (``kubernetes.Quantity``)."""

    __slots__ = ("quantity",)

    def __init__(self, quantity: Quantity) -> None:
        self.quantity = quantity

    def cmp(self, other: CelQuantity) -> int:
        a, b = self.quantity.value, other.quantity.value
        return (a > b) - (a < b)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CelQuantity) and self.quantity.value == other.quantity.value

    def __hash__(self) -> int:
        return hash(self.quantity.value)

    def __repr__(self) -> str:
        return f"quantity({self.quantity.canonical()!r})"


class CelSemver:
    """A semantic version inside CEL (``kubernetes.Semver``): semver 2.0.0 precedence."""

    __slots__ = ("parts", "pre", "text")

    def __init__(self, text: str) -> None:
        if not is_semver(text):
            raise ValueError(f"{text!r} is not a semantic version")
        self.text = text
        core, _, _build = text.partition("+")
        numbers, _, pre = core.partition("-")
        major, minor, patch = (int(p) for p in numbers.split("."))
        self.parts = (major, minor, patch)
        self.pre = tuple(pre.split(".")) if pre else ()

    def _key(self) -> tuple[Any, ...]:
        pre = tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in self.pre)
        return (*self.parts, 1 if not self.pre else 0, pre)

    def cmp(self, other: CelSemver) -> int:
        a, b = self._key(), other._key()
        return (a > b) - (a < b)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CelSemver) and self.cmp(other) == 0

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return f"semver({self.text!r})"


class _UInt(int):
    """A CEL ``uint``."""


@dataclass(frozen=True)
class _TypeValue:
    """A CEL type as a value (``type(1) == int``)."""

    name: str


class _DomainMap(dict[str, Any]):
    """``device.attributes`` / ``device.capacity``: an unknown domain reads as an empty map."""


_INT_MIN, _INT_MAX = -(2**63), 2**63 - 1
_UINT_MAX = 2**64 - 1


def _type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, _UInt):
        return "uint"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "double"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bytes):
        return "bytes"
    if value is None:
        return "null_type"
    if isinstance(value, list):
        return "list"
    if isinstance(value, dict):
        return "map"
    if isinstance(value, CelQuantity):
        return "kubernetes.Quantity"
    if isinstance(value, CelSemver):
        return "kubernetes.Semver"
    if isinstance(value, _TypeValue):
        return "type"
    return "unknown"


# -------------------------------------------------------------------------------------- AST


@dataclass(frozen=True)
class _Node:
    pos: int


@dataclass(frozen=True)
class _Lit(_Node):
    value: Any


@dataclass(frozen=True)
class _Ident(_Node):
    name: str


@dataclass(frozen=True)
class _Select(_Node):
    operand: _Node
    field: str
    test: bool = False  # has()


@dataclass(frozen=True)
class _Call(_Node):
    function: str  # operators: _+_, _==_, !_, -_, _[_], @in, _&&_, _||_, _?_:_
    target: _Node | None
    args: tuple[_Node, ...]


@dataclass(frozen=True)
class _ListLit(_Node):
    items: tuple[_Node, ...]


@dataclass(frozen=True)
class _MapLit(_Node):
    entries: tuple[tuple[_Node, _Node], ...]


@dataclass(frozen=True)
class _Comprehension(_Node):
    """A macro: ``kind`` in all, exists, exists_one, map, filter, transformList, transformMap, bind."""

    kind: str
    range: _Node
    var: str
    var2: str | None
    filter: _Node | None
    body: _Node


_BINARY_OPS = {
    "relation_lt": ("_<_", "<"),
    "relation_le": ("_<=_", "<="),
    "relation_gt": ("_>_", ">"),
    "relation_ge": ("_>=_", ">="),
    "relation_eq": ("_==_", "=="),
    "relation_ne": ("_!=_", "!="),
    "relation_in": ("@in", "in"),
    "addition_add": ("_+_", "+"),
    "addition_sub": ("_-_", "-"),
    "multiplication_mul": ("_*_", "*"),
    "multiplication_div": ("_/_", "/"),
    "multiplication_mod": ("_%_", "%"),
}

_ONE_VAR = {"all": "all", "exists": "exists", "exists_one": "exists_one", "existsOne": "exists_one"}


_Tree = lark.Tree[Any]


class _Builder:
    """The lark tree of cel-python's grammar -> our AST, with source offsets as cel-go reports them."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.errors: list[tuple[int, str]] = []

    def find(self, text: str, start: int) -> int:
        index = self.source.find(text, start)
        return index if index >= 0 else start

    def end(self, tree: _Tree | lark.Token) -> int:
        if isinstance(tree, lark.Token):
            return int(tree.end_pos or 0)
        return int(getattr(tree.meta, "end_pos", 0) or 0)

    def start(self, tree: _Tree | lark.Token) -> int:
        if isinstance(tree, lark.Token):
            return int(tree.start_pos or 0)
        return int(getattr(tree.meta, "start_pos", 0) or 0)

    def build(self, tree: _Tree | lark.Token) -> _Node:
        if isinstance(tree, lark.Token):
            return self.literal(tree)
        kind, children = tree.data, tree.children
        if kind == "expr":
            if len(children) == 1 or children[1] is None:
                return self.build(children[0])
            cond = self.build(children[0])
            return _Call(
                self.find("?", self.end(children[0])),
                "_?_:_",
                None,
                (cond, self.build(children[1]), self.build(children[2])),
            )
        if kind in ("conditionalor", "conditionaland"):
            if len(children) == 1 or children[0] is None:
                return self.build(children[-1])
            op = "||" if kind == "conditionalor" else "&&"
            return _Call(
                self.find(op, self.end(children[0])),
                f"_{op}_",
                None,
                (self.build(children[0]), self.build(children[1])),
            )
        if kind in ("relation", "addition", "multiplication"):
            if len(children) == 1 or children[0] is None:
                return self.build(children[-1])
            op_tree = children[0]
            function, text = _BINARY_OPS[op_tree.data]
            left = op_tree.children[0]
            return _Call(
                self.find(text, self.end(left)), function, None, (self.build(left), self.build(children[1]))
            )
        if kind == "unary":
            if len(children) == 1:
                return self.build(children[0])
            op = children[0].data
            pos = self.start(children[0])
            operand = self.build(children[1])
            if op == "unary_neg" and isinstance(operand, _Lit) and type(operand.value) in (int, float):
                return _Lit(pos, -operand.value)
            return _Call(pos, "!_" if op == "unary_not" else "-_", None, (operand,))
        if kind in ("member", "primary", "paren_expr"):
            return self.build(children[0])
        if kind == "literal":
            token = children[0]
            assert isinstance(token, lark.Token)
            return self.literal(token)
        if kind == "ident":
            return _Ident(self.start(children[0]), str(children[0]))
        if kind == "dot_ident":
            return _Ident(self.start(children[0]), str(children[0]))
        if kind == "member_dot":
            operand = self.build(children[0])
            return _Select(self.find(".", self.end(children[0])), operand, str(children[1]))
        if kind == "member_index":
            operand = self.build(children[0])
            pos = self.find("[", self.end(children[0]))
            return _Call(pos, "_[_]", None, (operand, self.build(children[1])))
        if kind in ("ident_arg", "dot_ident_arg"):
            name = str(children[0])
            pos = self.find("(", self.end(children[0]))
            raw = self.exprlist(children[1] if len(children) > 1 else None)
            if name == "has" and len(raw) == 1:
                return self.has(pos, raw[0])
            return _Call(pos, name, None, tuple(self.build(a) for a in raw))
        if kind == "member_dot_arg":
            name = str(children[1])
            pos = self.find("(", self.end(children[1]))
            raw = self.exprlist(children[2] if len(children) > 2 else None)
            macro = self.macro(pos, children[0], name, raw)
            if macro is not None:
                return macro
            target = self.build(children[0])
            if isinstance(target, _Ident) and target.name in ("sets", "strings"):
                return _Call(pos, f"{target.name}.{name}", None, tuple(self.build(a) for a in raw))
            return _Call(pos, name, target, tuple(self.build(a) for a in raw))
        if kind == "list_lit":
            items = self.exprlist(children[0] if children else None)
            return _ListLit(self.start(tree), tuple(self.build(a) for a in items))
        if kind == "map_lit":
            items = children[0].children if children and children[0] is not None else []
            built = [self.build(c) for c in items]
            return _MapLit(self.start(tree), tuple(zip(built[0::2], built[1::2], strict=True)))
        if kind == "member_object":
            self.errors.append((self.start(tree), "message construction is not supported for DRA devices"))
            return _Lit(self.start(tree), None)
        self.errors.append((self.start(tree), f"unsupported syntax {kind}"))
        return _Lit(self.start(tree), None)

    def exprlist(self, tree: _Tree | None) -> list[_Tree]:
        if tree is None:
            return []
        return [c for c in tree.children if isinstance(c, lark.Tree)]

    def ident_of(self, tree: _Tree) -> str | None:
        node = self.build(tree)
        return node.name if isinstance(node, _Ident) else None

    def has(self, pos: int, arg: _Tree) -> _Node:
        node = self.build(arg)
        if isinstance(node, _Select):
            return _Select(pos, node.operand, node.field, test=True)
        self.errors.append((pos, "invalid argument to has() macro"))
        return _Lit(pos, False)

    def macro(self, pos: int, target: _Tree, name: str, raw: list[_Tree]) -> _Node | None:
        if name == "bind" and len(raw) == 3 and self.ident_of(target) == "cel":
            var = self.ident_of(raw[0])
            if var is None:
                self.errors.append((pos, "cel.bind() variable names must be simple identifiers"))
                return _Lit(pos, None)
            return _Comprehension(pos, "bind", self.build(raw[1]), var, None, None, self.build(raw[2]))
        one_var = name in ("all", "exists", "exists_one", "existsOne", "filter") and len(raw) == 2
        mapping = name == "map" and len(raw) in (2, 3)
        two_var = (name in ("all", "exists", "exists_one", "existsOne") and len(raw) == 3) or (
            name in ("transformList", "transformMap") and len(raw) in (3, 4)
        )
        if not (one_var or mapping or two_var):
            return None
        names = [self.ident_of(r) for r in raw[: 2 if two_var else 1]]
        if any(n is None for n in names):
            self.errors.append((pos, "argument must be a simple name"))
            return _Lit(pos, None)
        rng = self.build(target)
        kind = _ONE_VAR.get(name, name)
        if mapping:
            flt = self.build(raw[1]) if len(raw) == 3 else None
            return _Comprehension(pos, "map", rng, str(names[0]), None, flt, self.build(raw[-1]))
        if one_var:
            return _Comprehension(pos, kind, rng, str(names[0]), None, None, self.build(raw[1]))
        flt = self.build(raw[2]) if len(raw) == 4 else None
        return _Comprehension(pos, kind, rng, str(names[0]), str(names[1]), flt, self.build(raw[-1]))
        return None

    def literal(self, token: lark.Token) -> _Node:
        pos = self.start(token)
        text = str(token)
        kind = token.type
        try:
            if kind == "INT_LIT":
                value = int(text, 0) if "x" in text.lower() else int(text)
                if not _INT_MIN <= value <= _INT_MAX:
                    raise ValueError
                return _Lit(pos, value)
            if kind == "UINT_LIT":
                value = int(text[:-1], 0) if "x" in text.lower() else int(text[:-1])
                if not 0 <= value <= _UINT_MAX:
                    raise ValueError
                return _Lit(pos, _UInt(value))
            if kind == "FLOAT_LIT":
                return _Lit(pos, float(text))
            if kind == "BOOL_LIT":
                return _Lit(pos, text == "true")
            if kind == "NULL_LIT":
                return _Lit(pos, None)
            if kind in ("STRING_LIT", "MLSTRING_LIT"):
                return _Lit(pos, _unquote(text))
            if kind == "BYTES_LIT":
                return _Lit(pos, _unquote(text[1:]).encode("utf-8", "surrogatepass"))
        except ValueError:
            self.errors.append((pos, f"invalid {kind.lower().replace('_lit', '')} literal"))
            return _Lit(pos, None)
        return _Lit(pos, None)


_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v"}
_ESCAPE = re.compile(
    r"\\(?:([abfnrtv\"'\\`?])|x([0-9a-fA-F]{2})|u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})|([0-7]{3}))"
)


def _unquote(text: str) -> str:
    raw = text[:1] in "rR"
    if raw:
        text = text[1:]
    quote = 3 if text[:3] in ('"""', "'''") else 1
    body = text[quote:-quote]
    if raw:
        return body

    def escape(m: re.Match[str]) -> str:
        if m.group(1):
            return _ESCAPES.get(m.group(1), m.group(1))
        code = m.group(2) or m.group(3) or m.group(4)
        return chr(int(code, 16)) if code else chr(int(m.group(5), 8))

    return _ESCAPE.sub(escape, body)


# --------------------------------------------------------------------------------- the checker

_T = Any  # a type: "int", "string", ..., "dyn", ("list", T), ("map", K, V)

_QTY = "kubernetes.Quantity"
_SEMVER = "kubernetes.Semver"
_DEVICE = "kubernetes.DRADevice"
_ATTRIBUTES = ("map", "string", ("map", "string", "any"))
_CAPACITY = ("map", "string", ("map", "string", _QTY))
_NUMERIC = ("int", "uint", "double")


def _fmt(t: _T) -> str:
    if isinstance(t, tuple):
        if t[0] == "list":
            return f"list({_fmt(t[1])})"
        return f"map({_fmt(t[1])}, {_fmt(t[2])})"
    return str(t)


def _is_dyn(t: _T) -> bool:
    return t in ("dyn", "any", "error")


@dataclass(frozen=True)
class _Overload:
    member: bool
    params: tuple[_T, ...]
    result: _T


def _o(member: bool, result: _T, *params: _T) -> _Overload:
    return _Overload(member, params, result)


_A = "A"  # a type parameter
_LIST_A = ("list", _A)
_MAP_AB = ("map", _A, "B")


def _declarations() -> dict[str, list[_Overload]]:
    d: dict[str, list[_Overload]] = {}

    def add(name: str, *overloads: _Overload) -> None:
        d.setdefault(name, []).extend(overloads)

    # Standard operators.
    for op in ("_+_",):
        add(
            op,
            *(_o(False, t, t, t) for t in (*_NUMERIC, "string", "bytes")),
            _o(False, _LIST_A, _LIST_A, _LIST_A),
        )
    for op in ("_-_", "_*_", "_/_"):
        add(op, *(_o(False, t, t, t) for t in _NUMERIC))
    add("_%_", _o(False, "int", "int", "int"), _o(False, "uint", "uint", "uint"))
    add("-_", _o(False, "int", "int"), _o(False, "double", "double"))
    add("!_", _o(False, "bool", "bool"))
    for op in ("_==_", "_!=_"):
        add(op, _o(False, "bool", _A, _A))
    for op in ("_<_", "_<=_", "_>_", "_>=_"):
        add(op, *(_o(False, "bool", a, b) for a in _NUMERIC for b in _NUMERIC))
        add(op, *(_o(False, "bool", t, t) for t in ("string", "bytes", "bool")))
    add("@in", _o(False, "bool", _A, _LIST_A), _o(False, "bool", _A, _MAP_AB))
    add("_[_]", _o(False, _A, _LIST_A, "int"), _o(False, "B", _MAP_AB, _A))
    for op in ("_&&_", "_||_"):
        add(op, _o(False, "bool", "bool", "bool"))
    add("_?_:_", _o(False, _A, "bool", _A, _A))
    # Standard functions.
    for t in ("string", "bytes", _LIST_A, _MAP_AB):
        add("size", _o(False, "int", t), _o(True, "int", t))
    for name in ("contains", "startsWith", "endsWith"):
        add(name, _o(True, "bool", "string", "string"))
    add("matches", _o(False, "bool", "string", "string"), _o(True, "bool", "string", "string"))
    add("int", *(_o(False, "int", t) for t in ("int", "uint", "double", "string")))
    add("uint", *(_o(False, "uint", t) for t in ("int", "uint", "double", "string")))
    add("double", *(_o(False, "double", t) for t in ("int", "uint", "double", "string")))
    add("string", *(_o(False, "string", t) for t in ("int", "uint", "double", "string", "bytes", "bool")))
    add("bytes", _o(False, "bytes", "bytes"), _o(False, "bytes", "string"))
    add("bool", _o(False, "bool", "bool"), _o(False, "bool", "string"))
    add("dyn", _o(False, "dyn", _A))
    add("type", _o(False, "type", _A))
    # cel-go strings extension, version 2.
    add("charAt", _o(True, "string", "string", "int"))
    for name in ("indexOf", "lastIndexOf"):
        add(name, _o(True, "int", "string", "string"), _o(True, "int", "string", "string", "int"))
    for name in ("lowerAscii", "upperAscii", "trim"):
        add(name, _o(True, "string", "string"))
    add(
        "replace",
        _o(True, "string", "string", "string", "string"),
        _o(True, "string", "string", "string", "string", "int"),
    )
    add(
        "split",
        _o(True, ("list", "string"), "string", "string"),
        _o(True, ("list", "string"), "string", "string", "int"),
    )
    add("substring", _o(True, "string", "string", "int"), _o(True, "string", "string", "int", "int"))
    add("join", _o(True, "string", ("list", "string")), _o(True, "string", ("list", "string"), "string"))
    add("format", _o(True, "string", "string", ("list", "dyn")))
    add("strings.quote", _o(False, "string", "string"))
    # cel-go sets extension.
    for name in ("sets.contains", "sets.equivalent", "sets.intersects"):
        add(name, _o(False, "bool", _LIST_A, _LIST_A))
    # Kubernetes lists library.
    add("isSorted", _o(True, "bool", _LIST_A))
    for name in ("sum", "min", "max"):
        add(name, _o(True, _A, _LIST_A))
    for name in ("indexOf", "lastIndexOf"):
        add(name, _o(True, "int", _LIST_A, _A))
    # Kubernetes regex library.
    add("find", _o(True, "string", "string", "string"))
    add(
        "findAll",
        _o(True, ("list", "string"), "string", "string"),
        _o(True, ("list", "string"), "string", "string", "int"),
    )
    # Kubernetes quantity library.
    add("quantity", _o(False, _QTY, "string"))
    add("isQuantity", _o(False, "bool", "string"))
    add("sign", _o(True, "int", _QTY))
    add("asInteger", _o(True, "int", _QTY))
    add("asApproximateFloat", _o(True, "double", _QTY))
    add("isInteger", _o(True, "bool", _QTY))
    for name in ("add", "sub"):
        add(name, _o(True, _QTY, _QTY, _QTY), _o(True, _QTY, _QTY, "int"))
    # Quantity and semver comparisons.
    for t in (_QTY, _SEMVER):
        add("isGreaterThan", _o(True, "bool", t, t))
        add("isLessThan", _o(True, "bool", t, t))
        add("compareTo", _o(True, "int", t, t))
    # Kubernetes semver library, version 1.
    add("semver", _o(False, _SEMVER, "string"), _o(False, _SEMVER, "string", "bool"))
    add("isSemver", _o(False, "bool", "string"), _o(False, "bool", "string", "bool"))
    for name in ("major", "minor", "patch"):
        add(name, _o(True, "int", _SEMVER))
    return d


_DECLS = _declarations()

_UNSUPPORTED = frozenset(
    {
        # Kubernetes URL, IP, CIDR, format, image and authz libraries; durations and timestamps.
        "url", "isURL", "getScheme", "getHost", "getHostname", "getPort", "getEscapedPath", "getQuery",
        "ip", "isIP", "family", "isUnspecified", "isLoopback", "isLinkLocalMulticast",
        "isLinkLocalUnicast", "isGlobalUnicast", "isCanonical", "cidr", "isCIDR", "containsIP",
        "containsCIDR", "masked", "prefixLength", "validate", "named", "duration", "timestamp",
        "getDate", "getDayOfMonth", "getDayOfWeek", "getDayOfYear", "getFullYear", "getMonth",
        "getHours", "getMilliseconds", "getMinutes", "getSeconds", "image", "isImage",
        "containerImage", "registry", "repository", "identifier", "tag", "digest",
        "authorizer", "fieldSelector", "labelSelector",
    }
)  # fmt: skip

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
        if bound in _NUMERIC and arg in _NUMERIC:  # heterogeneous numeric equality
            return True
        return _unify(bound, arg, binding) or bound == "null_type" or arg == "null_type"
    if _is_dyn(arg) or _is_dyn(param):
        return True
    if isinstance(param, tuple):
        if not isinstance(arg, tuple) or arg[0] != param[0]:
            return False
        return all(_unify(p, a, binding) for p, a in zip(param[1:], arg[1:], strict=True))
    return bool(param == arg)


class _Checker:
    """cel-go's checker for the DRA environment: names, overloads and the result type."""

    def __init__(self) -> None:
        self.errors: list[tuple[int, str]] = []
        self.exempt: set[int] = set()

    def check(self, node: _Node, scope: Mapping[str, _T]) -> _T:
        if isinstance(node, _Lit):
            return _literal_type(node.value)
        if isinstance(node, _Ident):
            if node.name in scope:
                return scope[node.name]
            if node.name == "device":
                return _DEVICE
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
            if id(node) in self.exempt:  # the strings extension exempts format()'s argument list
                return ("list", "dyn")
            return ("list", self.join(node, types))
        if isinstance(node, _MapLit):
            keys = [self.check(k, scope) for k, _ in node.entries]
            values = [self.check(v, scope) for _, v in node.entries]
            return ("map", self.join(node, keys), self.join(node, values))
        if isinstance(node, _Comprehension):
            return self.comprehension(node, scope)
        assert isinstance(node, _Call)
        if node.function == "format" and node.args and isinstance(node.args[0], _ListLit):
            self.exempt.add(id(node.args[0]))
        target = self.check(node.target, scope) if node.target is not None else None
        args = [self.check(a, scope) for a in node.args]
        return self.call(node, target, args)

    def join(self, node: _Node, types: list[_T]) -> _T:
        known = [t for t in types if not _is_dyn(t)]
        if not known:
            return "dyn"
        first = known[0]
        for t in known[1:]:
            if t != first:
                # cel.HomogeneousAggregateLiterals
                self.errors.append((node.pos, f"expected type '{_fmt(first)}' but found '{_fmt(t)}'"))
                return "error"
        return first

    def select(self, node: _Select, operand: _T) -> _T:
        if _is_dyn(operand):
            return "dyn"
        if operand == _DEVICE:
            fields = {"driver": "string", "attributes": _ATTRIBUTES, "capacity": _CAPACITY}
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
        if _is_dyn(rng):
            key, value = "dyn", "dyn"
        elif isinstance(rng, tuple) and rng[0] == "list":
            key, value = "int", rng[1]
        elif isinstance(rng, tuple) and rng[0] == "map":
            key, value = rng[1], rng[2]
        else:
            self.errors.append(
                (node.pos, f"expression of type '{_fmt(rng)}' cannot be range of a comprehension")
            )
            return "error"
        if node.var2 is None:
            inner[node.var] = key if isinstance(rng, tuple) and rng[0] == "map" else value
        else:
            inner[node.var], inner[node.var2] = key, value
        if node.filter is not None:
            self.expect_bool(node.filter, self.check(node.filter, inner))
        body = self.check(node.body, inner)
        if node.kind in ("all", "exists", "exists_one") or (node.kind == "filter"):
            self.expect_bool(node.body, body)
        if node.kind in ("all", "exists", "exists_one"):
            return "bool"
        if node.kind == "filter":
            return ("list", inner[node.var])
        if node.kind in ("map", "transformList"):
            return ("list", body)
        return ("map", key, body)  # transformMap

    def expect_bool(self, node: _Node, t: _T) -> None:
        if not (_is_dyn(t) or t == "bool"):
            self.errors.append((node.pos, f"found no matching overload for '_?_:_' applied to '({_fmt(t)})'"))


def _literal_type(value: Any) -> _T:
    return _type_name(value) if value is not None else "null_type"


def _located(source: str, pos: int, message: str) -> str:
    """cel-go's ``ERROR: <input>:L:C: message`` with the source line and a caret below."""
    line_no = source.count("\n", 0, pos) + 1
    line_start = source.rfind("\n", 0, pos) + 1
    column = pos - line_start + 1
    line_end = source.find("\n", pos)
    line = source[line_start : line_end if line_end >= 0 else len(source)]
    return f"ERROR: <input>:{line_no}:{column}: {message}\n | {line}\n | {'.' * (column - 1)}^"


def _syntax_error(source: str, error: lark.exceptions.UnexpectedInput) -> str:
    """cel-go's ``Syntax error: mismatched input 'X'`` / ``token recognition error at: 'X'``."""
    pos = int(getattr(error, "pos_in_stream", None) or 0)
    if isinstance(error, lark.exceptions.UnexpectedToken):
        token = error.token
        if token.type == "$END":
            pos = len(source)
            return _located(source, pos, "Syntax error: mismatched input '<EOF>'")
        pos = int(token.start_pos or pos)
        return _located(source, pos, f"Syntax error: mismatched input '{_cap(str(token))[:40]}'")
    if isinstance(error, lark.exceptions.UnexpectedCharacters):
        return _located(source, pos, f"Syntax error: token recognition error at: '{source[pos : pos + 1]}'")
    return _located(source, pos, "Syntax error")


@dataclass(frozen=True)
class _Program:
    source: str
    ast: _Node


_PARSER: CELParser | None = None


@functools.lru_cache(maxsize=512)
def _program(expression: str) -> _Program:
    global _PARSER  # noqa: PLW0603
    if len(expression) > MAX_EXPRESSION:
        raise CelCompileError(
            f"compilation failed: expression is {len(expression)} characters, more than {MAX_EXPRESSION}"
        )
    if _PARSER is None:
        _PARSER = CELParser()
    grammar = CELParser.CEL_PARSER
    assert grammar is not None
    try:
        tree = grammar.parse(expression)
    except lark.exceptions.UnexpectedInput as error:
        raise CelCompileError(f"compilation failed: {_syntax_error(expression, error)}") from None
    except (lark.exceptions.LarkError, CELParseError):
        raise CelCompileError("compilation failed: ERROR: <input>:1:1: Syntax error") from None
    except RecursionError:
        raise CelCompileError("compilation failed: expression nests too deeply") from None
    builder = _Builder(expression)
    try:
        ast = builder.build(tree)
    except RecursionError:
        raise CelCompileError("compilation failed: expression nests too deeply") from None
    checker = _Checker()
    errors = builder.errors
    if not errors:
        output = checker.check(ast, {})
        errors = checker.errors
        if not errors and not (_is_dyn(output) or output == "bool"):
            raise CelCompileError(f"must evaluate to bool or the unknown type, not {_fmt(output)}")
    if errors:
        text = "\n".join(_located(expression, pos, msg) for pos, msg in errors)
        raise CelCompileError(f"compilation failed: {text}")
    return _Program(expression, ast)


# ----------------------------------------------------------------------------- the interpreter


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


def _no_overload(name: str = "") -> _RuntimeError:
    return _RuntimeError("no such overload" + (f": {name}" if name else ""))


def _check_int(value: int) -> int:
    if not _INT_MIN <= value <= _INT_MAX:
        raise _RuntimeError("integer overflow")
    return value


def _check_uint(value: int) -> _UInt:
    if not 0 <= value <= _UINT_MAX:
        raise _RuntimeError("unsigned integer overflow")
    return _UInt(value)


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _equal(a: Any, b: Any) -> bool:
    if _is_num(a) and _is_num(b):
        return Fraction(a) == Fraction(b) if not (isinstance(a, float) and math.isnan(a)) else False
    if _type_name(a) != _type_name(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return len(a) == len(b) and all(
            any(_equal(k, k2) and _equal(v, b[k2]) for k2 in b) for k, v in a.items()
        )
    return bool(a == b)


def _compare(a: Any, b: Any) -> int:
    if _is_num(a) and _is_num(b):
        if (isinstance(a, float) and math.isnan(a)) or (isinstance(b, float) and math.isnan(b)):
            raise _RuntimeError("NaN values cannot be ordered")
        fa, fb = Fraction(a), Fraction(b)
        return (fa > fb) - (fa < fb)
    if type(a) is type(b) and isinstance(a, str | bytes | bool):
        return int((a > b) - (a < b))
    raise _no_overload()


def _arith(op: str, a: Any, b: Any) -> Any:
    if op == "_+_":
        if isinstance(a, str) and isinstance(b, str):
            return a + b
        if isinstance(a, bytes) and isinstance(b, bytes):
            return a + b
        if isinstance(a, list) and isinstance(b, list):
            return a + b
    if _is_num(a) and _is_num(b) and _type_name(a) == _type_name(b):
        if isinstance(a, float):
            if op == "_+_":
                return a + b
            if op == "_-_":
                return a - b
            if op == "_*_":
                return a * b
            if op == "_/_":
                if b == 0:
                    return math.copysign(math.inf, a) * math.copysign(1, b) if a else math.nan
                return a / b
            raise _no_overload()
        check = _check_uint if isinstance(a, _UInt) else _check_int
        if op == "_+_":
            return check(a + b)
        if op == "_-_":
            return check(a - b)
        if op == "_*_":
            return check(a * b)
        if op in ("_/_", "_%_"):
            if b == 0:
                raise _RuntimeError("division by zero" if op == "_/_" else "modulus by zero")
            if op == "_/_" and a == _INT_MIN and b == -1:
                raise _RuntimeError("integer overflow")
            quotient = abs(a) // abs(b) * (1 if (a >= 0) == (b >= 0) else -1)  # truncation, as Go
            return check(quotient) if op == "_/_" else check(a - b * quotient)
    raise _no_overload()


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


def _show(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


# ------------------------------------------------------------------------------ the functions


def _want(cond: bool) -> None:
    if not cond:
        raise TypeError


def _s(value: Any) -> str:
    _want(isinstance(value, str))
    return str(value)


def _i(value: Any) -> int:
    _want(isinstance(value, int) and not isinstance(value, bool | _UInt))
    return int(value)


def _l(value: Any) -> list[Any]:
    _want(isinstance(value, list))
    return list(value)


def _re(pattern: Any) -> Any:
    try:
        return _compiled_regex(_s(pattern))
    except re2.error as error:
        raise _RuntimeError(f"error parsing regexp: {_re2_message(error)}: `{pattern}`") from None


@functools.lru_cache(maxsize=256)
def _compiled_regex(pattern: str) -> Any:
    options = re2.Options()
    options.log_errors = False
    return re2.compile(pattern, options)


_GO_REGEXP = {
    "missing ]": "missing closing ]",
    "missing )": "missing closing )",
    "unexpected )": "unexpected )",
    "bad repetition operator": "invalid nested repetition operator",
    "no argument for repetition operator": "missing argument to repetition operator",
    "trailing \\": "trailing backslash at end of expression",
    "invalid escape sequence": "invalid escape sequence",
    "bad character class range": "invalid character class range",
    "invalid character class": "invalid character class",
    "invalid repetition size": "invalid repeat count",
    "invalid perl operator": "invalid or unsupported Perl syntax",
}


def _re2_message(error: Exception) -> str:
    """RE2's message in Go's regexp wording (the scheduler is Go; ``error parsing regexp: ...``)."""
    raw = error.args[0] if error.args else ""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    head = text.split(":")[0].strip()
    return _GO_REGEXP.get(head, head or "invalid pattern")


def _size(member: bool, v: Any) -> int:
    if isinstance(v, str):
        return len(v)
    _want(isinstance(v, bytes | list | dict))
    return len(v)


def _contains(member: bool, s: Any, sub: Any) -> bool:
    return _s(sub) in _s(s)


def _starts(member: bool, s: Any, p: Any) -> bool:
    return _s(s).startswith(_s(p))


def _ends(member: bool, s: Any, p: Any) -> bool:
    return _s(s).endswith(_s(p))


def _matches(member: bool, s: Any, p: Any) -> bool:
    return _re(p).search(_s(s)) is not None


def _to_int(member: bool, v: Any) -> int:
    if isinstance(v, bool):
        raise TypeError
    if isinstance(v, int):
        return _check_int(int(v))
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v) or not _INT_MIN <= v < 2.0**63:
            raise _RuntimeError("double is out of range for int")
        return int(v)
    if isinstance(v, str):
        try:
            return _check_int(int(v, 10))
        except ValueError:
            raise _RuntimeError(f'strconv.ParseInt: parsing "{v}": invalid syntax') from None
    raise TypeError


def _to_uint(member: bool, v: Any) -> _UInt:
    if isinstance(v, bool):
        raise TypeError
    if isinstance(v, int):
        if not 0 <= v <= _UINT_MAX:
            raise _RuntimeError("unsigned integer overflow")
        return _UInt(v)
    if isinstance(v, float):
        if math.isnan(v) or not 0 <= v < 2.0**64:
            raise _RuntimeError("double is out of range for uint")
        return _UInt(int(v))
    if isinstance(v, str):
        try:
            return _check_uint(int(v, 10))
        except ValueError:
            raise _RuntimeError(f'strconv.ParseUint: parsing "{v}": invalid syntax') from None
    raise TypeError


def _to_double(member: bool, v: Any) -> float:
    if isinstance(v, bool):
        raise TypeError
    if isinstance(v, int | float):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            raise _RuntimeError(f'strconv.ParseFloat: parsing "{v}": invalid syntax') from None
    raise TypeError


def _to_string(member: bool, v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | str):
        return str(v)
    if isinstance(v, float):
        return _format_double(v)
    if isinstance(v, bytes):
        try:
            return v.decode("utf-8")
        except UnicodeDecodeError:
            raise _RuntimeError("invalid UTF-8 in bytes, cannot convert to string") from None
    raise TypeError


def _format_double(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    text = repr(v)
    if text.endswith(".0"):
        text = text[:-2]
    return text


def _to_bytes(member: bool, v: Any) -> bytes:
    if isinstance(v, bytes):
        return v
    return _s(v).encode("utf-8")


def _to_bool(member: bool, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    text = _s(v)
    if text in ("true", "True", "TRUE", "t", "1"):
        return True
    if text in ("false", "False", "FALSE", "f", "0"):
        return False
    raise _RuntimeError("type conversion error from 'string' to 'bool'")


def _dyn(member: bool, v: Any) -> Any:
    return v


def _type(member: bool, v: Any) -> _TypeValue:
    return _TypeValue(_type_name(v))


# strings extension: indices count Unicode code points, as cel-go does.


def _char_at(member: bool, s: Any, i: Any) -> str:
    text, index = _s(s), _i(i)
    if index < 0 or index > len(text):
        raise _RuntimeError(f"index out of range: {index}")
    return text[index : index + 1]


def _index_of(member: bool, s: Any, sub: Any, *start: Any) -> int:
    if isinstance(s, list):
        return _list_index_of(s, sub, last=False)
    text, part = _s(s), _s(sub)
    offset = _i(start[0]) if start else 0
    if offset < 0 or offset > len(text):
        raise _RuntimeError(f"index out of range: {offset}")
    return text.find(part, offset)


def _last_index_of(member: bool, s: Any, sub: Any, *end: Any) -> int:
    if isinstance(s, list):
        return _list_index_of(s, sub, last=True)
    text, part = _s(s), _s(sub)
    offset = _i(end[0]) if end else len(text)
    if offset < 0 or offset > len(text):
        raise _RuntimeError(f"index out of range: {offset}")
    return text.rfind(part, 0, offset + len(part))


def _list_index_of(items: list[Any], value: Any, *, last: bool) -> int:
    indices = range(len(items) - 1, -1, -1) if last else range(len(items))
    for index in indices:
        if _equal(items[index], value):
            return index
    return -1


_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")
_ASCII_UPPER = str.maketrans("abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ")


def _lower(member: bool, s: Any) -> str:
    return _s(s).translate(_ASCII_LOWER)


def _upper(member: bool, s: Any) -> str:
    return _s(s).translate(_ASCII_UPPER)


def _replace(member: bool, s: Any, old: Any, new: Any, *n: Any) -> str:
    count = _i(n[0]) if n else -1
    text, a, b = _s(s), _s(old), _s(new)
    result = text.replace(a, b) if count < 0 else text.replace(a, b, count)
    if len(result) > MAX_LIST:
        raise _RuntimeError("operation cancelled: actual cost limit exceeded")
    return result


def _split(member: bool, s: Any, sep: Any, *n: Any) -> list[str]:
    text, separator = _s(s), _s(sep)
    limit = _i(n[0]) if n else -1
    if limit == 0:
        return []
    if separator == "":
        parts = list(text)
        if limit > 0 and len(parts) > limit:
            parts = [*parts[: limit - 1], "".join(parts[limit - 1 :])]
        return parts
    return text.split(separator, limit - 1) if limit > 0 else text.split(separator)


def _substring(member: bool, s: Any, start: Any, *end: Any) -> str:
    text = _s(s)
    begin = _i(start)
    stop = _i(end[0]) if end else len(text)
    if begin < 0 or begin > len(text):
        raise _RuntimeError(f"index out of range: {begin}")
    if stop < 0 or stop > len(text):
        raise _RuntimeError(f"index out of range: {stop}")
    if begin > stop:
        raise _RuntimeError(f"invalid substring range. start: {begin}, end: {stop}")
    return text[begin:stop]


_UNICODE_SPACE = " \t\n\v\f\r\x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009"
_UNICODE_SPACE += "\u200a\u2028\u2029\u202f\u205f\u3000"


def _trim(member: bool, s: Any) -> str:
    return _s(s).strip(_UNICODE_SPACE)


def _join(member: bool, items: Any, *sep: Any) -> str:
    parts = _l(items)
    _want(all(isinstance(p, str) for p in parts))
    return (_s(sep[0]) if sep else "").join(parts)


def _quote(member: bool, s: Any) -> str:
    out = []
    for ch in _s(s):
        if ch in "\a\b\f\n\r\t\v":
            out.append("\\" + "abfnrtv"["\a\b\f\n\r\t\v".index(ch)])
        elif ch in '\\"':
            out.append("\\" + ch)
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


_FORMAT = re.compile(r"%(?:\.(\d+))?([sdfeoxXb%])")


def _format(member: bool, fmt: Any, args: Any) -> str:
    text, values = _s(fmt), _l(args)
    out: list[str] = []
    used = 0
    last = 0
    for m in _FORMAT.finditer(text):
        out.append(text[last : m.start()])
        last = m.end()
        verb = m.group(2)
        if verb == "%":
            out.append("%")
            continue
        if used >= len(values):
            raise _RuntimeError(f"index {used} out of range")
        value = values[used]
        used += 1
        precision = int(m.group(1)) if m.group(1) else None
        if verb == "s":
            out.append(_format_s(value))
        elif verb == "d":
            _want(_is_num(value) and not isinstance(value, float))
            out.append(str(value))
        elif verb in "fe":
            _want(_is_num(value))
            digits = 6 if precision is None else precision
            out.append(f"{float(value):.{digits}{verb}}")
        elif verb in "xX":
            if isinstance(value, str | bytes):
                data = value.encode() if isinstance(value, str) else value
                hexed = data.hex()
            else:
                _want(isinstance(value, int) and not isinstance(value, bool))
                hexed = format(value, "x")
            out.append(hexed.upper() if verb == "X" else hexed)
        elif verb == "o":
            _want(isinstance(value, int) and not isinstance(value, bool))
            out.append(format(value, "o"))
        elif verb == "b":
            _want(isinstance(value, int))
            out.append(format(int(value), "b") if not isinstance(value, bool) else _show(value))
    out.append(text[last:])
    return "".join(out)


def _format_s(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_format_s(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_format_s(k)}: {_format_s(v)}" for k, v in value.items()) + "}"
    if isinstance(value, float):
        return _format_double(value)
    if value is None:
        return "null"
    if isinstance(value, CelQuantity):
        return value.quantity.canonical()
    if isinstance(value, CelSemver):
        return value.text
    if isinstance(value, _TypeValue):
        return value.name
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return _show(value)


# sets extension


def _sets_contains(member: bool, a: Any, b: Any) -> bool:
    left = _l(a)
    return all(any(_equal(x, y) for y in left) for x in _l(b))


def _sets_equivalent(member: bool, a: Any, b: Any) -> bool:
    return _sets_contains(member, a, b) and _sets_contains(member, b, a)


def _sets_intersects(member: bool, a: Any, b: Any) -> bool:
    right = _l(b)
    return any(any(_equal(x, y) for y in right) for x in _l(a))


# Kubernetes lists library


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


# Kubernetes regex library


def _find(member: bool, s: Any, pattern: Any) -> str:
    found = _re(pattern).search(_s(s))
    return "" if found is None else str(found.group(0))


def _find_all(member: bool, s: Any, pattern: Any, *n: Any) -> list[str]:
    limit = _i(n[0]) if n else -1
    if limit == 0:
        return []
    found = [m.group(0) for m in _re(pattern).finditer(_s(s))]
    return found[:limit] if limit > 0 else found


# Kubernetes quantity library

_QUANTITY_ERROR = (
    "quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"
)


def _quantity(member: bool, text: Any) -> CelQuantity:
    try:
        return CelQuantity(Quantity.parse(_s(text)))
    except QuantityError:
        raise _RuntimeError(_QUANTITY_ERROR) from None


def _is_quantity(member: bool, text: Any) -> bool:
    try:
        Quantity.parse(_s(text))
    except QuantityError:
        return False
    return True


def _q(value: Any) -> Quantity:
    _want(isinstance(value, CelQuantity))
    return value.quantity  # type: ignore[no-any-return]


def _sign(member: bool, a: Any) -> int:
    value = _q(a).value
    return (value > 0) - (value < 0)


def _as_integer(member: bool, a: Any) -> int:
    value = _q(a).value
    if value.denominator != 1 or not _INT_MIN <= value <= _INT_MAX:
        raise _RuntimeError("cannot convert value to integer")
    return value.numerator


def _as_float(member: bool, a: Any) -> float:
    return float(_q(a).value)


def _is_integer(member: bool, a: Any) -> bool:
    value = _q(a).value
    return value.denominator == 1 and _INT_MIN <= value <= _INT_MAX


def _plus_minus(sign: int) -> Callable[..., CelQuantity]:
    def op(member: bool, a: Any, b: Any) -> CelQuantity:
        q = _q(a)
        other = b.quantity.value if isinstance(b, CelQuantity) else Fraction(_i(b))
        return CelQuantity(Quantity(q.value + sign * other, q.format))

    return op


def _compare_to(member: bool, a: Any, b: Any) -> int:
    _want(type(a) is type(b) and isinstance(a, CelQuantity | CelSemver))
    return int(a.cmp(b))


def _greater(member: bool, a: Any, b: Any) -> bool:
    return _compare_to(member, a, b) > 0


def _less(member: bool, a: Any, b: Any) -> bool:
    return _compare_to(member, a, b) < 0


# Kubernetes semver library, version 1


def _normalized(text: str) -> str:
    text = text.removeprefix("v")
    parts = text.split(".", 2)
    for i, part in enumerate(parts):
        if len(part) > 1:
            stripped = part.lstrip("0")
            parts[i] = stripped if stripped[:1].isdigit() else "0" + stripped
    if len(parts) < 3:
        if any(c in parts[-1] for c in "+-"):
            raise _RuntimeError("short version cannot contain PreRelease/Build meta data")
        parts += ["0"] * (3 - len(parts))
    return ".".join(parts)


def _semver_error(text: str) -> str:
    core = text.split("+", maxsplit=1)[0].split("-", maxsplit=1)[0]
    if core.count(".") != 2:
        return "No Major.Minor.Patch elements found"
    return f"Invalid semantic version: {text}"


def _semver(member: bool, text: Any, *normalize: Any) -> CelSemver:
    value = _s(text)
    if normalize:
        _want(isinstance(normalize[0], bool))
        if normalize[0]:
            value = _normalized(value)
    try:
        return CelSemver(value)
    except ValueError:
        raise _RuntimeError(_semver_error(value)) from None


def _is_semver(member: bool, text: Any, *normalize: Any) -> bool:
    try:
        _semver(member, text, *normalize)
    except _RuntimeError:
        return False
    return True


def _part(index: int) -> Callable[..., int]:
    def part(member: bool, v: Any) -> int:
        _want(isinstance(v, CelSemver))
        return int(v.parts[index])

    return part


def _binary(name: str) -> Callable[..., Any]:
    def op(member: bool, a: Any, b: Any) -> Any:
        if name == "_==_":
            return _equal(a, b)
        if name == "_!=_":
            return not _equal(a, b)
        if name == "@in":
            if isinstance(b, list):
                return any(_equal(a, x) for x in b)
            if isinstance(b, dict):
                return any(_equal(a, k) for k in b)
            raise TypeError
        if name == "_[_]":
            if isinstance(a, list):
                if not (_is_num(b) and float(b).is_integer()):
                    raise TypeError
                index = int(b)
                if not 0 <= index < len(a):
                    raise _RuntimeError(f"index '{index}' out of range in list size '{len(a)}'")
                return a[index]
            if isinstance(a, dict):
                for key in a:
                    if _equal(key, b):
                        return a[key]
                if isinstance(a, _DomainMap):
                    return {}
                raise _RuntimeError(f"no such key: {_show(b)}")
            raise TypeError
        if name in ("_<_", "_<=_", "_>_", "_>=_"):
            c = _compare(a, b)
            return {"_<_": c < 0, "_<=_": c <= 0, "_>_": c > 0, "_>=_": c >= 0}[name]
        return _arith(name, a, b)

    return op


def _not(member: bool, v: Any) -> bool:
    _want(isinstance(v, bool))
    return not v


def _neg(member: bool, v: Any) -> Any:
    _want(_is_num(v) and not isinstance(v, _UInt))
    return -v if isinstance(v, float) else _check_int(-v)


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


def _cel_attribute(value: AttributeValue | Mapping[str, Any]) -> Any:
    if isinstance(value, Mapping):
        # The API shape: {"string": ...} / {"int": ...} / {"bool": ...} / {"version": ...}.
        ((kind, raw),) = value.items()
        if kind == "version":
            return CelSemver(str(raw))
        if kind == "int":
            return int(raw)
        if kind == "bool":
            return bool(raw)
        value = raw
    if isinstance(value, bool | int):
        return value
    if isinstance(value, Version):
        return CelSemver(value.value)
    return str(value)


def _cel_capacity(value: Quantity | Mapping[str, Any] | str) -> CelQuantity:
    if isinstance(value, Quantity):
        return CelQuantity(value)
    if isinstance(value, Mapping):
        return CelQuantity(Quantity.parse(str(value["value"])))
    return CelQuantity(Quantity.parse(str(value)))


def _grouped(items: Mapping[str, Any], driver: str, convert: Callable[[Any], Any]) -> _DomainMap:
    groups = _DomainMap()
    for name, value in items.items():
        domain, sep, ident = str(name).partition("/")
        if not sep:
            domain, ident = driver, str(name)
        groups.setdefault(domain, {})[ident] = convert(value)
    return groups


def _device_fields(
    device: Device | Mapping[str, Any], driver: str | None
) -> tuple[str, Mapping[str, Any], Mapping[str, Any]]:
    if isinstance(device, Device):
        return device.driver, device.attributes, device.capacity
    body = device.get("basic", device)
    if not driver:
        raise CelError("a slice device dict needs the slice's driver: matches(expr, device, driver=...)")
    return driver, body.get("attributes") or {}, body.get("capacity") or {}


def _activation(device: Device | Mapping[str, Any], driver: str | None) -> dict[str, Any]:
    drv, attributes, capacity = _device_fields(device, driver)
    try:
        attrs = _grouped(attributes, drv, _cel_attribute)
        caps = _grouped(capacity, drv, _cel_capacity)
    except (ValueError, QuantityError, TypeError, KeyError) as error:
        raise CelError(f"device {drv}: an attribute or capacity is not valid: {error}") from None
    return {"device": {"driver": drv, "attributes": attrs, "capacity": caps}}


def matches(expression: str, device: Device | Mapping[str, Any], driver: str | None = None) -> bool:
    """Evaluate the CEL device selector `expression` on `device`.

    `device` is an `agent.core.model.Device` or a slice device dict (then `driver` is required).
    Raises `CelError` (with the scheduler's message) when the expression does not compile, fails
    at runtime or returns something other than a bool.
    """
    program = _program(expression)
    scope = _activation(device, driver)
    try:
        result = _Interpreter(_Cost()).eval(program.ast, scope)
    except _RuntimeError as error:
        raise CelError(error.message) from None
    except RecursionError:
        raise CelError("operation cancelled: actual cost limit exceeded") from None
    if not isinstance(result, bool):
        name = _type_name(result)
        raise CelError(
            f"CEL result of type {name} could not be converted to bool: "
            f"type conversion error from '{name}' to 'bool'"
        )
    return result


def match_attribute(name: str, devices: Sequence[Device]) -> bool:
    """The ``matchAttribute`` constraint: all `devices` have attribute `name`, all equal.

    `name` is fully qualified (``resource.kubernetes.io/pcieRoot``) or in the driver's domain
    (``gpu.nvidia.com/productName``); the driver's own attributes are stored without domain.
    """
    values: list[AttributeValue] = []
    for device in devices:
        domain, _, ident = name.rpartition("/")
        value = device.attributes.get(name)
        if value is None and domain == device.driver:
            value = device.attributes.get(ident)
        if value is None:
            return False
        values.append(value)
    return all(v == values[0] for v in values)


def compile_check(expression: str) -> None:
    """Raise `CelCompileError` when the scheduler would not compile `expression`."""
    _program(expression)


_REFERENCE = re.compile(r"""device\.(attributes|capacity)\[\s*["']([^"']+)["']\s*\]\.([A-Za-z_]\w*)""")


def referenced_values(
    expression: str, device: Device | Mapping[str, Any], driver: str | None = None
) -> dict[str, str]:
    """``domain/name`` -> the value `expression` reads from `device` (``<absent>`` when missing)."""
    drv, attributes, capacity = _device_fields(device, driver)
    seen: dict[str, str] = {}
    if "device.driver" in expression:
        seen["driver"] = drv
    for kind, domain, ident in _REFERENCE.findall(expression):
        table = attributes if kind == "attributes" else capacity
        value = table.get(f"{domain}/{ident}")
        if value is None and domain == drv:
            value = table.get(ident)
        seen[f"{domain}/{ident}"] = "<absent>" if value is None else _cap(_text(value))
    return seen


def _text(value: Any) -> str:
    if isinstance(value, Mapping):
        if "value" in value:
            return str(value["value"])
        ((_, raw),) = value.items()
        return str(raw)
    if isinstance(value, Quantity):
        return value.canonical()
    return str(value)


def _iter_nodes(node: _Node) -> Iterator[_Node]:  # for tests and debugging
    yield node
    for child in vars(node).values():
        if isinstance(child, _Node):
            yield from _iter_nodes(child)
        elif isinstance(child, tuple):
            for c in child:
                if isinstance(c, _Node):
                    yield from _iter_nodes(c)
                elif isinstance(c, tuple):
                    for cc in c:
                        if isinstance(cc, _Node):
                            yield from _iter_nodes(cc)
