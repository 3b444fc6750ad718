"""The one-hop prepare: a backend that plans (`agent.core.backend.PlansPrepare`).

PrepareStarted, the backend's blocking work, the CDI spec and PrepareCompleted run in one worker
thread hop (`CheckpointStore.put_staged`); the unprepare's backend work runs in the hop that drops
the entry. Crash safety of both is in `tests/kubelet/test_crash.py` (the ``planned`` cases).
"""

from __future__ import annotations

import errno
from pathlib import Path

import anyio
import pytest

import agent.core.atomicfile
from agent.claims.checkpoint.format import ClaimPhase
from tests.kubelet.fakes import DRIVER, NODE, FakeClaimSource, PlanningBackend, make_claim, ref_of
from tests.kubelet.test_state import UID, build, checkpoint, spec_path
from tests.support.hops import count_hops

U2 = "0b7c6a2e-2222-4222-8333-444455556666"


async def test_prepare_and_unprepare_take_one_hop_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    claim = make_claim(UID, devices=("gpu-0", "gpu-1"))
    backend = PlanningBackend()
    state, _ = build(tmp_path, FakeClaimSource([claim]), backend)
    await state.start()
    hops = count_hops(monkeypatch)
    answer = (await state.prepare([ref_of(claim)]))[UID]
    assert not answer.error
    assert [d.cdi_device_ids for d in answer.devices] == [
        (f"k8s.{DRIVER}/claim={UID}-gpu-0",),
        (f"k8s.{DRIVER}/claim={UID}-gpu-1",),
    ]
    assert len(hops) == 1
    assert backend.prepare_calls == 0  # the async prepare was not used
    assert backend.prepared == {UID: {"gpu-0", "gpu-1"}}
    assert checkpoint(tmp_path)[UID].phase is ClaimPhase.COMPLETED
    assert spec_path(tmp_path, UID).exists()
    records = (tmp_path / "state" / "checkpoint.json").read_bytes().splitlines()[1:]
    assert [b'"PrepareStarted"' in r for r in records] == [True, False]  # started, then completed

    hops.clear()
    assert await state.unprepare([ref_of(claim)]) == {UID: ""}
    assert len(hops) == 1
    assert backend.unprepare_calls == 0
    assert backend.prepared == {}
    assert checkpoint(tmp_path) == {}
    assert not spec_path(tmp_path, UID).exists()
    assert backend.planned == [
        ("prepare", "gpu-0"),
        ("prepare", "gpu-1"),
        ("unprepare", "gpu-1"),
        ("unprepare", "gpu-0"),
    ]


async def test_a_refused_plan_fails_the_claim_before_anything_is_written(tmp_path: Path) -> None:
    claim = make_claim(UID, devices=("gpu-0", "gpu-1"))
    backend = PlanningBackend()
    backend.fail_plan = {"gpu-1"}
    state, _ = build(tmp_path, FakeClaimSource([claim]), backend)
    await state.start()
    before = (tmp_path / "state" / "checkpoint.json").read_bytes()
    error = (await state.prepare([ref_of(claim)]))[UID].error
    assert "prepare device 'gpu-1'" in error and "refused at planning" in error
    assert (tmp_path / "state" / "checkpoint.json").read_bytes() == before
    assert backend.planned == [] and backend.unprepare_calls == 0


async def test_unknown_device_at_planning_is_a_claim_error(tmp_path: Path) -> None:
    claim = make_claim(UID, devices=("gpu-9",))
    state, _ = build(tmp_path, FakeClaimSource([claim]), PlanningBackend())
    error = (await state.prepare([ref_of(claim)]))[UID].error
    assert "unknown device 'gpu-9'" in error


