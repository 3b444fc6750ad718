"""CEL's grammar (cel-spec doc/langdef.md; cel-go parser/gen/CEL.g4) -> our syntax tree.

A recursive-descent parser over `agent.core.cel.lexer`'s tokens. Source offsets are kept as cel-go
reports them (an operator at its token, a call at its ``(``, a select at its ``.``), so compile
errors point where the scheduler's do. Macros are expanded by `agent.core.cel.macros`.
"""

from __future__ import annotations

from agent.core.cel.ast import _Call, _Ident, _ListLit, _Lit, _MapLit, _Node, _Select
from agent.core.cel.lexer import (
    _RESERVED,
    _int_literal,
    _LexError,
    _Token,
    _tokenize,
    _uint_literal,
    _unquote,
)
from agent.core.cel.macros import _global_macro, _receiver_macro

_RELATIONS = {"<": "_<_", "<=": "_<=_", ">": "_>_", ">=": "_>=_", "==": "_==_", "!=": "_!=_", "in": "@in"}
_ADDITIVE = {"+": "_+_", "-": "_-_"}
_MULTIPLICATIVE = {"*": "_*_", "/": "_/_", "%": "_%_"}
_LEVELS = (_RELATIONS, _ADDITIVE, _MULTIPLICATIVE)
_NAMESPACED = frozenset(
    {"sets.contains", "sets.equivalent", "sets.intersects", "strings.quote", "lists.range"}
)
_OPTIONAL = "optional types ('.?', '[?', '{?') are in the scheduler's environment, but not evaluated here"


class _SyntaxError(Exception):
    def __init__(self, pos: int, message: str) -> None:
        super().__init__(message)
        self.pos = pos
        self.message = message


