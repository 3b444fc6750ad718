"""Every test's stand-in MPS daemons are gone when it ends, whatever it asserted."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.sharing.helpers import daemons_of, kill_quietly


@pytest.fixture(autouse=True)
def no_leftover_daemons(tmp_path: Path) -> Iterator[None]:
    yield
    for pid in daemons_of(tmp_path):
        kill_quietly(pid)
