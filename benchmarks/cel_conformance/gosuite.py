"""Table-driven Go tests as `Case`s: cel-go's ext/*_test.go and Kubernetes' pkg/cel/library tests.

Each composite literal with an ``expr:`` field is a case. cel-go's convention: no ``err`` means
the expression is true; ``err`` is a text the error contains. Kubernetes': ``expectValue`` (the
simple ``types.X(..)``/``trueVal``/``falseVal`` forms) or ``expectedRuntimeErr`` /
``expectedCompileErr`` (regular expressions). Cases that need Go-declared variables (``vars``,
``in``) or Go values this reader does not parse are left out, with the reason.
"""

from __future__ import annotations

import json
import re
from typing import Any

from benchmarks.cel_conformance.cases import Case
from benchmarks.cel_conformance.textproto import unescape


def _go_string(literal: str) -> str:
    if literal.startswith("`"):
        return literal[1:-1]
    return unescape(literal[1:-1]).decode("utf-8", "surrogateescape")


_STRING = r'(?:`[^`]*`|"(?:\\.|[^"\\\n])*")'
_STRINGS = re.compile(rf"{_STRING}(?:\s*\+\s*{_STRING})*")


def _strings(text: str) -> str:
    return "".join(_go_string(m.group(0)) for m in re.finditer(_STRING, text))


def _literals(source: str) -> list[str]:
    """The bodies of every composite literal ``{...}`` in `source`, inner ones first."""
    found: list[str] = []
    stack: list[int] = []
    i = 0
    skip = re.compile(rf"{_STRING}|'(?:\\.|[^'\\])+'|//[^\n]*|/\*[\s\S]*?\*/")
    while i < len(source):
        m = skip.match(source, i)
        if m:
            i = m.end()
            continue
        if source[i] == "{":
            stack.append(i)
        elif source[i] == "}" and stack:
            start = stack.pop()
            found.append(source[start + 1 : i])
        i += 1
    return found


def _fields(body: str) -> dict[str, str]:
    """Top-level ``key: value`` pairs of a composite literal's body (values as Go text)."""
    fields: dict[str, str] = {}
    depth = 0
    key_start = 0
    current: str | None = None
    i = 0
    skip = re.compile(rf"{_STRING}|'(?:\\.|[^'\\])+'|//[^\n]*")
    while i <= len(body):
        if i < len(body):
            m = skip.match(body, i)
            if m:
                i = m.end()
                continue
        c = body[i] if i < len(body) else ","
        if c in "{([":
            depth += 1
        elif c in "})]":
            depth -= 1
        elif c == ":" and depth == 0 and current is None:
            current = re.sub(r"//[^\n]*", "", body[key_start:i]).strip()
            key_start = i + 1
        elif c == "," and depth == 0:
            if current is not None:
                fields[current] = body[key_start:i].strip()
            current = None
            key_start = i + 1
        i += 1
    return fields


_UNSUPPORTED_FIELDS = ("vars", "in", "opts", "optimized", "hints", "unparsed")
# As issue 32 counts: no optional types, protobuf messages, timestamps or durations.
_LEFT_OUT = re.compile(
    r"\[\?|\{\?|\.\?|optional\.|\.hasValue\(|\.orValue\(|\.optMap\(|\.value\(\)|\b[A-Z]\w*\{"
    r"|\btimestamp\(|\bduration\(|google\.protobuf"
)


def cases(suite: str, source: str, *, kubernetes: bool = False) -> list[Case]:
    out = []
    for index, body in enumerate(_literals(source)):
        fields = _fields(body)
        if "expr" not in fields or not _STRINGS.fullmatch(fields["expr"]):
            continue
        expr = _strings(fields["expr"])
        label = f"{suite}/{index}"
        if "name" in fields and _STRINGS.fullmatch(fields["name"]):
            label = f"{suite}/{_strings(fields['name'])}"
        cost = int(fields["actualCost"]) if fields.get("actualCost", "").isdigit() else None
        if _LEFT_OUT.search(expr):
            out.append(Case(suite, label, expr, left_out="optional types, messages, timestamps or durations"))
            continue
        needs = [f for f in _UNSUPPORTED_FIELDS if f in fields]
        if needs:
            out.append(Case(suite, label, expr, left_out=_why(needs)))
            continue
        out.append(
            _kubernetes(suite, label, expr, fields)
            if kubernetes
            else _cel_go(suite, label, expr, fields, cost)
        )
    return out


def _why(needs: list[str]) -> str:
    if "unparsed" in needs:
        return "a parse/unparse test (no evaluation)"
    return f"needs Go values ({', '.join(needs)})"


