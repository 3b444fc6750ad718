"""RE2 patterns with Go's regexp messages, and the Kubernetes regex library (``find``, ``findAll``)."""

from __future__ import annotations

import functools
from typing import Any

import re2  # type: ignore[import-untyped]

from agent.core.cel.errors import _RuntimeError
from agent.core.cel.library.arguments import _i, _s


def _re(pattern: Any) -> Any:
    try:
        return _compiled_regex(_s(pattern))
    except re2.error as error:
        raise _RuntimeError(f"error parsing regexp: {_re2_message(error)}: `{pattern}`") from None


@functools.lru_cache(maxsize=256)
def _compiled_regex(pattern: str) -> Any:
    options = re2.Options()
    options.log_errors = False
    return re2.compile(pattern, options)


_GO_REGEXP = {
    "missing ]": "missing closing ]",
    "missing )": "missing closing )",
    "unexpected )": "unexpected )",
    "bad repetition operator": "invalid nested repetition operator",
    "no argument for repetition operator": "missing argument to repetition operator",
    "trailing \\": "trailing backslash at end of expression",
    "invalid escape sequence": "invalid escape sequence",
    "bad character class range": "invalid character class range",
    "invalid character class": "invalid character class",
    "invalid repetition size": "invalid repeat count",
    "invalid perl operator": "invalid or unsupported Perl syntax",
}


def _re2_message(error: Exception) -> str:
    """RE2's message in Go's regexp wording (the scheduler is Go; ``error parsing regexp: ...``)."""
    raw = error.args[0] if error.args else ""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    head = text.split(":")[0].strip()
    return _GO_REGEXP.get(head, head or "invalid pattern")


def _find_re(pattern: Any) -> Any:
    """The Kubernetes regex library reports a pattern that does not compile as ``Illegal regex``."""
    try:
        return _re(pattern)
    except _RuntimeError as error:
        raise _RuntimeError(f"Illegal regex: {error.message.removesuffix(f': `{pattern}`')}") from None


def _find(member: bool, s: Any, pattern: Any) -> str:
    found = _find_re(pattern).search(_s(s))
    return "" if found is None else str(found.group(0))


def _find_all(member: bool, s: Any, pattern: Any, *n: Any) -> list[str]:
    limit = _i(n[0]) if n else -1
    if limit == 0:
        return []
    found = [m.group(0) for m in _find_re(pattern).finditer(_s(s))]
    return found[:limit] if limit > 0 else found
