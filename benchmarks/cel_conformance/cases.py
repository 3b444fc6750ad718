"""A conformance case, how one is run through agent.core.cel, and how its outcome is judged."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from agent.core.cel import CelCompileError, CelError, CelType, CelUint, evaluate


@dataclass(frozen=True)
class Case:
    suite: str
    name: str
    expr: str
    expect: str = "value"
    """``value`` (`value` is the result), ``error`` (any error; `error` a text it should contain),
    ``any`` (a result, whatever it is: the suite states only its cost)."""
    value: Any = True
    error: str = ""
    declarations: Mapping[str, Any] = field(default_factory=dict)
    variables: Mapping[str, Any] = field(default_factory=dict)
    cost: int | None = None
    """cel-go's actual cost, where the suite states it."""
    left_out: str = ""
    """Why the case is not run (protobuf messages, timestamps, optional types, ...)."""
    checked: bool = True
    """False where the suite evaluates without type-checking (the scheduler always checks)."""
    scheduler: str = ""
    """Where the scheduler's cel-go is known to answer otherwise than the suite: the source that
    says so (then a disagreement counts under ``env``)."""


@dataclass(frozen=True)
class Outcome:
    case: Case
    agrees: bool
    got: str
    message_agrees: bool | None = None
    """For an expected error with a stated text: whether our message contains it."""
    cost: int | None = None
    environment: str = ""
    """Where the case disagrees because the scheduler's environment rejects what the suite runs:
    the rule (``homogeneous literals``, ``always type-checked``)."""


def _environment(case: Case, error: CelError) -> str:
    """The Kubernetes environment rule a compile error stems from, where the suite assumes another."""
    text = str(error)
    if not isinstance(error, CelCompileError):
        return ""
    if "expected type '" in text and "but found '" in text:
        return "homogeneous literals"  # cel.HomogeneousAggregateLiterals in the base environment
    if "found no matching overload for 'reverse' applied to 'string" in text:
        return "strings version 2"  # string reverse() came with version 3
    if not case.checked and not text.startswith("compilation failed: ERROR: <input>:1:1: Syntax"):
        return "always type-checked"
    return ""


def run(case: Case) -> Outcome:
    try:
        # The costs the suites state are of programs planned without cel-go's OptOptimize.
        result = evaluate(case.expr, case.variables, case.declarations, optimize=case.cost is None)
    except CelError as error:
        kind = "compile error" if isinstance(error, CelCompileError) else "error"
        got = f"{kind}: {str(error).splitlines()[0]}"
        if case.expect != "error":
            return Outcome(case, False, got, environment=_environment(case, error) or case.scheduler)
        # A text the suite states for an unchecked or environment-rejected case is not the scheduler's.
        stated = case.error and case.checked and not _environment(case, error)
        message = case.error.lower() in str(error).lower() if stated else None
        return Outcome(case, True, got, message)
    got = f"value: {show(result.value)}"
    cost = result.cost if case.cost is not None else None
    agrees = case.expect != "error" and (case.expect == "any" or same(result.value, case.value))
    return Outcome(case, agrees, got, cost=cost, environment="" if agrees else case.scheduler)


def same(a: Any, b: Any) -> bool:
    """CEL equality of results, with their types: 1 is not 1u nor 1.0; NaN is NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return len(a) == len(b) and all(any(same(k, k2) and same(v, b[k2]) for k2 in b) for k, v in a.items())
    return bool(a == b)


def show(value: Any) -> str:
    if isinstance(value, CelUint):
        return f"{int(value)}u"
    if isinstance(value, CelType):
        return f"type({value.name})"
    if isinstance(value, list):
        return "[" + ", ".join(show(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{show(k)}: {show(v)}" for k, v in value.items()) + "}"
    return repr(value)
