"""A small protobuf text-format reader: enough for cel-spec's tests/simple/testdata files.

Messages become dicts of field name -> list of values (every field may repeat); strings are
decoded from their C escapes as UTF-8 (``bytes_value`` keeps the raw bytes, see `raw_bytes`).
"""

from __future__ import annotations

import re
from typing import Any

_TOKEN = re.compile(
    r"""\s+|\#[^\n]*|(?P<str>"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*')"""
    r"""|(?P<num>-?(?:inf(?:inity)?|nan|0x[0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)[fFuU]?)(?![\w.])"""
    r"""|(?P<ident>[A-Za-z_][\w./]*)|(?P<punct>[{}<>\[\]:,;])""",
    re.IGNORECASE,
)

_ESCAPE = {"n": 10, "t": 9, "r": 13, "a": 7, "b": 8, "f": 12, "v": 11, "\\": 92, "'": 39, '"': 34, "?": 63}


class TextprotoError(Exception):
    """The file is not protobuf text format as this reader knows it."""


class RawString(str):
    """A string field's value; `raw` keeps its bytes (for ``bytes_value``)."""

    raw: bytes

    def __new__(cls, raw: bytes) -> RawString:
        text = super().__new__(cls, raw.decode("utf-8", "surrogateescape"))
        text.raw = raw
        return text


def unescape(body: str) -> bytes:
    """C-style escapes (also Go's): ``\\n``, ``\\xHH``, ``\\uHHHH``, ``\\UHHHHHHHH``, octal -> bytes."""
    out = bytearray()
    i = 0
    while i < len(body):
        c = body[i]
        if c != "\\":
            out += c.encode()
            i += 1
            continue
        e = body[i + 1]
        if e in _ESCAPE:
            out.append(_ESCAPE[e])
            i += 2
        elif e in "xX":
            m = re.match(r"[0-9a-fA-F]{1,2}", body[i + 2 :])
            assert m is not None
            out.append(int(m.group(0), 16))
            i += 2 + len(m.group(0))
        elif e in "uU":
            n = 4 if e == "u" else 8
            out += chr(int(body[i + 2 : i + 2 + n], 16)).encode("utf-8", "surrogatepass")
            i += 2 + n
        elif e.isdigit():
            m = re.match(r"[0-7]{1,3}", body[i + 1 :])
            assert m is not None
            out.append(int(m.group(0), 8) & 0xFF)
            i += 1 + len(m.group(0))
        else:
            raise TextprotoError(f"unknown escape \\{e}")
    return bytes(out)


def _tokens(text: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise TextprotoError(f"unexpected text at offset {pos}: {text[pos : pos + 20]!r}")
        pos = m.end()
        if m.lastgroup:
            out.append((m.lastgroup, m.group(0)))
    return out


def parse(text: str) -> dict[str, list[Any]]:
    tokens = _tokens(text)
    message, _ = _message(tokens, 0, None)
    return message


def _message(tokens: list[tuple[str, str]], at: int, close: str | None) -> tuple[dict[str, list[Any]], int]:
    fields: dict[str, list[Any]] = {}
    while at < len(tokens):
        kind, text = tokens[at]
        if kind == "punct" and text == close:
            return fields, at + 1
        if kind == "punct" and text in ",;":
            at += 1
            continue
        if (kind, text) == ("punct", "["):  # an Any's type URL or an extension: [name]
            name = tokens[at + 1][1]
            at += 3
        elif kind != "ident":
            raise TextprotoError(f"expected a field name, found {text!r}")
        else:
            name = text
            at += 1
        if tokens[at] == ("punct", ":"):
            at += 1
        value, at = _value(tokens, at)
        if isinstance(value, list):
            fields.setdefault(name, []).extend(value)
        else:
            fields.setdefault(name, []).append(value)
    if close is not None:
        raise TextprotoError("unexpected end of file")
    return fields, at


def _value(tokens: list[tuple[str, str]], at: int) -> tuple[Any, int]:
    kind, text = tokens[at]
    if kind == "punct" and text in "{<":
        return _message(tokens, at + 1, "}" if text == "{" else ">")
    if kind == "punct" and text == "[":
        items = []
        at += 1
        while tokens[at] != ("punct", "]"):
            if tokens[at] == ("punct", ","):
                at += 1
                continue
            item, at = _value(tokens, at)
            items.append(item)
        return items, at + 1
    if kind == "str":
        raw = b""
        while at < len(tokens) and tokens[at][0] == "str":  # adjacent strings concatenate
            raw += unescape(tokens[at][1][1:-1])
            at += 1
        return RawString(raw), at
    if kind == "num":
        return _number(text), at + 1
    return text, at + 1  # an enum value or true/false


def _number(text: str) -> int | float:
    lowered = text.lower()
    if lowered.lstrip("-") in ("inf", "infinity", "nan"):
        return float(lowered.replace("infinity", "inf"))
    if not lowered.startswith(("0x", "-0x")):
        lowered = lowered.rstrip("fu")
    if lowered.lstrip("-").startswith("0x"):
        return int(lowered, 16)
    if any(c in lowered for c in ".e"):
        return float(lowered)
    return int(lowered)