def _cel_go(suite: str, label: str, expr: str, fields: dict[str, str], cost: int | None) -> Case:
    if "out" in fields:
        value = _go_value(fields["out"])
        if value is _UNKNOWN:
            return Case(suite, label, expr, left_out="a Go result value")
        return Case(suite, label, expr, "value", value, cost=cost)
    if "err" in fields:
        # parseOnly: cel-go's test evaluates without type-checking; the scheduler always checks.
        checked = fields.get("parseOnly") != "true"
        return Case(suite, label, expr, "error", error=_strings(fields["err"]), checked=checked)
    if "actualCost" in fields or "estimatedCost" in fields:  # a cost table: the value is not stated
        return Case(suite, label, expr, "any", cost=cost)
    return Case(suite, label, expr, "value", True, cost=cost)


_OTHER_LIBRARIES = re.compile(r"\b(?:url|isURL|ip|isIP|cidr|isCIDR|authorizer|format|validate|jsonpatch)\b")


def _kubernetes(suite: str, label: str, expr: str, fields: dict[str, str]) -> Case:
    if _OTHER_LIBRARIES.search(expr):
        return Case(
            suite, label, expr, left_out="URL, IP, CIDR, authz, format or jsonpatch library (not in issue 32)"
        )
    if "expectRuntimeCost" in fields:
        cost = int(fields["expectRuntimeCost"]) if fields["expectRuntimeCost"].isdigit() else None
        return Case(suite, label, expr, "any", cost=cost)
    if "expectedRuntimeErr" in fields or "expectedCompileErr" in fields:
        pattern = fields.get("expectedRuntimeErr") or fields.get("expectedCompileErr", "")
        text = _strings(pattern)
        return Case(suite, label, expr, "error", error=re.sub(r"\.\*|\\", "", text))
    value = _go_value(fields.get("expectValue", "trueVal"))
    if value is _UNKNOWN:
        return Case(suite, label, expr, left_out="a Go result value")
    return Case(suite, label, expr, "value", value)


_UNKNOWN = object()


def _go_value(text: str) -> Any:
    text = text.strip()
    if text in ("trueVal", "types.True"):
        return True
    if text in ("falseVal", "types.False"):
        return False
    m = re.fullmatch(r"types\.(Int|Bool|Double|String)\((.*)\)", text, re.S)
    if m:
        kind, arg = m.groups()
        if kind == "String" and _STRINGS.fullmatch(arg):
            return _strings(arg)
        if kind == "Int" and re.fullmatch(r"-?\d+", arg):
            return int(arg)
        if kind == "Bool" and arg in ("true", "false"):
            return arg == "true"
        if kind == "Double" and re.fullmatch(r"-?[\d.]+(?:e-?\d+)?", arg):
            return float(arg)
    return _UNKNOWN


def format_cases(suite: str, source: str) -> list[Case]:
    """cel-go ext/formatting_test.go: ``"<format>".format([<formatArgs>])`` (format version 1).

    The Go test builds the expression with ``%q``; JSON quoting is the same for these strings.
    """
    out = []
    for index, body in enumerate(_literals(source)):
        fields = _fields(body)
        if "format" not in fields or not _STRINGS.fullmatch(fields["format"]):
            continue
        raw_args = fields.get("formatArgs", '""')
        args = _strings(raw_args) if _STRINGS.fullmatch(raw_args) else None
        label = f"{suite}/{_strings(fields['name']) if 'name' in fields else index}"
        expr = f"{json.dumps(_strings(fields['format']), ensure_ascii=False)}.format([{args or ''}])"
        locale = _strings(fields["locale"]) if "locale" in fields else ""
        foreign = "TestAllTypes" in expr or _LEFT_OUT.search(expr)
        if args is None or "dynArgs" in fields or locale not in ("", "en_US") or foreign:
            out.append(Case(suite, label, expr, left_out="Go variables, a locale or protobuf messages"))
            continue
        cost = int(fields["expectedRuntimeCost"]) if fields.get("expectedRuntimeCost", "").isdigit() else None
        if "err" in fields:
            out.append(Case(suite, label, expr, "error", error=_strings(fields["err"])))
            continue
        # cel-go's test states %e with narrow no-break spaces (its golang.org/x/text); Kubernetes
        # 1.36 builds with x/text v0.33.0, whose output the referee printed: `1.052033` and `10⁰³` joined by
        # the multiplication sign.
        scientific = re.search(r"%(\.\d+)?e", expr)
        scheduler = "referee: golang.org/x/text v0.33.0 prints %e without spaces" if scientific else ""
        output = _strings(fields.get("expectedOutput", '""'))
        out.append(Case(suite, label, expr, "value", output, cost=cost, scheduler=scheduler))
    return out
