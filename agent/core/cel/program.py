"""Compiling an expression: parse, build the syntax tree and type-check it, cached per expression."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from agent.core.cel.ast import _Node
from agent.core.cel.checker import _Checker
from agent.core.cel.errors import MAX_EXPRESSION, CelCompileError, _located
from agent.core.cel.parser import _parse, _SyntaxError
from agent.core.cel.types import _fmt, _is_dyn


@dataclass(frozen=True)
class _Program:
    source: str
    ast: _Node


@functools.lru_cache(maxsize=512)
def _program(expression: str) -> _Program:
    if len(expression) > MAX_EXPRESSION:
        raise CelCompileError(
            f"compilation failed: expression is {len(expression)} characters, more than {MAX_EXPRESSION}"
        )
    try:
        ast, errors = _parse(expression)
    except _SyntaxError as error:
        located = _located(expression, error.pos, error.message)
        raise CelCompileError(f"compilation failed: {located}") from None
    except RecursionError:
        raise CelCompileError("compilation failed: expression nests too deeply") from None
    checker = _Checker()
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
