"""Reference counting and MPS/time-slicing state through ``kill -9`` (tests/kubelet/crash_harness.py).

The agent process is SIGKILLed at every step of prepare and unprepare; the next start must leave
exactly what the checkpoint's completed claims need: one MPS daemon per device in use (re-adopted
or restarted), none for a device no claim uses (never a leaked or duplicated process), and the
default time-slice interval once no time-sliced share is left.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agent.claims.checkpoint.format import ClaimPhase, decode
from agent.claims.state.hooks import Step
from tests.sharing.helpers import (
    GPU0_UUID,
    MPS,
    TIME_SLICING,
    claim,
    daemon_pid,
    daemons_of,
    intervals,
    kill_quietly,
    share,
    uid,
)

HARNESS = Path(__file__).resolve().parents[1] / "kubelet" / "crash_harness.py"
REPO = Path(__file__).resolve().parents[2]
PREPARE_STEPS = [s for s in Step if s.value.startswith("prepare-")]
UNPREPARE_STEPS = [s for s in Step if s.value.startswith("unprepare-")]


def harness(
    root: Path, op: str, *uids: str, crash_at: Step | None = None
) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, str(HARNESS), str(root), op, *uids, "--sharing"]
    if crash_at is not None:
        args += ["--crash-at", crash_at.value]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(args, capture_output=True, text=True, timeout=120, env=env, check=False)


@pytest.fixture
def root(tmp_path: Path) -> Any:
    yield tmp_path
    for pid in daemons_of(tmp_path):
        kill_quietly(pid)


def completed(root: Path) -> set[str]:
    entries = decode((root / "state" / "checkpoint.json").read_bytes()).entries
    return {u for u, e in entries.items() if e.phase is ClaimPhase.COMPLETED}


@pytest.mark.parametrize("step", PREPARE_STEPS, ids=lambda s: s.value)
def test_kill_during_mps_prepare_leaves_one_daemon_or_none(root: Path, step: Step) -> None:
    claims = [claim(1, share_id=share(1), memory="20Gi", config=MPS)]
    (root / "claims.json").write_text(json.dumps(claims))
    assert harness(root, "prepare", uid(1), crash_at=step).returncode == -9
    assert harness(root, "start").returncode == 0
    if uid(1) in completed(root):
        assert len(daemons_of(root)) == 1 and daemon_pid(root) in daemons_of(root)
    else:
        assert daemons_of(root) == [] and daemon_pid(root) is None


@pytest.mark.parametrize("step", UNPREPARE_STEPS, ids=lambda s: s.value)
def test_kill_while_unpreparing_one_of_two_shares_keeps_the_daemon(root: Path, step: Step) -> None:
    claims = [claim(n, share_id=share(n), memory="20Gi", config=MPS) for n in (1, 2)]
    (root / "claims.json").write_text(json.dumps(claims))
    assert harness(root, "prepare", uid(1), uid(2)).returncode == 0
    (before,) = daemons_of(root)
    assert harness(root, "unprepare", uid(1), crash_at=step).returncode == -9
    assert harness(root, "start").returncode == 0
    assert daemons_of(root) == [before], "the other share's daemon was stopped or duplicated"
    done = harness(root, "unprepare", uid(1), uid(2))
    assert done.returncode == 0 and json.loads(done.stdout) == {uid(1): "", uid(2): ""}
    assert daemons_of(root) == []


@pytest.mark.parametrize("step", UNPREPARE_STEPS, ids=lambda s: s.value)
def test_kill_while_unpreparing_the_last_share(root: Path, step: Step) -> None:
    claims = [claim(1, share_id=share(1), config=MPS)]
    (root / "claims.json").write_text(json.dumps(claims))
    assert harness(root, "prepare", uid(1)).returncode == 0
    assert harness(root, "unprepare", uid(1), crash_at=step).returncode == -9
    assert harness(root, "start").returncode == 0
    assert len(daemons_of(root)) == (1 if uid(1) in completed(root) else 0)
    assert harness(root, "unprepare", uid(1)).returncode == 0  # the kubelet retries
    assert daemons_of(root) == []


@pytest.mark.parametrize("step", PREPARE_STEPS, ids=lambda s: s.value)
def test_kill_during_time_slicing_prepare_restores_or_keeps_the_interval(root: Path, step: Step) -> None:
    claims = [claim(1, share_id=share(1), config=TIME_SLICING)]
    (root / "claims.json").write_text(json.dumps(claims))
    assert harness(root, "prepare", uid(1), crash_at=step).returncode == -9
    assert harness(root, "start").returncode == 0
    expected = 3 if uid(1) in completed(root) else 0
    assert intervals(root).get(GPU0_UUID, 0) == expected
