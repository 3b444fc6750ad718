"""The strings extension's ``format`` as cel-go v0.26 ext/formatting.go does it (strings version 2).

Clauses ``%s``, ``%d``, ``%f``, ``%e``, ``%b``, ``%x``, ``%X``, ``%o`` (``%.Nf``/``%.Ne`` take a
precision) and ``%%``. One parser serves evaluation and the compile-time check of a literal format
string (`agent.core.cel.validators`), so both give cel-go's messages.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from agent.core.cel.errors import _RuntimeError
from agent.core.cel.library.arguments import _l, _s
from agent.core.cel.library.gotext import _go_float, _go_g, _go_quote, _printer_float
from agent.core.cel.values import CelQuantity, CelSemver, _type_name, _TypeValue, _UInt

_CLAUSE_ERRORS = {
    "s": "string clause can only be used on strings, bools, bytes, ints, doubles, maps, lists, types, "
    "durations, and timestamps, was given {}",
    "d": "decimal clause can only be used on integers, was given {}",
    "f": "fixed-point clause can only be used on doubles, was given {}",
    "e": "scientific clause can only be used on doubles, was given {}",
    "b": "only integers and bools can be formatted as binary, was given {}",
    "x": "only integers, byte buffers, and strings can be formatted as hex, was given {}",
    "X": "only integers, byte buffers, and strings can be formatted as hex, was given {}",
    "o": "octal clause can only be used on integers, was given {}",
}


class _FormatError(Exception):
    """A format error; `pos` is the argument's offset for the compile-time check, else -1."""

    def __init__(self, pos: int, message: str) -> None:
        super().__init__(message)
        self.pos = pos
        self.message = message


def _clause_error(verb: str, type_name: str) -> str:
    return _CLAUSE_ERRORS[verb].format(type_name)


# A clause: (argument index, verb, precision) -> the text; raises _FormatError for a bad argument.
_Clause = Callable[[int, str, int | None], str | None]


def _parse_format(text: str, clause: _Clause, size: int, *, checking: bool = False) -> str:
    """cel-go's parseFormatString: `clause` formats (or checks) each argument in turn.

    `checking`: the compile-time check, whose argument list only counts (cel-go's
    stringFormatChecker.Arg), so a missing argument is found after the end of the string.
    """
    out: list[str] = []
    i = 0
    index = 0
    while i < len(text):
        if text[i] != "%":
            out.append(text[i])
            i += 1
            continue
        if text[i + 1 : i + 2] == "%":
            out.append("%")
            i += 2
            continue
        if not checking and index >= size:
            raise _FormatError(-1, f"index {index} out of range")
        if i + 1 >= len(text):
            raise _FormatError(-1, "unexpected end of string")
        if index >= size:
            raise _FormatError(-1, f"index {index} out of range")
        read, verb, precision = _parse_clause(text, i + 1)
        try:
            formatted = clause(index, verb, precision)
        except _FormatError as error:
            raise _FormatError(error.pos, f"error during formatting: {error.message}") from None
        out.append(formatted or "")
        i = read
        index += 1
    return "".join(out)


def _parse_clause(text: str, i: int) -> tuple[int, str, int | None]:
    precision: int | None = None
    if text[i] == ".":
        i += 1
        start = i
        while i < len(text) and text[i].isascii() and text[i].isdigit():
            i += 1
        if i >= len(text):
            raise _FormatError(
                -1,
                "could not parse formatting clause: error while parsing precision: "
                "could not find end of precision specifier",
            )
        if start == i:
            raise _FormatError(
                -1,
                "could not parse formatting clause: error while parsing precision: error while converting "
                'precision to integer: strconv.Atoi: parsing "": invalid syntax',
            )
        precision = int(text[start:i])
    verb = text[i]
    if verb not in _CLAUSE_ERRORS:
        raise _FormatError(-1, f'could not parse formatting clause: unrecognized formatting clause "{verb}"')
    return i + 1, verb, precision


def _format(member: bool, fmt: Any, args: Any) -> str:
    text, values = _s(fmt), _l(args)

    def clause(index: int, verb: str, precision: int | None) -> str:
        return _format_value(values[index], verb, precision)

    try:
        return _parse_format(text, clause, len(values))
    except _FormatError as error:
        raise _RuntimeError(error.message) from None


def _format_value(value: Any, verb: str, precision: int | None) -> str:
    name = _type_name(value)
    if verb == "s":
        return _format_s(value)
    if verb == "d":
        if name in ("int", "uint"):
            return str(int(value))
    elif verb in "fe":
        special = isinstance(value, str) and value in ("NaN", "Infinity", "-Infinity")
        if name == "double" or special:
            number = float(value.replace("Infinity", "inf")) if special else float(value)
            digits = 6 if precision is None else precision
            return _printer_float(number, verb, digits)
    elif verb == "b":
        if isinstance(value, bool):
            return "1" if value else "0"
        if name in ("int", "uint"):
            return format(int(value), "b")
    elif verb in "xX":
        if isinstance(value, str | bytes):
            data = value.encode() if isinstance(value, str) else value
            hexed = data.hex()
            return hexed.upper() if verb == "X" else hexed
        if name in ("int", "uint"):
            return format(int(value), verb)
    elif verb == "o" and name in ("int", "uint"):
        return format(int(value), "o")
    raise _FormatError(-1, _clause_error(verb, name))


def _format_s(value: Any, nested: bool = False) -> str:
    """cel-go's FormatString: lists and maps with their elements quoted as CEL writes them."""
    if isinstance(value, list):
        return "[" + ", ".join(_format_s(v, nested=True) for v in value) + "]"
    if isinstance(value, dict):
        pairs = []
        for k, v in value.items():
            if not isinstance(k, str | int):
                raise _FormatError(-1, f"no formatting function for map key of type {_type_name(k)}")
            pairs.append((_format_s(k, nested=True), _format_s(v, nested=True)))
        return "{" + ", ".join(f"{k}:{v}" for k, v in sorted(pairs, key=lambda p: p[0])) + "}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if not nested:
            return _go_g(value)
        text = _go_float(value, ".6f")  # elements go through the %f clause (clauseForType)
        return f'"{text}"' if math.isnan(value) or math.isinf(value) else text
    if value is None:
        return "null"
    if isinstance(value, str):
        return _go_quote(value) if nested else value
    if isinstance(value, bytes):
        text = value.decode("utf-8", "replace")
        return "b" + _go_quote(text) if nested else text
    if isinstance(value, int | _UInt):
        return str(int(value))
    if isinstance(value, _TypeValue):
        return value.name
    if isinstance(value, CelQuantity | CelSemver):
        raise _FormatError(-1, _clause_error("s", _type_name(value)))
    return str(value)
