"""Compiling an expression: parse, type-check and validate it as the scheduler does, cached.

The scheduler (k8s.io/dynamic-resource-allocation/cel/compile.go) reports parse and check errors
as ``compilation failed: ERROR: ...``, the result type as ``must evaluate to bool or the unknown
type, not T``, and a failure to build the program (a constant regex that does not compile for
``find``/``findAll``) as ``program instantiation failed: ...``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from agent.core.cel.ast import _Node
from agent.core.cel.checker import _Checker
from agent.core.cel.errors import MAX_EXPRESSION, CelCompileError, _located
from agent.core.cel.names import _qualify
from agent.core.cel.parser import _parse, _SyntaxError
from agent.core.cel.types import _DEVICE, _T, _fmt, _is_dyn
from agent.core.cel.validators import _plan_errors, _validate

_SELECTOR_SCOPE: tuple[tuple[str, _T], ...] = (("device", _DEVICE),)


@dataclass(frozen=True)
class _Program:
    source: str
    ast: _Node
    output: _T


@functools.lru_cache(maxsize=512)
def _program(
    expression: str, declarations: tuple[tuple[str, _T], ...] = _SELECTOR_SCOPE, *, boolean: bool = True
) -> _Program:
    """The checked program of `expression` with the variables `declarations`.

    `boolean`: the result must be a bool (or dyn), as for a device selector.
    """
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
    output: _T = "dyn"
    if not errors:
        ast = _qualify(ast, [name for name, _ in declarations])
        checker = _Checker()
        output = checker.check(ast, dict(declarations))
        errors = checker.errors or _validate(ast, checker.types)
    if errors:
        text = "\n".join(_located(expression, pos, msg) for pos, msg in sorted(errors, key=lambda e: e[0]))
        raise CelCompileError(f"compilation failed: {text}")
    if boolean and not (_is_dyn(output) or output == "bool"):
        raise CelCompileError(f"must evaluate to bool or the unknown type, not {_fmt(output)}")
    planned = _plan_errors(ast)
    if planned:
        raise CelCompileError(f"program instantiation failed: {planned}")
    return _Program(expression, ast, output)
