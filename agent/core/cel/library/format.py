"""The strings extension's ``format``: ``%s``, ``%d``, ``%f``, ``%e``, ``%x``, ``%X``, ``%o``, ``%b``."""

from __future__ import annotations

import re
from typing import Any

from agent.core.cel.errors import _RuntimeError
from agent.core.cel.library.arguments import _l, _s, _want
from agent.core.cel.library.operators import _is_num
from agent.core.cel.library.standard import _format_double
from agent.core.cel.values import CelQuantity, CelSemver, _show, _TypeValue

_FORMAT = re.compile(r"%(?:\.(\d+))?([sdfeoxXb%])")


def _format(member: bool, fmt: Any, args: Any) -> str:
    text, values = _s(fmt), _l(args)
    out: list[str] = []
    used = 0
    last = 0
    for m in _FORMAT.finditer(text):
        out.append(text[last : m.start()])
        last = m.end()
        verb = m.group(2)
        if verb == "%":
            out.append("%")
            continue
        if used >= len(values):
            raise _RuntimeError(f"index {used} out of range")
        value = values[used]
        used += 1
        precision = int(m.group(1)) if m.group(1) else None
        if verb == "s":
            out.append(_format_s(value))
        elif verb == "d":
            _want(_is_num(value) and not isinstance(value, float))
            out.append(str(value))
        elif verb in "fe":
            _want(_is_num(value))
            digits = 6 if precision is None else precision
            out.append(f"{float(value):.{digits}{verb}}")
        elif verb in "xX":
            if isinstance(value, str | bytes):
                data = value.encode() if isinstance(value, str) else value
                hexed = data.hex()
            else:
                _want(isinstance(value, int) and not isinstance(value, bool))
                hexed = format(value, "x")
            out.append(hexed.upper() if verb == "X" else hexed)
        elif verb == "o":
            _want(isinstance(value, int) and not isinstance(value, bool))
            out.append(format(value, "o"))
        elif verb == "b":
            _want(isinstance(value, int))
            out.append(format(int(value), "b") if not isinstance(value, bool) else _show(value))
    out.append(text[last:])
    return "".join(out)


def _format_s(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_format_s(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_format_s(k)}: {_format_s(v)}" for k, v in value.items()) + "}"
    if isinstance(value, float):
        return _format_double(value)
    if value is None:
        return "null"
    if isinstance(value, CelQuantity):
        return value.quantity.canonical()
    if isinstance(value, CelSemver):
        return value.text
    if isinstance(value, _TypeValue):
        return value.name
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return _show(value)
