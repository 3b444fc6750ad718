"""Run each case through agent.core.cel and through the cel-go referee (``referee/``), and compare.

The referee is the scheduler's engine (cel-go v0.26 in the Kubernetes 1.36 selector
environment), so here the suite's own answer does not matter: outcome (value, compile error,
runtime error), value, error text and runtime cost are each compared with the referee's.
"""

from __future__ import annotations

import base64
import json
import math
import subprocess
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agent.core.cel import CelCompileError, CelError, CelType, CelUint, evaluate
from agent.core.cel.errors import MAX_MESSAGE
from agent.core.cel.values import _type_name
from benchmarks.cel_conformance.cases import Case, same, show


class Unsendable(ValueError):
    """A case value the referee's JSON tags cannot carry."""


def encode(value: Any) -> Any:
    """A Python CEL value as the referee's tagged JSON."""
    if isinstance(value, bool):
        return {"bool": value}
    if isinstance(value, CelUint):
        return {"uint": str(int(value))}
    if isinstance(value, int):
        return {"int": str(value)}
    if isinstance(value, float):
        return {"double": value if math.isfinite(value) else repr(value)}
    if isinstance(value, str):
        return {"string": value}
    if isinstance(value, bytes):
        return {"bytes": base64.b64encode(value).decode()}
    if value is None:
        return {"null": None}
    if isinstance(value, list):
        return {"list": [encode(v) for v in value]}
    if isinstance(value, dict):
        return {"map": [[encode(k), encode(v)] for k, v in value.items()]}
    raise Unsendable(f"cannot send a {type(value).__name__} to the referee")


def decode(tagged: Mapping[str, Any]) -> Any:
    """The referee's tagged JSON as a Python CEL value (``other`` values stay tagged)."""
    ((tag, body),) = tagged.items()
    if tag in ("bool", "string"):
        return body
    if tag == "int":
        return int(body)
    if tag == "uint":
        return CelUint(int(body))
    if tag == "double":
        return float(body)
    if tag == "bytes":
        return base64.b64decode(body)
    if tag == "null":
        return None
    if tag == "type":
        return CelType(body)
    if tag == "list":
        return [decode(v) for v in body]
    if tag == "map":
        return {_hashable(decode(k)): decode(v) for k, v in body}
    return {"other": body}


def _hashable(key: Any) -> Any:
    return tuple(key) if isinstance(key, list) else key


def _declaration(t: Any) -> Any:
    return [_declaration(x) for x in t] if isinstance(t, tuple) else t


@dataclass(frozen=True)
class Verdict:
    case: Case
    ours: str
    theirs: str
    agrees: bool
    """Same outcome kind and, for a value, the same value."""
    message: bool | None = None
    """Both failed the same way: whether the error texts are equal."""
    cost: bool | None = None
    """Both gave a value: whether the runtime costs are equal."""


def _ours(case: Case) -> tuple[str, Any, str, int | None]:
    try:
        result = evaluate(case.expr, case.variables, case.declarations)
    except CelCompileError as error:
        return "compile error", None, str(error), None
    except CelError as error:
        return "error", None, str(error), None
    return "value", result.value, "", result.cost


def _same_value(ours: Any, theirs: Any) -> bool:
    if isinstance(theirs, dict) and set(theirs) == {"other"}:
        # Quantities, semvers, ...: the referee gives the type and Go's text; the type must match.
        return str(theirs["other"]).split(":", 1)[0] == _type_name(ours)
    return same(ours, theirs)


def _same_message(ours: str, theirs: str) -> bool:
    """Equal texts; ours may be cut at MAX_MESSAGE (ending ``...``) where cel-go's is longer."""
    return ours == theirs or (
        ours.endswith("...") and len(ours) == MAX_MESSAGE and theirs.startswith(ours[:-3])
    )


def crosscheck(cases: list[Case], referee: str) -> list[Verdict]:
    sendable: list[tuple[Case, str]] = []
    for case in cases:
        try:
            request = {
                "expr": case.expr,
                "declarations": {k: _declaration(v) for k, v in case.declarations.items()},
                "variables": {k: encode(v) for k, v in case.variables.items()},
            }
        except Unsendable:
            continue
        sendable.append((case, json.dumps(request)))
    done = subprocess.run(
        [referee],
        input="\n".join(line for _, line in sendable) + "\n",
        capture_output=True,
        text=True,
        check=True,
    )
    answers = [json.loads(line) for line in done.stdout.splitlines()]
    verdicts = []
    for (case, _), answer in zip(sendable, answers, strict=True):
        kind, value, message, cost = _ours(case)
        theirs_kind = answer["outcome"]
        theirs_value = decode(answer["value"]) if theirs_kind == "value" else None
        ours_text = f"{kind}: {f'{show(value)} (cost {cost})' if kind == 'value' else message}"
        theirs_cost, theirs_error = answer["cost"], answer.get("error", "")
        theirs_shown = (
            f"{show(theirs_value)} (cost {theirs_cost})" if theirs_kind == "value" else theirs_error
        )
        theirs_text = f"{theirs_kind}: {theirs_shown}"
        if kind != theirs_kind:
            verdicts.append(Verdict(case, ours_text, theirs_text, False))
        elif kind == "value":
            verdicts.append(
                Verdict(
                    case,
                    ours_text,
                    theirs_text,
                    _same_value(value, theirs_value),
                    cost=cost == answer["cost"],
                )
            )
        else:
            verdicts.append(
                Verdict(case, ours_text, theirs_text, True, message=_same_message(message, theirs_error))
            )
    return verdicts


def report(verdicts: list[Verdict], failures: bool) -> None:
    rows: dict[str, list[Verdict]] = defaultdict(list)
    for v in verdicts:
        rows[v.case.suite].append(v)
    header = ("suite", "run", "agree", "differ", "messages", "cost")
    print(f"{header[0]:28} " + " ".join(f"{h:>9}" for h in header[1:]))
    totals = [0] * 7
    for suite, done in [*rows.items()]:
        messages = [v.message for v in done if v.message is not None]
        costs = [v.cost for v in done if v.cost is not None]
        agree = sum(v.agrees for v in done)
        row = [len(done), agree, len(done) - agree, sum(messages), len(messages), sum(costs), len(costs)]
        totals = [t + r for t, r in zip(totals, row, strict=True)]
        _row(suite, row)
    _row("total", totals)
    if failures:
        print("\nDifferences (ours, then the referee's):")
        for v in verdicts:
            if not v.agrees or v.message is False or v.cost is False:
                what = "outcome" if not v.agrees else "message" if v.message is False else "cost"
                print(f"- [{what}] {v.case.name}: {v.case.expr!r}")
                print(f"    ours:    {_clip(v.ours)}\n    referee: {_clip(v.theirs)}")


def _clip(text: str) -> str:
    one = text.replace("\n", "\\n")
    return one if len(one) < 400 else one[:400] + "..."


def _row(name: str, r: list[int]) -> None:
    cells = [r[0], r[1], r[2], f"{r[3]}/{r[4]}", f"{r[5]}/{r[6]}"]
    print(f"{name:28} " + " ".join(f"{c:>9}" for c in cells))
