"""CEL's tokens (cel-spec doc/langdef.md, cel-go parser/gen/CEL.g4) and literal unescaping.

Escapes follow cel-go's parser/unescape.go: in a bytes literal ``\\xHH`` and octal escapes are
single bytes, ``\\u``/``\\U`` are not allowed; in a string they are code points.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from agent.core.cel.values import _INT_MAX, _INT_MIN, _UINT_MAX, _UInt


@dataclass(frozen=True)
class _Token:
    kind: str  # "int", "uint", "float", "string", "bytes", "ident", "escident", "op", "error", "eof"
    text: str
    pos: int


class _LexError(Exception):
    def __init__(self, pos: int, message: str) -> None:
        super().__init__(message)
        self.pos = pos
        self.message = message


_STRING_BODY = (
    r"(?:\"\"\"(?:\\.|[^\\])*?\"\"\"|'''(?:\\.|[^\\])*?'''"
    r"|\"(?:\\.|[^\\\"\n\r])*\"|'(?:\\.|[^\\'\n\r])*')"
)
_RAW_BODY = r"(?:\"\"\"[\s\S]*?\"\"\"|'''[\s\S]*?'''|\"[^\"\n\r]*\"|'[^'\n\r]*')"
_TOKENS = re.compile(
    r"(?P<ws>[\t \r\n\f]+|//[^\n]*)"
    rf"|(?P<bytes>[bB](?:[rR]{_RAW_BODY}|{_STRING_BODY}))"
    rf"|(?P<string>[rR]{_RAW_BODY}|{_STRING_BODY})"
    r"|(?P<float>\d+\.\d+(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+|\.\d+(?:[eE][+-]?\d+)?)"
    r"|(?P<uint>(?:0x[0-9a-fA-F]+|\d+)[uU])"
    r"|(?P<int>0x[0-9a-fA-F]+|\d+)"
    r"|(?P<ident>[A-Za-z_][A-Za-z0-9_]*)"
    r"|(?P<escident>`[A-Za-z0-9_./\- ]+`)"
    r"|(?P<op>==|!=|<=|>=|&&|\|\||[<>\[\]{}().,\-!?:+*/%])"
)

_KEYWORDS = {"true", "false", "null", "in"}
_RESERVED = frozenset(
    {
        "as", "break", "const", "continue", "else", "for", "function", "if", "import", "let",
        "loop", "package", "namespace", "return", "var", "void", "while",
    }
)  # fmt: skip


def _tokenize(source: str) -> list[_Token]:
    """The tokens of `source`; raises `_LexError` (cel-go's ``token recognition error``)."""
    tokens: list[_Token] = []
    pos = 0
    while pos < len(source):
        m = _TOKENS.match(source, pos)
        if m is None or m.end() == pos:
            raise _LexError(pos, f"Syntax error: token recognition error at: '{source[pos]}'")
        kind = m.lastgroup or "op"
        text = m.group(0)
        if kind == "ident" and text in _KEYWORDS:
            kind = "op"
        if kind != "ws":
            tokens.append(_Token(kind, text, pos))
        pos = m.end()
    tokens.append(_Token("eof", "<EOF>", len(source)))
    return tokens


def _int_literal(text: str, negative: bool) -> int:
    value = int(text, 16) if text[:2] == "0x" else int(text)
    value = -value if negative else value
    if not _INT_MIN <= value <= _INT_MAX:
        raise ValueError("invalid int literal")
    return value


def _uint_literal(text: str) -> _UInt:
    body = text[:-1]
    value = int(body, 16) if body[:2] == "0x" else int(body)
    if value > _UINT_MAX:
        raise ValueError("invalid uint literal")
    return _UInt(value)


_SIMPLE_ESCAPES = {
    "a": 7, "b": 8, "f": 12, "n": 10, "r": 13, "t": 9, "v": 11,
    "\\": 92, "'": 39, '"': 34, "`": 96, "?": 63,
}  # fmt: skip


def _unquote(text: str, is_bytes: bool) -> str | bytes:
    """A string or bytes literal's value; raises ValueError with cel-go's message."""
    if is_bytes:
        text = text[1:]
    raw = text[:1] in "rR"
    if raw:
        text = text[1:]
    quote = 3 if text[:3] in ('"""', "'''") else 1
    body = text[quote:-quote].replace("\r\n", "\n").replace("\r", "\n")
    if raw or "\\" not in body:
        return body.encode() if is_bytes else body
    out = bytearray()
    i = 0
    while i < len(body):
        c = body[i]
        if c != "\\":
            out += c.encode("utf-8", "surrogatepass")
            i += 1
            continue
        if i + 1 >= len(body):
            raise ValueError("unable to unescape string, found '\\' as last character")
        e = body[i + 1]
        i += 2
        if e in _SIMPLE_ESCAPES:
            out.append(_SIMPLE_ESCAPES[e])
            continue
        if e in "xXuU":
            n = {"x": 2, "X": 2, "u": 4, "U": 8}[e]
            digits = body[i : i + n]
            if (is_bytes and e in "uU") or len(digits) < n or not re.fullmatch(r"[0-9a-fA-F]+", digits):
                raise ValueError("unable to unescape string")
            i += n
            out += _code(int(digits, 16), single_byte=is_bytes)
            continue
        if e in "0123":
            digits = body[i : i + 2]
            if len(digits) < 2 or not re.fullmatch(r"[0-7]{2}", digits):
                raise ValueError("unable to unescape octal sequence in string")
            i += 2
            out += _code(int(e + digits, 8), single_byte=is_bytes)
            continue
        raise ValueError("unable to unescape string")
    if is_bytes:
        return bytes(out)
    return out.decode("utf-8", "surrogatepass")


def _code(value: int, *, single_byte: bool) -> bytes:
    if single_byte:
        return bytes([value])
    if value > 0x10FFFF or 0xD800 <= value <= 0xDFFF:
        raise ValueError("invalid unicode code point")
    return chr(value).encode("utf-8")
