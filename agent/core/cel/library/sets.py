"""cel-go's sets extension: ``sets.contains``, ``sets.equivalent``, ``sets.intersects``."""

from __future__ import annotations

from typing import Any

from agent.core.cel.library.arguments import _l
from agent.core.cel.library.operators import _equal


def _sets_contains(member: bool, a: Any, b: Any) -> bool:
    left = _l(a)
    return all(any(_equal(x, y) for y in left) for x in _l(b))


def _sets_equivalent(member: bool, a: Any, b: Any) -> bool:
    return _sets_contains(member, a, b) and _sets_contains(member, b, a)


def _sets_intersects(member: bool, a: Any, b: Any) -> bool:
    right = _l(b)
    return any(any(_equal(x, y) for y in right) for x in _l(a))
