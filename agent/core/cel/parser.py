"""cel-python's lark parse tree -> our syntax tree (`agent.core.cel.ast`), macros expanded.

Source offsets are kept as cel-go reports them, so compile errors point where the scheduler's do.
"""

from __future__ import annotations

import re
from typing import Any

import lark

from agent.core.cel.ast import _Call, _Comprehension, _Ident, _ListLit, _Lit, _MapLit, _Node, _Select
from agent.core.cel.values import _INT_MAX, _INT_MIN, _UINT_MAX, _UInt

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
