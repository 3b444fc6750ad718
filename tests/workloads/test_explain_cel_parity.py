"""Issue 32: where explain's CEL differed from the scheduler's, one test per point.

The scheduler's engine is cel-go v0.26 (vendored by Kubernetes 1.36) in the environment of
k8s.io/dynamic-resource-allocation/cel/compile.go on k8s.io/apiserver/pkg/cel/environment/base.go.
Each test names the upstream source of the behaviour it checks. The cases are ours; the published
suites run outside CI (``python -m benchmarks.cel_conformance``).
"""

from __future__ import annotations

from typing import Any

import pytest

from agent.core.cel import COST_LIMIT, CelCompileError, CelError, compile_check, evaluate, matches

NV = "gpu.nvidia.com"
DEVICE: dict[str, Any] = {
    "name": "gpu-0",
    "attributes": {
        "productName": {"string": "NVIDIA H100 80GB HBM3"},
        "index": {"int": 2},
        "uuid": {"string": "GPU-1234"},
    },
    "capacity": {"memory": {"value": "80Gi"}},
}
A = f"device.attributes['{NV}']"


def ok(expression: str) -> bool:
    return matches(expression, DEVICE, NV)


def compile_error(expression: str) -> str:
    with pytest.raises(CelCompileError) as caught:
        compile_check(expression)
    return str(caught.value)


def runtime_error(expression: str) -> str:
    compile_check(expression)
    with pytest.raises(CelError) as caught:
        ok(expression)
    assert not isinstance(caught.value, CelCompileError)
    return str(caught.value)


@pytest.mark.parametrize(
    "expression",
    [
        f"[3, 0, 1].sort() == [0, 1, 3] && [3, 0, 1].sort()[1] < {A}.index",
        f"{A}.index in lists.range(4) && lists.range(0) == []",
        "['b', 'a', 'c'].slice(1, 3) == ['a', 'c']",
        "[[1, 2], [3]].flatten() == [1, 2, 3] && [[[1]], [[2]]].flatten(2) == [1, 2]",
        "[2, 1, 2, 1].distinct() == [2, 1]",
        "[1, 2, 3].reverse() == [3, 2, 1]",
        f"['{NV}', 'a.io', 'bb.io'].sortBy(d, d.size()) == ['a.io', 'bb.io', '{NV}']",
    ],
)
def test_1_lists_version_3_is_in_the_environment(expression: str) -> None:
    """cel-go ext/lists.go ``ext.Lists(ext.ListsVersion(3))``, in base.go since 1.34."""
    assert ok(expression)


def test_1_lists_runtime_errors_are_cel_go_s() -> None:
    """cel-go ext/lists.go: slice bounds, a negative flatten depth."""
    assert runtime_error("[1, 2].slice(1, 3) == []") == "cannot slice(1, 3), list is length 2"
    assert runtime_error("[1].flatten(-1) == []") == "level must be non-negative"


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        (f"{A}.productName.find(')') == ''", "program instantiation failed: error parsing regexp"),
        (f"{A}.productName.matches('x++')", "invalid matches argument"),
        ("['a', 'b'].sum() == 'ab'", "found no matching overload for 'sum' applied to 'list(string).()'"),
        ("[[1], [2]].min() == [1]", "found no matching overload for 'min' applied to 'list(list(int)).()'"),
        ("[1].all(i, i, i < i)", "duplicate variable name: i"),
    ],
)
def test_2_what_the_scheduler_rejects_when_compiling_is_a_compile_error(
    expression: str, message: str
) -> None:
    """cel-go cel/validator.go ValidateRegexLiterals; library/regex.go FindRegexOptimization (at
    program build: compile.go's ``program instantiation failed``); library/lists.go summableTypes and
    comparableTypes; ext/comprehensions.go extractIterVars."""
    assert message in compile_error(expression)


def test_3_a_two_variable_comprehension_reports_a_repeated_key_at_runtime() -> None:
    """cel-go ext/comprehensions.go transformMapEntry: ``cel.@mapInsert`` (common/types/map.go)."""
    assert (
        runtime_error("[1, 1].transformMapEntry(i, v, {v: i}) == {}") == "insert failed: key 1 already exists"
    )
    assert ok("[1, 2].transformMapEntry(i, v, {v: i}) == {1: 0, 2: 1}")
    assert ok("{'a': 1}.transformMapEntry(k, v, {v: k}) == {1: 'a'}")


def test_4_string_offsets_and_format_clauses_are_cel_go_s() -> None:
    """cel-go v0.26 ext/strings.go indexOfOffset/lastIndexOfOffset; ext/formatting.go (format
    version 1: stringFormatValidator at compile time, stringFormatter at runtime)."""
    assert ok(f"{A}.uuid.indexOf('1', 30) == -1 && {A}.uuid.lastIndexOf('1', 30) == -1")
    assert runtime_error(f"{A}.uuid.indexOf('1', -1) == 0") == "index out of range: -1"
    assert ok("'%b %b %b'.format([true, false, 5]) == '1 0 101'")
    assert ok("'%e'.format([1052.0]) == '1.052000\\u00d710\\u2070\\u00b3'")
    assert "fixed-point clause can only be used on doubles, was given int" in compile_error(
        "'%f'.format([1]) == ''"
    )
    assert 'unrecognized formatting clause "a"' in compile_error("'%a'.format([1]) == ''")


