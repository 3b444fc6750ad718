"""Selectors evaluate as the scheduler's CEL environment does: each library function and each
kind of error gives the outcome kube-scheduler gives.

The environment is staging/src/k8s.io/dynamic-resource-allocation/cel/compile.go (``device``
variable, semver library, ``cel.bind``) on staging/src/k8s.io/apiserver/pkg/cel/environment/base.go
(strings extension version 2, sets, regex, lists, quantity, two-variable comprehensions,
heterogeneous numeric comparisons, homogeneous aggregate literals). Each case names the upstream
file that defines its outcome.
"""

from __future__ import annotations

from typing import Any

import pytest

from agent.core.cel import MAX_MESSAGE, CelCompileError, CelError, compile_check, matches

NV = "gpu.nvidia.com"
DEVICE: dict[str, Any] = {
    "name": "gpu-1",
    "attributes": {
        "productName": {"string": "NVIDIA A100-SXM4-80GB"},
        "index": {"int": 1},
        "mig": {"bool": False},
        "driverVersion": {"version": "550.54.15"},
        "resource.kubernetes.io/pcieRoot": {"string": "pci0000:00"},
    },
    "capacity": {"memory": {"value": "80Gi"}},
}
A = f"device.attributes['{NV}']"


def ok(expression: str) -> bool:
    return matches(expression, DEVICE, NV)


# (expression, expected result, upstream file defining it)
TRUE_CASES = [
    # NVIDIA's e2e style, issue 24 (b): cel-go ext/strings.go lowerAscii, then matches (RE2).
    (f"{A}.productName.lowerAscii().matches('^.*a100.*$')", "cel-go ext/strings.go"),
    (f"{A}.productName.upperAscii().contains('A100')", "cel-go ext/strings.go"),
    (f"{A}.productName.replace('NVIDIA ', '') == 'A100-SXM4-80GB'", "cel-go ext/strings.go"),
    ("'a-b-c'.replace('-', '+', 1) == 'a+b-c'", "cel-go ext/strings.go"),
    (f"{A}.productName.split('-') == ['NVIDIA A100', 'SXM4', '80GB']", "cel-go ext/strings.go"),
    ("'a,b,c'.split(',', 2) == ['a', 'b,c']", "cel-go ext/strings.go"),
    ("['a', 'b'].join('-') == 'a-b' && ['a', 'b'].join() == 'ab'", "cel-go ext/strings.go"),
    ("'  x \\t'.trim() == 'x'", "cel-go ext/strings.go"),
    ("'hello'.charAt(1) == 'e' && 'hello'.substring(1, 3) == 'el'", "cel-go ext/strings.go"),
    ("'hello'.indexOf('l') == 2 && 'hello'.lastIndexOf('l') == 3", "cel-go ext/strings.go"),
    (
        "'%s has %d GPUs at %.1f'.format(['node', 8, 1.5]) == 'node has 8 GPUs at 1.5'",
        "cel-go ext/strings.go",
    ),
    ("strings.quote('a\"b') == '\"a\\\\\"b\"'", "cel-go ext/strings.go"),
    (f"{A}.productName.startsWith('NVIDIA') && {A}.productName.endsWith('80GB')", "cel-go standard"),
    (f"{A}.productName.find('[0-9]+GB') == '80GB'", "apiserver/pkg/cel/library/regex.go"),
    ("'a1b22'.findAll('[0-9]+') == ['1', '22'] && 'a1b2'.findAll('[0-9]', 1) == ['1']", "library/regex.go"),
    ("[1, 2, 3].isSorted() && [1, 2, 3].sum() == 6", "apiserver/pkg/cel/library/lists.go"),
    ("[3, 1, 2].min() == 1 && [3, 1, 2].max() == 3", "apiserver/pkg/cel/library/lists.go"),
    ("[1, 2, 1].indexOf(1) == 0 && [1, 2, 1].lastIndexOf(1) == 2", "apiserver/pkg/cel/library/lists.go"),
    ("sets.contains([1, 2, 3], [1, 2]) && sets.intersects([1], [1, 5])", "cel-go ext/sets.go"),
    ("sets.equivalent([1, 2], [2, 1, 1]) && !sets.equivalent([1], [2])", "cel-go ext/sets.go"),
    (f"device.capacity['{NV}'].memory.compareTo(quantity('40Gi')) > 0", "library/quantity.go"),
    (f"device.capacity['{NV}'].memory.isGreaterThan(quantity('79Gi'))", "library/quantity.go"),
    ("quantity('1500m').add(1).isGreaterThan(quantity('2'))", "library/quantity.go"),
    (
        "quantity('2k').asInteger() == 2000 && quantity('1.5').asApproximateFloat() == 1.5",
        "library/quantity.go",
    ),
    ("!quantity('1.5').isInteger() && isQuantity('1Gi') && !isQuantity('x')", "library/quantity.go"),
    ("quantity('1Gi').sub(quantity('1Gi')).sign() == 0", "library/quantity.go"),
    (f"{A}.driverVersion.isGreaterThan(semver('550.0.0'))", "library/semverlib.go"),
    (f"{A}.driverVersion.major() == 550 && {A}.driverVersion.minor() == 54", "library/semverlib.go"),
    ("isSemver('1.0.0') && !isSemver('1.0') && isSemver('v1.0', true)", "library/semverlib.go"),
    ("semver('v01.2', true) == semver('1.2.0')", "library/semverlib.go"),
    (
        "semver('1.0.0-alpha').isLessThan(semver('1.0.0')) && "
        "semver('2.0.0').compareTo(semver('1.9.9')) == 1",
        "library/semverlib.go",
    ),
    (f"cel.bind(nv, {A}, nv.index == 1 && !nv.mig)", "dynamic-resource-allocation/cel/compile.go"),
    ("[1, 2, 3].all(x, x > 0) && [1, 2].exists(x, x == 2) && [1, 2].exists_one(x, x == 1)", "cel-go"),
    ("[1, 2].map(x, x * 2) == [2, 4] && [1, 2, 3].filter(x, x > 1) == [2, 3]", "cel-go"),
    ("{'a': 1}.all(k, v, v == 1) && [5].exists(i, v, i == 0 && v == 5)", "cel-go ext/comprehensions.go"),
    ("[1, 2].transformList(i, v, v * 10) == [10, 20]", "cel-go ext/comprehensions.go"),
    ("dyn(1) == 1.0 && 1 < 1.5 && 2u > 1", "environment/base.go CrossTypeNumericComparisons"),
    (f"has({A}.index) && !has({A}.nosuch) && !has(device.attributes['x.example.com'].y)", "compile.go"),
    ("device.attributes['resource.kubernetes.io'].pcieRoot == 'pci0000:00'", "compile.go"),
]


