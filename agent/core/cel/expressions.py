"""Any CEL expression, with variables of declared types: the value and cel-go's runtime cost.

For tools and the conformance runner (benchmarks/cel_conformance): the same parser, checker and
interpreter as device selectors, without the ``device`` variable or the bool result.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agent.core.cel.errors import COST_LIMIT, CelError, _RuntimeError
from agent.core.cel.evaluator import _Cost, _Interpreter
from agent.core.cel.program import _program


@dataclass(frozen=True)
class Evaluation:
    value: Any
    """The CEL value: bool, int, `CelUint`, float, str, bytes, list, dict, None, `CelType`, ..."""
    cost: int
    """cel-go's actual runtime cost."""


def evaluate(
    expression: str,
    variables: Mapping[str, Any] | None = None,
    declarations: Mapping[str, Any] | None = None,
    *,
    cost_limit: int = COST_LIMIT,
    optimize: bool = True,
) -> Evaluation:
    """Compile `expression` with `declarations` (name -> type) and evaluate it with `variables`.

    A type is ``"int"``, ``"uint"``, ``"double"``, ``"bool"``, ``"string"``, ``"bytes"``,
    ``"null_type"``, ``"dyn"``, ``("list", T)`` or ``("map", K, V)``. Raises `CelCompileError` or
    `CelError` (a runtime error) with cel-go's message. `optimize`: plan as the scheduler does
    (cel-go's ``OptOptimize``: constant literals and conversions folded, so they cost nothing); the
    costs cel-go's and Kubernetes' own tests state are without it.
    """
    decls = tuple(sorted((declarations or {}).items()))
    program = _program(expression, decls, boolean=False)
    cost = _Cost(cost_limit)
    try:
        value = _Interpreter(cost, optimize=optimize).eval(program.ast, dict(variables or {}))
    except _RuntimeError as error:
        raise CelError(error.message) from None
    except RecursionError:
        raise CelError("operation cancelled: actual cost limit exceeded") from None
    return Evaluation(value, cost.spent)
