"""Compiling an expression: parse, build the syntax tree and type-check it, cached per expression."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import lark
from celpy.celparser import CELParseError, CELParser

from agent.core.cel.ast import _Node
from agent.core.cel.checker import _Checker
from agent.core.cel.errors import MAX_EXPRESSION, CelCompileError, _located, _syntax_error
from agent.core.cel.parser import _Builder
from agent.core.cel.types import _fmt, _is_dyn


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
