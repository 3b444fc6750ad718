"""CEL limits and error messages, worded as cel-go and the scheduler word them.

Compile errors carry cel-go's ``ERROR: <input>:L:C: message`` with the source line and a caret;
every message is capped to `MAX_MESSAGE` printable characters (no Python state in any message).
"""

from __future__ import annotations

COST_LIMIT = 1_000_000
"""resourceapi.CELSelectorExpressionMaxCost: the scheduler's runtime cost limit per selector."""

MAX_MESSAGE = 512
"""The longest CEL message shown (a compile error's first line, a runtime error)."""

MAX_EXPRESSION = 10 * 1024
"""resourceapi.CELSelectorExpressionMaxLength."""

MAX_LIST = 1_000_000
"""No list or string built while evaluating may grow past this (the cost limit stops it first)."""


class CelError(Exception):
    """The expression does not compile, fails at runtime or does not return a bool."""

    def __init__(self, message: str) -> None:
        super().__init__(_cap(message))


class CelCompileError(CelError):
    """The expression does not compile (the message starts with ``compilation failed: ``)."""


class _RuntimeError(Exception):
    """A CEL runtime error value; its text is cel-go's."""

    def __init__(self, message: str) -> None:
        super().__init__(_cap(message))
        self.message = _cap(message)


def _cap(message: str) -> str:
    message = "".join(c if c.isprintable() or c == "\n" else "?" for c in message)
    return message if len(message) <= MAX_MESSAGE else message[: MAX_MESSAGE - 3] + "..."


def _located(source: str, pos: int, message: str) -> str:
    """cel-go's ``ERROR: <input>:L:C: message`` with the source line and a caret below."""
    line_no = source.count("\n", 0, pos) + 1
    line_start = source.rfind("\n", 0, pos) + 1
    column = pos - line_start + 1
    line_end = source.find("\n", pos)
    # cel-go's ToDisplayString shows a tab in the snippet as a space.
    line = source[line_start : line_end if line_end >= 0 else len(source)].replace("\t", " ")
    return f"ERROR: <input>:{line_no}:{column}: {message}\n | {line}\n | {'.' * (column - 1)}^"


def _no_overload(name: str = "") -> _RuntimeError:
    return _RuntimeError("no such overload" + (f": {name}" if name else ""))
