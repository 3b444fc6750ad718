"""cel-go's strings extension, version 2: indices count Unicode code points, as cel-go does.

``format`` is in `agent.core.cel.library.format`.
"""

from __future__ import annotations

from typing import Any

from agent.core.cel.errors import MAX_LIST, _RuntimeError
from agent.core.cel.library.arguments import _i, _l, _s, _want
from agent.core.cel.library.lists import _list_index_of


def _char_at(member: bool, s: Any, i: Any) -> str:
    text, index = _s(s), _i(i)
    if index < 0 or index > len(text):
        raise _RuntimeError(f"index out of range: {index}")
    return text[index : index + 1]


def _index_of(member: bool, s: Any, sub: Any, *start: Any) -> int:
    """cel-go v0.26 indexOfOffset: past the end is -1, a negative offset an error."""
    if isinstance(s, list):
        return _list_index_of(s, sub, last=False)
    text, part = _s(s), _s(sub)
    offset = _i(start[0]) if start else 0
    if part == "":
        return offset
    if offset < 0:
        raise _RuntimeError(f"index out of range: {offset}")
    if offset >= len(text):
        return -1
    return text.find(part, offset)


def _last_index_of(member: bool, s: Any, sub: Any, *end: Any) -> int:
    """cel-go v0.26 lastIndexOfOffset: past the end is -1, a negative offset an error."""
    if isinstance(s, list):
        return _list_index_of(s, sub, last=True)
    text, part = _s(s), _s(sub)
    if not end:
        return len(text) if part == "" else text.rfind(part)
    offset = _i(end[0])
    if part == "":
        return offset
    if offset < 0:
        raise _RuntimeError(f"index out of range: {offset}")
    if offset >= len(text):
        return -1
    return text.rfind(part, 0, offset + len(part))


_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")
_ASCII_UPPER = str.maketrans("abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ")


def _lower(member: bool, s: Any) -> str:
    return _s(s).translate(_ASCII_LOWER)


def _upper(member: bool, s: Any) -> str:
    return _s(s).translate(_ASCII_UPPER)


def _replace(member: bool, s: Any, old: Any, new: Any, *n: Any) -> str:
    count = _i(n[0]) if n else -1
    text, a, b = _s(s), _s(old), _s(new)
    result = text.replace(a, b) if count < 0 else text.replace(a, b, count)
    if len(result) > MAX_LIST:
        raise _RuntimeError("operation cancelled: actual cost limit exceeded")
    return result


def _split(member: bool, s: Any, sep: Any, *n: Any) -> list[str]:
    text, separator = _s(s), _s(sep)
    limit = _i(n[0]) if n else -1
    if limit == 0:
        return []
    if separator == "":
        parts = list(text)
        if limit > 0 and len(parts) > limit:
            parts = [*parts[: limit - 1], "".join(parts[limit - 1 :])]
        return parts
    return text.split(separator, limit - 1) if limit > 0 else text.split(separator)


def _substring(member: bool, s: Any, start: Any, *end: Any) -> str:
    text = _s(s)
    begin = _i(start)
    stop = _i(end[0]) if end else len(text)
    if begin < 0 or begin > len(text):
        raise _RuntimeError(f"index out of range: {begin}")
    if stop < 0 or stop > len(text):
        raise _RuntimeError(f"index out of range: {stop}")
    if begin > stop:
        raise _RuntimeError(f"invalid substring range. start: {begin}, end: {stop}")
    return text[begin:stop]


_UNICODE_SPACE = " \t\n\v\f\r\x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009"
_UNICODE_SPACE += "\u200a\u2028\u2029\u202f\u205f\u3000"


def _trim(member: bool, s: Any) -> str:
    return _s(s).strip(_UNICODE_SPACE)


def _join(member: bool, items: Any, *sep: Any) -> str:
    parts = _l(items)
    _want(all(isinstance(p, str) for p in parts))
    return (_s(sep[0]) if sep else "").join(parts)


def _quote(member: bool, s: Any) -> str:
    out = []
    for ch in _s(s):
        if ch in "\a\b\f\n\r\t\v":
            out.append("\\" + "abfnrtv"["\a\b\f\n\r\t\v".index(ch)])
        elif ch in '\\"':
            out.append("\\" + ch)
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'
