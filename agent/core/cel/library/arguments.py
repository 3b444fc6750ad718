"""Argument checks the functions share: a wrong type raises TypeError, reported as ``no such overload``."""

from __future__ import annotations

from typing import Any

from agent.core.cel.values import _UInt


def _want(cond: bool) -> None:
    if not cond:
        raise TypeError


def _s(value: Any) -> str:
    _want(isinstance(value, str))
    return str(value)


def _i(value: Any) -> int:
    _want(isinstance(value, int) and not isinstance(value, bool | _UInt))
    return int(value)


def _l(value: Any) -> list[Any]:
    _want(isinstance(value, list))
    return list(value)