@pytest.mark.parametrize(("expression", "upstream"), TRUE_CASES)
def test_library_functions(expression: str, upstream: str) -> None:
    """Each library function of the scheduler's environment, as its upstream file defines it."""
    assert ok(expression), upstream


COMPILE_ERRORS = [
    # cel-go checker: an unknown function or variable, at the call's '(' (1-based column).
    ("foo(1)", "compilation failed: ERROR: <input>:1:4: undeclared reference to 'foo' (in container '')"),
    ("x == 1", "compilation failed: ERROR: <input>:1:1: undeclared reference to 'x' (in container '')"),
    (f"{A}.productName.nope()", "ERROR: <input>:1:53: undeclared reference to 'nope' (in container '')"),
    # Kubernetes has no version(): semver() is the library's name (library/semverlib.go).
    ("version('1.0.0') == semver('1.0.0')", "undeclared reference to 'version' (in container '')"),
    ("'a' + 1 == 'a1'", "found no matching overload for '_+_' applied to '(string, int)'"),
    (
        "device.driver.lowerAscii(1) == 'x'",
        "found no matching overload for 'lowerAscii' applied to 'string.(int)'",
    ),
    ("[1, 'a'].size() == 2", "expected type 'int' but found 'string'"),
    # compile.go: the result must be bool or the unknown type.
    ("'abc'", "must evaluate to bool or the unknown type, not string"),
    ("device.driver ==", "Syntax error: mismatched input '<EOF>'"),
]


@pytest.mark.parametrize(("expression", "message"), COMPILE_ERRORS)
def test_compile_errors(expression: str, message: str) -> None:
    """cel-go's checker and dynamic-resource-allocation/cel/compile.go: compile errors."""
    with pytest.raises(CelCompileError) as caught:
        compile_check(expression)
    assert message in str(caught.value)
    assert str(caught.value).startswith(("compilation failed: ", "must evaluate"))


RUNTIME_ERRORS = [
    # issue 24 (c): a missing attribute is cel-go's missing map key.
    (f"{A}.index2 == 1", "no such key: index2"),
    (f"{A}['nosuch'] == 1", "no such key: nosuch"),
    (f"{A}.index + 'a' == 'b'", "no such overload"),  # dyn: a runtime overload failure
    (f"{A}.productName.lowerAscii().matches(['['][0])", "error parsing regexp: missing closing ]: `[`"),
    ("1 / 0 == 1", "division by zero"),
    ("1 % 0 == 1", "modulus by zero"),
    ("9223372036854775807 + 1 == 0", "integer overflow"),
    ("[1][3] == 1", "index out of bounds: 3"),
    ("quantity('x').sign() == 0", "quantities must match the regular expression"),
    ("semver('1.0').major() == 1", "No Major.Minor.Patch elements found"),
    (f"{A}.productName", "CEL result of type string could not be converted to bool"),
]


@pytest.mark.parametrize(("expression", "message"), RUNTIME_ERRORS)
def test_runtime_errors(expression: str, message: str) -> None:
    """cel-go's interpreter errors, as DeviceMatches (compile.go) returns them."""
    with pytest.raises(CelError) as caught:
        ok(expression)
    assert not isinstance(caught.value, CelCompileError)
    assert message in str(caught.value)


def test_errors_absorbed_by_logical_operators() -> None:
    """cel-go: ``&&``/``||`` are commutative over errors (false && error is false)."""
    assert not ok(f"{A}.nosuch == 1 && false")
    assert ok(f"true || {A}.nosuch == 1")


def test_cost_limit() -> None:
    """compile.go: cel.CostLimit(resourceapi.CELSelectorExpressionMaxCost = 1,000,000); cel-go's
    runtime message. A million-iteration nest is refused; a smaller one runs."""
    ten = "[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]"
    nest = "true"
    for var in "abcdef":
        nest = f"{ten}.all({var}, {nest})"
    with pytest.raises(CelError, match=r"^operation cancelled: actual cost limit exceeded$"):
        ok(nest)
    assert ok(f"{ten}.all(a, {ten}.all(b, {ten}.all(c, true)))")


def test_messages_carry_no_internal_state() -> None:
    """No Python reprs, tracebacks or object dumps; every message is capped."""
    for expression in ("foo(1)", f"{A}.index2 == 1", f"{A}.index + 'a' == 'b'", "x" * 5000 + "()"):
        with pytest.raises(CelError) as caught:
            ok(expression)
        text = str(caught.value)
        assert len(text) <= MAX_MESSAGE
        for leak in ("Activation", "NameContainer", "Traceback", "<class", "Token(", "celpy"):
            assert leak not in text
