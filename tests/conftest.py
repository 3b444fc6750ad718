"""Shared test fixtures."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from tests.support.clock import FakeClock


@pytest.fixture
def fake_clock() -> FakeClock:
    """A manual clock starting at a fixed Unix time."""
    return FakeClock()


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    """Undo `setup_logging` of CLI tests: a handler left on a closed capture stream breaks later tests."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
