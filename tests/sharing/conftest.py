"""Every test's stand-in MPS daemons are gone when it ends, whatever it asserted."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.sharing.helpers import daemon_pid, kill_quietly


@pytest.fixture(autouse=True)
def no_leftover_daemons(tmp_path: Path) -> Iterator[None]:
    yield
    mps = tmp_path / "state" / "fake-sharing"
    for record in mps.rglob("daemon.json") if mps.exists() else []:
        kill_quietly(daemon_pid(tmp_path, record.parent.name))
