"""The parser, the macros and the compile-time checks report what cel-go reports, where it does.

Grammar: cel-go parser/gen/CEL.g4 and parser/parser.go (reserved identifiers, literal errors);
escapes: parser/unescape.go; macros: parser/macro.go, ext/comprehensions.go, ext/bindings.go,
ext/lists.go (sortBy); format checks: ext/formatting.go (stringFormatValidator).
"""

from __future__ import annotations

import pytest

from agent.core.cel import CelCompileError, CelError, CelUint, evaluate

ERRORS = [
    ("1 +", "1:4: Syntax error: mismatched input '<EOF>'"),
    ("[1, 2", "1:6: Syntax error: mismatched input '<EOF>'"),
    ("1 # 2", "1:3: Syntax error: token recognition error at: '#'"),
    ("1 2", "1:3: Syntax error: extraneous input '2'"),
    ("f(1,)", "1:5: Syntax error: mismatched input ')'"),
    ("if", "1:1: reserved identifier: if"),
    ("isImage('nginx')", "1:8: undeclared reference to 'isImage'"),  # base.go declares no image library
    ("9223372036854775808 == 1", "1:1: invalid int literal"),
    ("18446744073709551616u == 1u", "1:1: invalid uint literal"),
    ("'\\q' == ''", "1:1: unable to unescape string"),
    ("'\\08' == ''", "1:1: unable to unescape octal sequence in string"),
    ("'\\ud800' == ''", "1:1: invalid unicode code point"),
    ("Msg{a: 1}", "message construction is not supported for DRA devices"),
    ("x.?y == 1", "1:3: optional types ('.?', '[?', '{?') are in the scheduler's environment"),
    ("[1].all(1, true)", "1:9: argument must be a simple name"),
    ("[1].map(1, 1) == []", "1:9: argument is not an identifier"),
    ("has(x)", "1:5: invalid argument to has() macro"),
    ("cel.bind(1, 2, true)", "1:10: cel.bind() variable names must be simple identifiers"),
    ("(1).sortBy(v, v) == []", "1:2: sortBy can only be applied to a list, identifier, comprehension, call"),
    ("[1].exists(__result__, true)", "1:12: iteration variable overwrites accumulator variable"),
    ("[1].transformMapEntry(k, v, v) == {}", "found no matching overload for 'cel.@mapInsert'"),
    ("[{}].sortBy(v, v) == []", "found no matching overload for '@sortByAssociatedKeys'"),
    ("(" * 300 + "1" + ")" * 300 + " == 1", "compilation failed: expression nests too deeply"),
    ('"%s".format([]) == ""', "1:12: index 0 out of range"),
    ('"%".format([1]) == ""', "1:11: unexpected end of string"),
    ('"%.".format([1]) == ""', "could not find end of precision specifier"),
    ('"%.f".format([1.0]) == ""', 'strconv.Atoi: parsing "": invalid syntax'),
    ('"".format([1]) == ""', "too many arguments supplied to string.format (expected 0, got 1)"),
    ("[[1, 'a']].size() == 1", "1:6: expected type 'int' but found 'string'"),
]


@pytest.mark.parametrize(("expression", "message"), ERRORS)
def test_compile_errors(expression: str, message: str) -> None:
    with pytest.raises(CelCompileError) as caught:
        evaluate(expression, {"x": {"y": 1}}, {"x": ("map", "string", "int")})
    assert message in str(caught.value)


RUNTIME_ERRORS = [
    ("dyn([[1], [2]]).sort() == []", "list elements must be comparable"),
    ("xs.sort() == []", "list elements must have the same type"),
    ("[1, 2].slice(2, 1) == []", "cannot slice(2, 1), start index must be less than or equal to end index"),
    ("[1, 2].slice(-1, 1) == []", "cannot slice(-1, 1), negative indexes not supported"),
    ('"%d".format(dyn([1.5])) == ""', "error during formatting: decimal clause can only be used on integers"),
    ('"%s %s".format(dyn(["a"])) == ""', "index 1 out of range"),
    ('"%x".format(dyn([1.5])) == ""', "only integers, byte buffers, and strings can be formatted as hex"),
    ("'x'.find(['('][0]) == ''", "Illegal regex: error parsing regexp: missing closing )"),
    ("quantity('10Mm').isInteger()", "unable to parse quantity's suffix"),
    ("quantity('1.2.3').isInteger()", "unable to parse numeric part of quantity"),
    ("{1: 2}.transformMap(k, v, v) == {1: 2} && dyn(1)[0] == 1", "no such overload"),
]


@pytest.mark.parametrize(("expression", "message"), RUNTIME_ERRORS)
def test_runtime_errors(expression: str, message: str) -> None:
    with pytest.raises(CelError) as caught:
        evaluate(expression, {"xs": [1, "a"]}, {"xs": ("list", "dyn")})
    assert not isinstance(caught.value, CelCompileError)
    assert message in str(caught.value)


VALUES = [
    ("0x1F + 1", 32),
    ("0x10u", CelUint(16)),
    (".5 + 1e1", 10.5),
    ("r'\\n' + R\"\\t\"", "\\n\\t"),
    ("'''a\nb''' + \"\"\"c\"\"\"", "a\nbc"),
    ("br'\\x41' == b'\\\\x41'", True),
    ('"%s".format([[1, {1: "a"}]])', '[1, {1:"a"}]'),
    ("!!true && --1 == 1 && -(-1) == 1", True),
    ("[1, 2, 3].all(x, x > 0) && [1, 2].exists_one(x, x == 2) && [1].existsOne(x, x == 1)", True),
    ("[1, 2, 3].map(x, x > 1, x * 10)", [20, 30]),
    ("{'a': 1, 'b': 2}.transformMap(k, v, v > 1, v * 2)", {"b": 4}),
    ("{'a': 1}.transformList(k, v, k + string(v))", ["a1"]),
    (
        "'%.2f|%e|%o|%X|%x'.format([3.14159, 0.5, 8, 255, 'hi'])",
        "3.14|5.000000\u00d710\u207b\u2070\u00b9|10|FF|6869",
    ),
    ("'%s'.format([[1.5, 'a', b'b', null, {'k': true}]])", '[1.500000, "a", b"b", null, {"k":true}]'),
    ("'%f'.format([1234.5])", "1,234.500000"),
    ("string(1e6) + ' ' + string(123456.0) + ' ' + string(1e-5)", "1e+06 123456 1e-05"),
]


@pytest.mark.parametrize(("expression", "value"), VALUES)
def test_values(expression: str, value: object) -> None:
    result = evaluate(expression).value
    assert result == value
    assert type(result) is type(value)
