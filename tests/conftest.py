"""Shared test fixtures."""

from __future__ import annotations

import pytest

from agent.clock import FakeClock


@pytest.fixture
def fake_clock() -> FakeClock:
    """A manual clock starting at a fixed Unix time."""
    return FakeClock()
