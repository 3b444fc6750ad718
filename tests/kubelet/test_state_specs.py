"""CDI specs are never lost while the checkpoint holds their claim (issue 13, point 5).

An unprepare deletes the spec only after the checkpoint dropped the claim; a prepare answered
from the checkpoint first checks that the spec is still there and rewrites it when it is not.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from pathlib import Path

import pytest

import agent.core.atomicfile
from agent.claims.checkpoint.format import ClaimPhase
from agent.observe.metrics import Metrics
from tests.kubelet.fakes import FakeClaimSource, make_claim, ref_of
from tests.kubelet.test_state import UID, build, checkpoint, spec_path


def failing_write(code: int, message: str) -> Callable[[int, bytes], None]:
    def fail(fd: int, data: bytes) -> None:
        raise OSError(code, message)

    return fail


STATE_DIR_FAILURES = [
    pytest.param(errno.ENOSPC, "No space left on device", id="full"),
    pytest.param(errno.EROFS, "Read-only file system", id="read-only"),
]


@pytest.mark.parametrize(("code", "message"), STATE_DIR_FAILURES)
async def test_unprepare_that_cannot_write_the_checkpoint_keeps_the_spec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, message: str
) -> None:
    claim = make_claim(UID, devices=("gpu-0", "gpu-1"))
    state, backend = build(tmp_path, FakeClaimSource([claim]))
    await state.start()
    first = (await state.prepare([ref_of(claim)]))[UID]
    spec = spec_path(tmp_path, UID).read_bytes()

    monkeypatch.setattr(agent.core.atomicfile, "write_all", failing_write(code, message))
    error = (await state.unprepare([ref_of(claim)]))[UID]
    assert "cannot write the checkpoint" in error
    assert message in error
    # The claim is still prepared for the checkpoint, so its spec is still there.
    assert spec_path(tmp_path, UID).read_bytes() == spec
    assert checkpoint(tmp_path)[UID].phase is ClaimPhase.COMPLETED
    assert backend.prepared == {}  # the backend part was undone before the checkpoint write

    # A prepare before the kubelet's unprepare retry gets working CDI IDs and a prepared backend.
    monkeypatch.undo()
    again = (await state.prepare([ref_of(claim)]))[UID]
    assert again == first
    assert spec_path(tmp_path, UID).read_bytes() == spec
    assert backend.prepared == {UID: {"gpu-0", "gpu-1"}}
    # And the retry of the unprepare then completes.
    assert await state.unprepare([ref_of(claim)]) == {UID: ""}
    assert not spec_path(tmp_path, UID).exists()
    assert checkpoint(tmp_path) == {}


async def test_unprepare_retry_after_a_checkpoint_failure_completes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    claim = make_claim(UID)
    state, backend = build(tmp_path, FakeClaimSource([claim]))
    await state.prepare([ref_of(claim)])
    monkeypatch.setattr(agent.core.atomicfile, "write_all", failing_write(errno.ENOSPC, "full"))
    assert (await state.unprepare([ref_of(claim)]))[UID]
    monkeypatch.undo()
    assert await state.unprepare([ref_of(claim)]) == {UID: ""}
    assert not spec_path(tmp_path, UID).exists()
    assert checkpoint(tmp_path) == {}
    assert backend.prepared == {}


async def test_spec_that_cannot_be_removed_after_the_checkpoint_is_removed_by_the_retry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    claim = make_claim(UID)
    state, _ = build(tmp_path, FakeClaimSource([claim]))
    await state.prepare([ref_of(claim)])
    real_remove = state.cdi.remove_claim_spec

    def cannot_unlink(uid: str) -> bool:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(state.cdi, "remove_claim_spec", cannot_unlink)
    error = (await state.unprepare([ref_of(claim)]))[UID]
    assert "cannot remove CDI spec: Permission denied" in error
    assert checkpoint(tmp_path) == {}  # the checkpoint went first
    assert spec_path(tmp_path, UID).exists()
    monkeypatch.setattr(state.cdi, "remove_claim_spec", real_remove)
    assert await state.unprepare([ref_of(claim)]) == {UID: ""}
    assert not spec_path(tmp_path, UID).exists()


async def test_prepare_rewrites_a_spec_that_vanished(tmp_path: Path) -> None:
    """E.g. someone cleaned the CDI root: the cached answer alone would name a missing file."""
    claim = make_claim(UID, devices=("gpu-0", "gpu-1"))
    metrics = Metrics()
    state, _ = build(tmp_path, FakeClaimSource([claim]), metrics=metrics)
    first = (await state.prepare([ref_of(claim)]))[UID]
    spec = spec_path(tmp_path, UID).read_bytes()
    spec_path(tmp_path, UID).unlink()
    assert (await state.prepare([ref_of(claim)]))[UID] == first
    assert spec_path(tmp_path, UID).read_bytes() == spec
    assert metrics.claim_operations.labels("gpu.example.com", "prepare", "success")._value.get() == 2


async def test_prepare_that_cannot_rewrite_a_vanished_spec_fails_the_claim(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    claim = make_claim(UID)
    state, _ = build(tmp_path, FakeClaimSource([claim]))
    await state.prepare([ref_of(claim)])
    spec_path(tmp_path, UID).unlink()
    monkeypatch.setattr(agent.core.atomicfile, "write_all", failing_write(errno.ENOSPC, "No space"))
    error = (await state.prepare([ref_of(claim)]))[UID].error
    assert "cannot write CDI spec" in error
    # Still prepared for the kubelet's retry, which succeeds once there is space.
    monkeypatch.undo()
    assert (await state.prepare([ref_of(claim)]))[UID].error == ""
    assert spec_path(tmp_path, UID).exists()


async def test_prepare_that_cannot_redo_the_backend_fails_the_claim(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    claim = make_claim(UID)
    state, backend = build(tmp_path, FakeClaimSource([claim]))
    await state.prepare([ref_of(claim)])
    spec_path(tmp_path, UID).unlink()
    backend.fail_prepare.add("gpu-0")
    assert "device busy" in (await state.prepare([ref_of(claim)]))[UID].error
    assert not spec_path(tmp_path, UID).exists()
    assert checkpoint(tmp_path)[UID].phase is ClaimPhase.COMPLETED
