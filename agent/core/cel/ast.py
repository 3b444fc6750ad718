"""The CEL syntax tree: the nodes the parser builds, the checker types and the evaluator runs.

Operators are calls (``_+_``, ``_==_``, ``!_``, ``-_``, ``_[_]``, ``@in``, ``_&&_``, ``_||_``,
``_?_:_``); macros are comprehensions.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class _Node:
    pos: int


@dataclass(frozen=True)
class _Lit(_Node):
    value: Any


@dataclass(frozen=True)
class _Ident(_Node):
    name: str


@dataclass(frozen=True)
class _Select(_Node):
    operand: _Node
    field: str
    test: bool = False  # has()


@dataclass(frozen=True)
class _Call(_Node):
    function: str  # operators: _+_, _==_, !_, -_, _[_], @in, _&&_, _||_, _?_:_
    target: _Node | None
    args: tuple[_Node, ...]


@dataclass(frozen=True)
class _ListLit(_Node):
    items: tuple[_Node, ...]


@dataclass(frozen=True)
class _MapLit(_Node):
    entries: tuple[tuple[_Node, _Node], ...]


@dataclass(frozen=True)
class _Comprehension(_Node):
    """A macro: ``kind`` in all, exists, exists_one, map, filter, transformList, transformMap, bind."""

    kind: str
    range: _Node
    var: str
    var2: str | None
    filter: _Node | None
    body: _Node


def _iter_nodes(node: _Node) -> Iterator[_Node]:  # for tests and debugging
    yield node
    for child in vars(node).values():
        if isinstance(child, _Node):
            yield from _iter_nodes(child)
        elif isinstance(child, tuple):
            for c in child:
                if isinstance(c, _Node):
                    yield from _iter_nodes(c)
                elif isinstance(c, tuple):
                    for cc in c:
                        if isinstance(cc, _Node):
                            yield from _iter_nodes(cc)