def test_5_bytes_literals_hold_bytes() -> None:
    """cel-go parser/unescape.go: ``\\xHH`` and octal escapes in a bytes literal are single bytes."""
    assert ok("b'\\xff'.size() == 1 && b'\\377' == b'\\xff'")
    assert ok("string(b'\\303\\277') == '\\u00ff'")
    assert ok("b'\\X4c' == b'L' && b'\\x4C\\x4c'.size() == 2")
    assert "unable to unescape string" in compile_error("b'\\u00ff' == b''")


def test_6_integer_overflow_and_nan_equality() -> None:
    """cel-go common/types/int.go Negate (negateInt64Checked), double.go ConvertToType
    (doubleToInt64Checked, folded when the program is built: interpreter/decorators.go
    maybeOptimizeConstUnary), int.go Equal (NaN is unequal, not an error)."""
    assert runtime_error("-(-9223372036854775808) == 0") == "integer overflow"
    assert (
        compile_error("int(-9223372036854775808.0) == 0") == "program instantiation failed: integer overflow"
    )
    assert runtime_error(f"int(double({A}.index) * 1e19) == 0") == "integer overflow"
    assert ok("!(dyn(1) == 0.0/0.0) && dyn(1) != 0.0/0.0")


def test_7_member_calls_on_literals_parse() -> None:
    """cel-go parser/gen/CEL.g4: ``42.charAt(2)`` is NUM_INT, DOT, IDENTIFIER; the checker rejects it."""
    message = compile_error("42.charAt(2) == ''")
    assert "found no matching overload for 'charAt' applied to 'int.(int)'" in message
    assert "Syntax error" not in message
    assert ok("-1 < 0 && --1 == 1")


def test_8_compile_errors_read_as_the_scheduler_s() -> None:
    """cel-go common/errors.go ToDisplayString (every error, by position); checker types print
    ``null``; validator errors point at the literal (cel/validator.go ReportErrorAtID)."""
    assert compile_error("foo == bar") == (
        "compilation failed: ERROR: <input>:1:1: undeclared reference to 'foo' (in container '')\n"
        " | foo == bar\n | ^\n"
        "ERROR: <input>:1:8: undeclared reference to 'bar' (in container '')\n"
        " | foo == bar\n | .......^"
    )
    assert "applied to '(int, null)'" in compile_error("1 + null == 1")
    assert compile_error(f"{A}.uuid.matches('(')").startswith(
        "compilation failed: ERROR: <input>:1:50: invalid matches argument"
    )
    assert "<input>:1:5: expected type 'int' but found 'string'" in compile_error("[1, 'a'] == []")


def test_8_runtime_errors_read_as_the_scheduler_s() -> None:
    """cel-go interpreter/attributes.go (an index qualifies an attribute: ``index out of bounds``),
    common/decls/decls.go MaybeNoSuchOverload (a function's guard names the argument types),
    common/types/int.go Add (an operator's trait: a bare ``no such overload``)."""
    assert runtime_error(f"[{A}.index][3] == 1") == "index out of bounds: 3"
    assert runtime_error(f"[1][dyn({A}.uuid)] == 1") == "unsupported index type 'string' in list"
    assert runtime_error(f"dyn({A}.index).charAt(0) == ''") == "no such overload: charAt(int, int)"
    assert runtime_error(f"dyn({A}.uuid) + 1 == 2") == "no such overload"


def _literal(n: int) -> str:
    return "[" + ", ".join(str(i) for i in range(n)) + "]"


def test_9_runtime_cost_is_cel_go_s() -> None:
    """cel-go interpreter/runtimecost.go: a macro's fold costs per element what its expansion
    costs (parser/macro.go MakeMap: ``accu + [f(x)]``: the accumulator 1, the list 10, ``_+_`` 1);
    constant literals are folded (decorators.go maybeBuildListLiteral), so they cost nothing."""
    # 300 x 300 string() conversions: 300 * (12 + 1 + 300 * 14 + 1) > COST_LIMIT
    inner = _literal(300)
    selector = f"{inner}.map(x, {inner}.map(y, string(y))).size() > 0"
    assert COST_LIMIT < 300 * (14 + 300 * 14)
    assert runtime_error(selector) == "operation cancelled: actual cost limit exceeded"
    # range 0 (a constant), per element 12 + x 1 + string() 1, the result 1; size() 1, == 1
    assert evaluate("[1, 2, 3].map(x, string(x)).size() == 3").cost == 3 * 14 + 1 + 2
    # lowerAscii (Kubernetes library/cost.go): ceil(21 chars * 0.1) = 3, == on strings: 3
    assert evaluate("'ABCDEFGHIJ abcdefghij'.lowerAscii() == 'abcdefghij abcdefghij'").cost == 6