async def test_failed_work_rolls_back_the_devices_done_and_the_entry(tmp_path: Path) -> None:
    claim = make_claim(UID, devices=("gpu-0", "gpu-1"))
    backend = PlanningBackend()
    backend.fail_prepare = {"gpu-1"}
    state, _ = build(tmp_path, FakeClaimSource([claim]), backend)
    await state.start()
    error = (await state.prepare([ref_of(claim)]))[UID].error
    assert "backend failed" in error and "device busy" in error
    assert backend.prepared == {}  # gpu-0 undone by the rollback (the backend's async unprepare)
    assert checkpoint(tmp_path) == {}
    assert not spec_path(tmp_path, UID).exists()
    backend.fail_prepare = set()
    assert not (await state.prepare([ref_of(claim)]))[UID].error


async def test_a_checkpoint_that_cannot_be_written_rolls_the_prepare_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    claim = make_claim(UID)
    backend = PlanningBackend()
    state, _ = build(tmp_path, FakeClaimSource([claim]), backend)
    await state.start()

    def disk_full(fd: int, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(agent.core.atomicfile, "write_all", disk_full)
    error = (await state.prepare([ref_of(claim)]))[UID].error
    assert "cannot write the checkpoint" in error and "No space left on device" in error
    monkeypatch.undo()
    assert backend.prepared == {}
    assert not spec_path(tmp_path, UID).exists()
    assert checkpoint(tmp_path) == {}
    assert not (await state.prepare([ref_of(claim)]))[UID].error


async def test_failed_unprepare_work_keeps_the_entry_and_a_retry_completes(tmp_path: Path) -> None:
    claim = make_claim(UID)
    backend = PlanningBackend()
    state, _ = build(tmp_path, FakeClaimSource([claim]), backend)
    await state.prepare([ref_of(claim)])
    backend.fail_unprepare = {"gpu-0"}
    error = (await state.unprepare([ref_of(claim)]))[UID]
    assert "unprepare device 'gpu-0'" in error and "device busy" in error
    assert checkpoint(tmp_path)[UID].phase is ClaimPhase.COMPLETED
    assert spec_path(tmp_path, UID).exists()
    backend.fail_unprepare = set()
    assert await state.unprepare([ref_of(claim)]) == {UID: ""}
    assert checkpoint(tmp_path) == {} and backend.prepared == {}


async def test_shared_or_contended_devices_take_the_backends_own_calls(tmp_path: Path) -> None:
    """A share, or a device another claim holds, goes through `prepare` (and its conflict checks)."""
    share = "6f1c2a1e-0000-4000-8000-000000000001"
    shared = make_claim(
        UID, results=[{"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0", "shareID": share}]
    )
    first, second = (
        make_claim(U2, devices=("gpu-1",)),
        make_claim("0b7c6a2e-3333-4222-8333-444455556666", devices=("gpu-1",)),
    )
    backend = PlanningBackend()
    state, _ = build(tmp_path, FakeClaimSource([shared, first, second]), backend)
    await state.prepare([ref_of(shared)])
    assert backend.prepare_calls == 1 and backend.planned == []
    await state.prepare([ref_of(first)])
    assert backend.prepare_calls == 1 and backend.planned == [("prepare", "gpu-1")]
    await state.prepare([ref_of(second)])  # gpu-1 is held by the first claim
    assert backend.prepare_calls == 2


async def test_concurrent_planned_prepares_share_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    claims = [make_claim(f"0b7c6a2e-{i:04d}-4222-8333-444455556666", devices=(f"gpu-{i}",)) for i in range(8)]
    state, backend = build(tmp_path, FakeClaimSource(claims), PlanningBackend())
    await state.start()
    hops = count_hops(monkeypatch)
    async with anyio.create_task_group() as tg:
        for claim in claims:
            tg.start_soon(state.prepare, [ref_of(claim)])
    assert len(hops) < len(claims)
    assert {uid for uid, e in checkpoint(tmp_path).items() if e.phase is ClaimPhase.COMPLETED} == {
        c["metadata"]["uid"] for c in claims
    }
    assert len(backend.prepared) == 8
