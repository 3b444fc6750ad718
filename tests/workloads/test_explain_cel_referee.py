"""What the cel-go referee (benchmarks/cel_conformance/referee: cel-go v0.26.0 in the Kubernetes
1.36 selector environment, k8s.io/apiserver v0.36.3) answered where explain answered otherwise.

Upstream sources: cel-go v0.26.0 checker/checker.go (logical operands, comprehension ranges),
common/types/types.go (the null type prints as ``null``), common/errors.go (tabs in snippets),
parser/parser.go (backquoted fields unsupported), interpreter/interpretable.go and planner.go
(runtime overload errors), ext/lists.go (flatten), ext/formatting.go with golang.org/x/text
v0.33.0 (``%e``), cel/validator.go (homogeneous literals).
"""

from __future__ import annotations

import pytest

from agent.core.cel import CelCompileError, CelError, compile_check, evaluate, matches


def compile_error(expression: str) -> str:
    with pytest.raises(CelCompileError) as caught:
        evaluate(expression)
    return str(caught.value)


def runtime_error(expression: str) -> str:
    with pytest.raises(CelError) as caught:
        evaluate(expression)
    assert not isinstance(caught.value, CelCompileError)
    return str(caught.value)


@pytest.mark.parametrize(
    ("expression", "text"),
    [
        ("'%e'.format([1052.0])", "1.052000\u00d710⁰³"),
        ("'%.2e'.format([-1234.5])", "-1.234500\u00d710⁰³"),  # the precision is not applied
        ("'%e'.format([0.05])", "5.000000\u00d710⁻⁰²"),
        ("'%e'.format([double('-Infinity')])", "    -∞"),
        ("'%e'.format([double('NaN')])", "   NaN"),
        ("'%f'.format([double('Infinity')])", "∞"),
    ],
)
def test_scientific_format_is_the_scheduler_s(expression: str, text: str) -> None:
    assert evaluate(expression).value == text


@pytest.mark.parametrize(
    ("expression", "applied"),
    [
        ("1 == 1.0", "'_==_' applied to '(int, double)'"),
        ("2u != 2", "'_!=_' applied to '(uint, int)'"),
        ("1 == null", "'_==_' applied to '(int, null)'"),
        ("1 in [1.0]", "'@in' applied to '(int, list(double))'"),
        ("{1: 2}[1u]", "'_[_]' applied to '(map(int, int), uint)'"),
    ],
)
def test_mixed_literal_types_do_not_compile(expression: str, applied: str) -> None:
    assert f"found no matching overload for {applied}" in compile_error(expression)


def test_mixed_types_through_dyn_compare_at_runtime() -> None:
    """The other side of the rule above (passes before and after: the fix must not reach dyn)."""
    assert evaluate("dyn(1) == 1.0 && 1 == dyn(1u) && dyn(1) != null").value is True


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("null < null", "no such overload: _<_"),  # null stands for a timestamp or duration
        ("dyn([1]) >= dyn([2])", "no such overload: _>=_"),
        ("dyn(1) < dyn('a')", "no such overload"),
        ("dyn(1).all(x, true)", "got 'types.Int', expected iterable type"),
        ("dyn('a').map(x, x)", "got 'types.String', expected iterable type"),
        ("dyn({}).flatten()", "no such overload: map(dyn, dyn).flatten()"),
        ("dyn(1).flatten(0)", "no such overload: int.flatten(int)"),
        (
            "[].flatten(dyn('1'))",
            "internal error: interface conversion: ref.Val is types.String, not types.Int",
        ),
    ],
)
def test_runtime_errors_are_the_scheduler_s(expression: str, message: str) -> None:
    assert runtime_error(expression) == message


def test_backquoted_fields_are_unsupported_syntax() -> None:
    assert compile_error("{'a': 1}.`a` == 1") == (
        "compilation failed: ERROR: <input>:1:10: unsupported syntax: '`'\n"
        " | {'a': 1}.`a` == 1\n | .........^"
    )
    assert "unsupported syntax: '`'" in compile_error("has({'a': 1}.`a`)")


def test_logical_operands_are_checked_one_by_one() -> None:
    assert compile_error("false && 32") == (
        "compilation failed: ERROR: <input>:1:10: expected type 'bool' but found 'int'\n"
        " | false && 32\n | .........^"
    )
    errors = compile_error("'a' || true || 1")
    assert "1:1: expected type 'bool' but found 'string'" in errors
    assert "1:16: expected type 'bool' but found 'int'" in errors


def test_comprehension_range_error_points_at_the_range() -> None:
    assert compile_error("'abc'.exists(x, true)").startswith(
        "compilation failed: ERROR: <input>:1:1: expression of type 'string' cannot be range of a"
        " comprehension (must be list, map, or dynamic)"
    )


def test_null_type_names() -> None:
    assert "1:5: expected type 'int' but found 'null'" in compile_error("[1, null]")
    # The format clauses name the runtime type.
    assert "decimal clause can only be used on integers, was given null_type" in compile_error(
        "'%d'.format([null])"
    )


def test_every_mismatched_map_key_is_reported() -> None:
    errors = compile_error("{1: 1, 'b': 2, true: 3}")
    assert "1:8: expected type 'int' but found 'string'" in errors
    assert "1:16: expected type 'int' but found 'bool'" in errors


