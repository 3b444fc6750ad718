"""cel-spec's conformance files (tests/simple/testdata/*.textproto) as `Case`s.

The expected values are the files' own. Left out, as in issue 32: protobuf messages (and the
wrapper/Any/Struct types), timestamps and durations, optional types, containers, enums, unknowns.
"""

from __future__ import annotations

import re
from typing import Any

from agent.core.cel import CelType, CelUint
from benchmarks.cel_conformance.cases import Case
from benchmarks.cel_conformance.textproto import RawString, parse

SUITES = (
    "basic", "comparisons", "conversions", "fields", "integer_math", "lists", "logic", "macros",
    "macros2", "parse", "plumbing", "string", "string_ext", "bindings_ext", "fp_math",
)  # fmt: skip

_LEFT_OUT = re.compile(
    r"TestAllTypes|NestedTestAllTypes|google\.protobuf|cel\.expr|proto[23]|timestamp|duration"
    r"|optional|\.\?|\[\?|\?\.|\bAny\b|Struct|Value\b|ListValue|NullValue|Int32Value|Int64Value"
    r"|UInt32Value|UInt64Value|FloatValue|DoubleValue|BoolValue|StringValue|BytesValue|GlobalEnum"
)


# Where cel-go v0.26 (the scheduler's) answers otherwise than cel-spec, and the cel-go source that says so.
_SCHEDULER = {
    "string_ext/value_errors/indexof_out_of_range": "cel-go v0.26 ext/strings_test.go: -1",
    "string_ext/value_errors/lastindexof_out_of_range": "cel-go v0.26 ext/strings_test.go: -1",
    "fields/qualified_identifier_resolution/map_value_repeat_key": (
        "cel-go v0.26 interpreter/interpretable.go evalMap: the last value of a repeated key"
    ),
    # Answered by the referee (benchmarks/cel_conformance/referee), cel-go v0.26.0 itself:
    **{
        f"fields/quoted_map_fields/{name}": "referee: cel-go v0.26's parser rejects backquoted fields"
        for name in (
            "field_access_slash",
            "field_access_dot",
            "field_access_dash",
            "has_field_slash",
            "has_field_dot",
            "has_field_dash",
        )
    },
    **{
        f"fields/map_fields/map_bad_key_type_{name}": "referee: a bytes key fails when the program is built"
        for name in ("or_true", "and_false")
    },
}


class _LeftOut(Exception):
    pass


def cases(name: str, text: str) -> list[Case]:
    out = []
    for section in parse(text).get("section", []):
        for test in section.get("test", []):
            label = f"{name}/{section['name'][0]}/{test['name'][0]}"
            out.append(_case(name, label, test))
    return out


def _case(suite: str, label: str, test: dict[str, list[Any]]) -> Case:
    expr = str(test["expr"][0])
    scheduler = next((why for name, why in _SCHEDULER.items() if label.endswith(name)), "")
    try:
        if _LEFT_OUT.search(expr) or "container" in test or "enum_value" in str(test):
            raise _LeftOut("protobuf messages, timestamps, optional types or containers")
        if "string_ext/format/" in label or "string_ext/reverse/" in label:
            # cel-spec specifies strings version 4 here; the scheduler has version 2, whose
            # format cel-go v0.26's ext/formatting_test.go states (the "cel-go ext formatting" suite).
            raise _LeftOut("strings extension version 4 (the scheduler has version 2)")
        if any(k in test for k in ("unknown", "any_eval_errors", "any_unknowns", "check_only")):
            raise _LeftOut("unknowns or check-only")
        declarations = {str(d["name"][0]): _decl(d) for d in test.get("type_env", [])}
        variables = {str(b["key"][0]): _value(b["value"][0]["value"][0]) for b in test.get("bindings", [])}
        for name in variables:
            declarations.setdefault(name, "dyn")
        checked = str(test.get("disable_check", ["false"])[0]) != "true"
        if "eval_error" in test:
            # cel-spec's error texts are descriptions, not cel-go's wording: only the outcome counts.
            message = ""
            return Case(
                suite,
                label,
                expr,
                "error",
                error=message,
                declarations=declarations,
                variables=variables,
                checked=checked,
                scheduler=scheduler,
            )
        if "typed_result" in test:
            value = _value(test["typed_result"][0]["result"][0])
        else:
            value = _value(test["value"][0]) if "value" in test else True
        return Case(
            suite,
            label,
            expr,
            "value",
            value,
            declarations=declarations,
            variables=variables,
            checked=checked,
            scheduler=scheduler,
        )
    except _LeftOut as why:
        return Case(suite, label, expr, left_out=str(why))


_PRIMITIVES = {
    "BOOL": "bool", "INT64": "int", "UINT64": "uint", "DOUBLE": "double", "STRING": "string",
    "BYTES": "bytes",
}  # fmt: skip


def _decl(decl: dict[str, list[Any]]) -> Any:
    if "ident" not in decl:
        raise _LeftOut("function declarations")
    return _type(decl["ident"][0]["type"][0])


def _type(t: dict[str, list[Any]]) -> Any:
    if "primitive" in t:
        return _PRIMITIVES[str(t["primitive"][0])]
    if "list_type" in t:
        return ("list", _type(t["list_type"][0]["elem_type"][0]))
    if "map_type" in t:
        m = t["map_type"][0]
        return ("map", _type(m["key_type"][0]), _type(m["value_type"][0]))
    if "dyn" in t:
        return "dyn"
    if "null" in t:
        return "null_type"
    raise _LeftOut(f"type {sorted(t)}")


def _value(v: dict[str, list[Any]]) -> Any:
    if "null_value" in v:
        return None
    if "bool_value" in v:
        return str(v["bool_value"][0]) == "true"
    if "int64_value" in v:
        return int(v["int64_value"][0])
    if "uint64_value" in v:
        return CelUint(int(v["uint64_value"][0]))
    if "double_value" in v:
        return float(v["double_value"][0])
    if "string_value" in v:
        return str(v["string_value"][0])
    if "bytes_value" in v:
        raw = v["bytes_value"][0]
        return raw.raw if isinstance(raw, RawString) else bytes(raw)
    if "list_value" in v:
        return [_value(x) for x in v["list_value"][0].get("values", [])]
    if "map_value" in v:
        entries = v["map_value"][0].get("entries", [])
        return {_value(e["key"][0]): _value(e["value"][0]) for e in entries}
    if "type_value" in v:
        return CelType(str(v["type_value"][0]))
    raise _LeftOut(f"value {sorted(v)}")