class _Parser:
    def __init__(self, source: str) -> None:
        self.source = source
        try:
            self.tokens = _tokenize(source)
        except _LexError as error:
            raise _SyntaxError(error.pos, error.message) from None
        self.at = 0
        self.errors: list[tuple[int, str]] = []

    # --------------------------------------------------------------------------- tokens
    def peek(self, ahead: int = 0) -> _Token:
        return self.tokens[min(self.at + ahead, len(self.tokens) - 1)]

    def is_op(self, text: str, ahead: int = 0) -> bool:
        token = self.peek(ahead)
        return token.kind == "op" and token.text == text

    def take(self) -> _Token:
        token = self.peek()
        self.at = min(self.at + 1, len(self.tokens) - 1)
        return token

    def expect(self, text: str) -> _Token:
        if not self.is_op(text):
            self.mismatch()
        return self.take()

    def mismatch(self) -> None:
        token = self.peek()
        raise _SyntaxError(token.pos, f"Syntax error: mismatched input '{token.text[:40]}'")

    def error(self, pos: int, message: str) -> _Node:
        self.errors.append((pos, message))
        return _Lit(pos, None)

    # ---------------------------------------------------------------------------- rules
    def parse(self) -> _Node:
        node = self.expr()
        if self.peek().kind != "eof":
            token = self.peek()
            raise _SyntaxError(token.pos, f"Syntax error: extraneous input '{token.text[:40]}'")
        return node

    def expr(self) -> _Node:
        cond = self.logical("||")
        if self.is_op("?"):
            pos = self.take().pos
            then = self.logical("||")
            self.expect(":")
            other = self.expr()
            cond = _Call(pos, "_?_:_", None, (cond, then, other))
        return cond

    def logical(self, op: str) -> _Node:
        left = self.logical("&&") if op == "||" else self.binary(0)
        while self.is_op(op):
            pos = self.take().pos
            right = self.logical("&&") if op == "||" else self.binary(0)
            left = _Call(pos, f"_{op}_", None, (left, right))
        return left

    def binary(self, level: int) -> _Node:
        """Left-associative operators of one precedence level (`_LEVELS`, loosest first)."""
        operators = _LEVELS[level]
        left = self.operand(level)
        while self.peek().kind == "op" and self.peek().text in operators:
            token = self.take()
            left = _Call(token.pos, operators[token.text], None, (left, self.operand(level)))
        return left

    def operand(self, level: int) -> _Node:
        return self.binary(level + 1) if level + 1 < len(_LEVELS) else self.unary()

    def unary(self) -> _Node:
        token = self.peek()
        if token.kind == "op" and token.text in ("!", "-"):
            if token.text == "-" and self.peek(1).kind in ("int", "float"):
                return self.member()  # a negative literal, as cel-go's grammar reads it
            count = 0
            while self.is_op(token.text):
                self.take()
                count += 1
            operand = self.member()
            if count % 2 == 0:  # cel-go drops pairs of ! and -
                return operand
            return _Call(token.pos, "!_" if token.text == "!" else "-_", None, (operand,))
        return self.member()

    def member(self) -> _Node:
        node = self.primary()
        while True:
            if self.is_op("."):
                dot = self.take()
                optional = self.peek().pos if self.is_op("?") else -1
                if optional >= 0:  # optional types: declared by the scheduler, not evaluated here
                    self.take()
                name = self.peek()
                if name.kind not in ("ident", "escident"):
                    self.mismatch()
                self.take()
                if optional >= 0:
                    node = self.error(optional, _OPTIONAL)
                elif name.kind == "escident":  # cel-go v0.26's parser has no backquoted fields yet
                    self.errors.append((name.pos, "unsupported syntax: '`'"))
                    node = _Select(dot.pos, node, name.text)
                elif name.kind == "ident" and self.is_op("("):
                    node = self.member_call(node, name)
                else:
                    node = _Select(dot.pos, node, name.text)
            elif self.is_op("["):
                bracket = self.take()
                optional = self.take().pos if self.is_op("?") else -1
                index = self.expr()
                self.expect("]")
                node = _Call(bracket.pos, "_[_]", None, (node, index))
                if optional >= 0:
                    node = self.error(optional, _OPTIONAL)
            else:
                return node

    def member_call(self, target: _Node, name: _Token) -> _Node:
        pos = self.take().pos  # "("
        args = self.arguments(")")
        if isinstance(target, _Ident) and f"{target.name}.{name.text}" in _NAMESPACED:
            return _Call(pos, f"{target.name}.{name.text}", None, tuple(args))
        expanded = _receiver_macro(self.errors, pos, target, name.text, args)
        if expanded is not None:
            return expanded
        return _Call(pos, name.text, target, tuple(args))

    def arguments(self, close: str) -> list[_Node]:
        args: list[_Node] = []
        while not self.is_op(close):
            args.append(self.expr())
            if not self.is_op(close):
                self.expect(",")
                if self.is_op(close) and close == ")":
                    self.mismatch()
        self.take()
        return args

    def primary(self) -> _Node:
        token = self.peek()
        if token.kind == "op" and token.text == "." and self.peek(1).kind == "ident":
            self.take()
            return self.identifier(leading_dot=True)
        if token.kind == "ident":
            return self.identifier(leading_dot=False)
        if token.kind == "escident":
            self.mismatch()
        if token.kind == "op":
            if token.text == "(":
                self.take()
                node = self.expr()
                self.expect(")")
                return node
            if token.text == "[":
                self.take()
                items = self.arguments("]")
                return _ListLit(token.pos, tuple(items))
            if token.text == "{":
                return self.map_literal(message=False)
            if token.text in ("true", "false"):
                self.take()
                return _Lit(token.pos, token.text == "true")
            if token.text == "null":
                self.take()
                return _Lit(token.pos, None)
            if token.text == "-":
                self.take()
                return self.literal(self.take(), negative=True, pos=token.pos)
        if token.kind in ("int", "uint", "float", "string", "bytes"):
            return self.literal(self.take(), negative=False, pos=token.pos)
        self.mismatch()
        raise AssertionError  # mismatch() raised

    def identifier(self, *, leading_dot: bool) -> _Node:
        token = self.take()
        name = ("." if leading_dot else "") + token.text
        if token.text in _RESERVED:
            return self.error(token.pos - leading_dot, f"reserved identifier: {token.text}")
        if self.is_op("("):
            pos = self.take().pos
            args = self.arguments(")")
            expanded = _global_macro(self.errors, pos, name, args)
            return expanded if expanded is not None else _Call(pos, name, None, tuple(args))
        if self.is_op("{"):
            literal = self.map_literal(message=True)
            return self.error(literal.pos, "message construction is not supported for DRA devices")
        return _Ident(token.pos - leading_dot, name)

    def map_literal(self, *, message: bool) -> _Node:
        brace = self.take()
        entries: list[tuple[_Node, _Node]] = []
        while not self.is_op("}"):
            if self.is_op("?"):
                self.error(self.take().pos, _OPTIONAL)
            if message:  # a field initializer (``Msg{field: v}``)
                name = self.take()
                key: _Node = _Lit(name.pos, name.text)
            else:
                key = self.expr()
            self.expect(":")
            entries.append((key, self.expr()))
            if not self.is_op("}"):
                self.expect(",")
        self.take()
        return _MapLit(brace.pos, tuple(entries))

    def literal(self, token: _Token, *, negative: bool, pos: int) -> _Node:
        try:
            if token.kind == "int":
                return _Lit(pos, _int_literal(token.text, negative))
            if token.kind == "float":
                return _Lit(pos, -float(token.text) if negative else float(token.text))
            if negative:
                raise _SyntaxError(token.pos, f"Syntax error: mismatched input '{token.text[:40]}'")
            if token.kind == "uint":
                return _Lit(pos, _uint_literal(token.text))
            return _Lit(pos, _unquote(token.text, token.kind == "bytes"))
        except ValueError as error:
            return self.error(pos, str(error))


def _parse(source: str) -> tuple[_Node, list[tuple[int, str]]]:
    """The syntax tree of `source` and the errors found while building it (macros, literals).

    Raises `_SyntaxError` for text that is not CEL.
    """
    parser = _Parser(source)
    node = parser.parse()
    return node, parser.errors
