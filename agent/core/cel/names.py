"""Qualified variable names: ``a.b.c`` reads a variable declared as ``a.b.c`` or ``a.b``.

cel-go's checker resolves a selection chain rooted at an identifier to the longest declared
dotted name (checker/checker.go checkSelect), before any comprehension variable of the root's
name; the rest stays field selections. Selectors declare only ``device``; `evaluate` callers may
declare dotted names.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import fields, replace
from typing import Any

from agent.core.cel.ast import _Ident, _Node, _Select


def _dotted(node: _Select) -> tuple[_Ident, list[str]] | None:
    """The root identifier and the field names of a plain selection chain, else None."""
    path: list[str] = []
    operand: _Node = node
    while isinstance(operand, _Select) and not operand.test:
        path.append(operand.field)
        operand = operand.operand
    return (operand, path[::-1]) if isinstance(operand, _Ident) else None


def _qualify(node: _Node, names: Collection[str]) -> _Node:
    """`node` with each selection chain that spells a declared dotted name read as that variable."""
    if not any("." in n for n in names):
        return node
    if isinstance(node, _Select) and not node.test and (chain := _dotted(node)):
        root, path = chain
        if (dotted := ".".join([root.name, *path])) in names:
            return _Ident(root.pos, dotted)
    changes: dict[str, Any] = {}
    for f in fields(node):
        value = getattr(node, f.name)
        if isinstance(value, _Node):
            changes[f.name] = _qualify(value, names)
        elif isinstance(value, tuple) and value and isinstance(value[0], _Node):
            changes[f.name] = tuple(_qualify(v, names) for v in value)
        elif isinstance(value, tuple) and value and isinstance(value[0], tuple):  # map entries
            changes[f.name] = tuple(tuple(_qualify(v, names) for v in entry) for entry in value)
    return replace(node, **changes) if changes else node