def test_a_tab_in_the_snippet_shows_as_a_space() -> None:
    assert compile_error("\n\t1 + 'a'").endswith("\n |  1 + 'a'\n | ...^")


_VARS = {"l": [1, 2, 3], "d": 5}
_DECLS = {"l": ("list", "int"), "d": "dyn"}


@pytest.mark.parametrize(
    ("expression", "cost"),
    [
        # A selection or index of anything but a variable is a relative attribute: one more.
        ("[7, 8, 9][0]", 2),
        ("{'a': 1}.a", 2),
        ("has({'a': 1}.a)", 1),
        ("[[1]][0][0]", 3),
        # Conversions of constants and type names are folded when planning (OptOptimize).
        ("int(uint(int(7)))", 0),
        ("'%d'.format([uint(64)])", 1),
        ("type(int)", 0),
        # An index that is itself an attribute is a qualifier without a cost of its own.
        ("l[l[0]]", 3),
        ("l[d - 5]", 4),
        # An error passed on is still charged where `||`/`&&` absorbs it.
        ("dyn([1, 2, 3][3]) || true", 3),
        ("(2 / 0 > 3 ? false : true) && false", 2),
        # The Kubernetes traversal cost counts a string's UTF-8 bytes.
        ("'ta©o©αT'.indexOf('©')", 1),  # noqa: RUF001 - the non-ASCII characters are the point
    ],
)
def test_runtime_cost_is_the_scheduler_s(expression: str, cost: int) -> None:
    assert evaluate(expression, _VARS, _DECLS).cost == cost


@pytest.mark.parametrize(
    ("expression", "bad"),
    [
        ("{1: 2}[dyn(b'')]", "types.Bytes"),
        ("dyn([1])[dyn(null)] || true", "types.Null"),  # a plan error: nothing absorbs it
        ("{1: 2}[dyn([1])]", "*types.baseList"),
        ("{1: 2}[dyn({})]", "*types.baseMap"),
    ],
)
def test_a_constant_index_of_no_key_type_fails_when_planned(expression: str, bad: str) -> None:
    """cel-go interpreter/attributes.go newQualifier, while the program is built."""
    assert compile_error(expression) == f"program instantiation failed: invalid qualifier type: {bad}"


def test_qualified_variable_names_resolve_to_the_longest_declared_prefix() -> None:
    """cel-go checker/checker.go checkSelect: ``a.b.c`` reads ``a.b.c``, or field c of ``a.b``, even
    where a comprehension variable is named ``a``."""
    assert evaluate("a.b.c", {"a.b.c": "yeah"}, {"a.b.c": "string"}).value == "yeah"
    assert evaluate("a.b.c", {"a.b": {"c": "yeah"}}, {"a.b": ("map", "string", "string")}).value == "yeah"
    assert evaluate("[1].exists(a, a.b == 1)", {"a.b": 1}, {"a.b": "int"}).value is True
    with pytest.raises(
        CelCompileError, match="1:4: type 'list\\(string\\)' does not support field selection"
    ):
        evaluate("a.b.pancakes", {"a.b": ["x"]}, {"a.b": ("list", "string")})


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("[1].all(x, 1)", "1:12: expected type 'bool' but found 'int'"),
        ("[1].exists_one(x, 1)", "1:15: found no matching overload for '_?_:_' applied to '(int, int, int)'"),
        (
            "[1].filter(x, 1)",
            "1:11: found no matching overload for '_?_:_' applied to '(int, list(int), list(int))'",
        ),
        (
            "[1].map(x, 'a', x)",
            "1:8: found no matching overload for '_?_:_' applied to '(string, list(int), list(int))'",
        ),
        (
            "{'a': 1}.transformMap(k, v, 1, v)",
            "1:22: found no matching overload for '_?_:_' applied to"
            " '(int, map(string, int), map(string, int))'",
        ),
    ],
)
def test_macro_conditions_are_checked_as_their_expansion(expression: str, message: str) -> None:
    """cel-go parser/macro.go: the quantifiers' `accu && body`, the others' `test ? step : accu`."""
    assert message in compile_error(expression)


def test_selectors_see_the_device_as_the_1_36_scheduler_declares_it() -> None:
    """k8s.io/dynamic-resource-allocation/cel/compile.go (v0.36): attributes are AnyType, which no
    format clause takes and no macro ranges over; DRAConsumableCapacity (beta, on by default in
    1.36, pkg/features/kube_features.go) declares ``allowMultipleAllocations``."""
    attribute = "device.attributes['gpu.example.com'].index"
    with pytest.raises(
        CelCompileError, match=r"decimal clause can only be used on integers, was given google\.protobuf\.Any"
    ):
        compile_check(f"'%d'.format([{attribute}]) == '3'")
    compile_check(f"'%d'.format([dyn({attribute})]) == '3'")
    with pytest.raises(CelCompileError, match="expression of type 'any' cannot be range of a comprehension"):
        compile_check(f"{attribute}.all(x, true)")
    device = {"name": "gpu-0", "allowMultipleAllocations": True, "attributes": {"index": {"int": 3}}}
    assert matches(
        "device.allowMultipleAllocations && device.attributes['gpu.example.com'].index == 3",
        device,
        "gpu.example.com",
    )
    assert not matches("device.allowMultipleAllocations", {"name": "gpu-1"}, "gpu.example.com")
