"""Prepare and unprepare through DeviceState with an in-memory API server and backend."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import anyio
import pytest
import yaml

import agent.claims.checkpoint.file
import agent.claims.state.prepare
import agent.claims.state.unprepare
import agent.core.atomicfile
from agent.claims.checkpoint.format import ClaimPhase, decode
from agent.claims.checkpoint.store import CheckpointWriteError
from agent.claims.filelock import FileLock
from agent.claims.preparer import ClaimPreparer, PreparedDevice, PrepareResult
from agent.claims.state.hooks import Step
from agent.claims.state.machine import DeviceState
from agent.core.backend import ClaimRef
from agent.core.errors import ClaimRequestError, KubeApiError
from agent.observe.metrics import Metrics
from tests.kubelet.fakes import DRIVER, NODE, FakeBackend, FakeClaimSource, FakeEvents, make_claim, ref_of

UID = "0b7c6a2e-1111-4222-8333-444455556666"


def build(
    tmp_path: Path, source: FakeClaimSource, backend: FakeBackend | None = None, **kwargs: Any
) -> tuple[DeviceState, FakeBackend]:
    backend = backend or FakeBackend()
    state = DeviceState(
        DRIVER,
        backend,
        source,
        node_name=NODE,
        cdi_root=tmp_path / "cdi",
        state_dir=tmp_path / "state",
        boot_id="boot-1",
        **kwargs,
    )
    return state, backend


def spec_path(tmp_path: Path, uid: str) -> Path:
    return tmp_path / "cdi" / f"k8s.{DRIVER}-claim_{uid}.yaml"


def checkpoint(tmp_path: Path) -> dict[str, Any]:
    return dict(decode((tmp_path / "state" / "checkpoint.json").read_bytes()).entries)


async def test_prepare_writes_spec_checkpoint_and_answers(tmp_path: Path) -> None:
    claim = make_claim(UID, devices=("gpu-0", "gpu-1"))
    state, backend = build(tmp_path, FakeClaimSource([claim]))
    backend.extra_cdi_ids = ("vendor.com/gpu=all",)
    preparer: ClaimPreparer = state
    await state.start()
    results = await preparer.prepare([ref_of(claim)])
    name0, name1 = f"{UID}-gpu-0", f"{UID}-gpu-1"
    assert results == {
        UID: PrepareResult(
            devices=(
                PreparedDevice(
                    ("gpu",), NODE, "gpu-0", (f"k8s.{DRIVER}/claim={name0}", "vendor.com/gpu=all")
                ),
                PreparedDevice(
                    ("gpu",), NODE, "gpu-1", (f"k8s.{DRIVER}/claim={name1}", "vendor.com/gpu=all")
                ),
            )
        )
    }
    text = spec_path(tmp_path, UID).read_text()
    assert text.startswith("---\n")
    spec = yaml.safe_load(text)
    assert spec["kind"] == f"k8s.{DRIVER}/claim"
    assert spec["cdiVersion"] == "0.5.0"
    assert [d["name"] for d in spec["devices"]] == [name0, name1]
    assert "FAKE_VISIBLE_DEVICES=gpu-0,gpu-1" in spec["devices"][0]["containerEdits"]["env"]
    entry = checkpoint(tmp_path)[UID]
    assert entry.phase is ClaimPhase.COMPLETED
    assert entry.namespace == "default"
    assert backend.prepared == {UID: {"gpu-0", "gpu-1"}}
    assert set(state.prepared_claims()) == {UID}


async def test_empty_request_gets_empty_answer(tmp_path: Path) -> None:
    source = FakeClaimSource()
    state, _ = build(tmp_path, source)
    assert await state.prepare([]) == {}
    assert await state.unprepare([]) == {}
    assert source.gets == 0


async def test_repeated_prepare_returns_same_answer_without_redoing(tmp_path: Path) -> None:
    claim = make_claim(UID)
    state, backend = build(tmp_path, FakeClaimSource([claim]))
    first = await state.prepare([ref_of(claim)])
    mtime = spec_path(tmp_path, UID).stat().st_mtime_ns
    second = await state.prepare([ref_of(claim), ref_of(claim)])
    assert first == second
    assert backend.prepare_calls == 1
    assert spec_path(tmp_path, UID).stat().st_mtime_ns == mtime


async def test_subrequests_answer_base_names(tmp_path: Path) -> None:
    results = [
        {"request": "gpu/large", "driver": DRIVER, "pool": NODE, "device": "gpu-0"},
        {"request": "x", "driver": "other.example.com", "pool": "p", "device": "d"},
    ]
    claim = make_claim(UID, results=results)
    state, _ = build(tmp_path, FakeClaimSource([claim]))
    answer = await state.prepare([ref_of(claim)])
    assert answer[UID].devices[0].requests == ("gpu",)


async def test_shared_device_names_carry_share_id(tmp_path: Path) -> None:
    share = "6f1c2a1e-0000-4000-8000-000000000001"
    results = [{"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0", "shareID": share}]
    claim = make_claim(UID, results=results)
    state, _ = build(tmp_path, FakeClaimSource([claim]))
    device = (await state.prepare([ref_of(claim)]))[UID].devices[0]
    assert device.share_id == share
    assert device.cdi_device_ids == (f"k8s.{DRIVER}/claim={UID}-gpu-0-{share}",)


async def test_claim_of_other_drivers_only_is_empty_success(tmp_path: Path) -> None:
    claim = make_claim(UID, driver="other.example.com")
    state, backend = build(tmp_path, FakeClaimSource([claim]))
    assert await state.prepare([ref_of(claim)]) == {UID: PrepareResult()}
    assert backend.prepare_calls == 0
    assert not (tmp_path / "cdi").exists() or not any((tmp_path / "cdi").iterdir())


@pytest.mark.parametrize(
    ("setup", "match", "code"),
    [
        ("down", "retrieve claim default/claim-.*: cannot reach the API server", "UNAVAILABLE"),
        ("missing", 'retrieve claim default/claim-x: .*"claim-x" not found', "NOT_FOUND"),
        ("unallocated", "claim default/claim-x not allocated", "FAILED_PRECONDITION"),
        ("replaced", "claim default/claim-x got replaced", "FAILED_PRECONDITION"),
    ],
)
async def test_whole_request_failures(tmp_path: Path, setup: str, match: str, code: str) -> None:
    good = make_claim(UID)
    source = FakeClaimSource([good])
    bad_ref = ClaimRef("default", "claim-x", "x")
    if setup == "down":
        source.down = True
    elif setup == "unallocated":
        source.add(make_claim("x", allocated=False))
    elif setup == "replaced":
        source.add(make_claim("x-new", name="claim-x"))
    metrics = Metrics()
    state, backend = build(tmp_path, source, metrics=metrics)
    with pytest.raises(ClaimRequestError, match=match) as info:
        await state.prepare([ref_of(good), bad_ref])
    assert info.value.code == code
    assert backend.prepare_calls == 0


async def test_other_node_and_unknown_device_are_per_claim_errors(tmp_path: Path) -> None:
    other = make_claim("u-other", pool="node-b")
    unknown = make_claim("u-unknown", devices=("gpu-0", "gpu-99"))
    good = make_claim(UID)
    metrics = Metrics()
    state, backend = build(tmp_path, FakeClaimSource([other, unknown, good]), metrics=metrics)
    results = await state.prepare([ref_of(other), ref_of(unknown), ref_of(good)])
    assert "allocated on another node" in results["u-other"].error
    assert "unknown device 'gpu-99'" in results["u-unknown"].error
    assert results[UID].error == ""
    # gpu-0 of the failed claim was rolled back: nothing left of it anywhere.
    assert backend.prepared == {UID: {"gpu-0"}}
    assert set(checkpoint(tmp_path)) == {UID}
    assert [p.name for p in (tmp_path / "cdi").iterdir()] == [spec_path(tmp_path, UID).name]
    errors = metrics.claim_errors
    assert errors.labels(DRIVER, "prepare", "other_node")._value.get() == 1
    assert errors.labels(DRIVER, "prepare", "unknown_device")._value.get() == 1
    assert metrics.claim_operations.labels(DRIVER, "prepare", "success")._value.get() == 1
    assert metrics.prepared_claims.labels(DRIVER)._value.get() == 1


async def test_backend_failure_rolls_back_prepared_devices(tmp_path: Path) -> None:
    claim = make_claim(UID, devices=("gpu-0", "gpu-1", "gpu-2"))
    backend = FakeBackend(fail_prepare={"gpu-1"})
    state, _ = build(tmp_path, FakeClaimSource([claim]), backend)
    results = await state.prepare([ref_of(claim)])
    assert "prepare device 'gpu-1'" in results[UID].error
    assert "device busy" in results[UID].error
    assert backend.prepared == {}
    assert checkpoint(tmp_path) == {}
    assert not spec_path(tmp_path, UID).exists()
    # Once the device is free again, the kubelet's retry works.
    backend.fail_prepare.clear()
    assert (await state.prepare([ref_of(claim)]))[UID].error == ""


async def test_failed_rollback_leaves_started_entry_that_a_retry_completes(tmp_path: Path) -> None:
    claim = make_claim(UID, devices=("gpu-0", "gpu-1"))
    backend = FakeBackend(fail_prepare={"gpu-1"}, fail_unprepare={"gpu-0"})
    state, _ = build(tmp_path, FakeClaimSource([claim]), backend)
    assert (await state.prepare([ref_of(claim)]))[UID].error
    assert checkpoint(tmp_path)[UID].phase is ClaimPhase.STARTED
    backend.fail_prepare.clear()
    backend.fail_unprepare.clear()
    assert (await state.prepare([ref_of(claim)]))[UID].error == ""
    assert checkpoint(tmp_path)[UID].phase is ClaimPhase.COMPLETED


def disk_full(fd: int, data: bytes) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


async def test_disk_full_on_cdi_write_is_a_claim_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    claim = make_claim(UID)
    state, backend = build(tmp_path, FakeClaimSource([claim]))
    await state.start()
    real_put = state.store.put
    calls = 0

    async def put_then_fill_disk(entry: Any, durable: bool = True, before: Any = None) -> None:
        nonlocal calls
        calls += 1
        await real_put(entry, durable=durable, before=before)
        if calls == 1:  # PrepareStarted is on disk; now the disk fills up
            monkeypatch.setattr(agent.core.atomicfile, "write_all", disk_full)

    monkeypatch.setattr(state.store, "put", put_then_fill_disk)
    results = await state.prepare([ref_of(claim)])
    assert "cannot write CDI spec" in results[UID].error
    assert "No space left on device" in results[UID].error
    assert backend.prepared == {}
    assert not any(p.name.endswith(".tmp") for p in (tmp_path / "cdi").iterdir())
    # The entry could not be dropped (disk still full): it stays PrepareStarted, reconciled at start.
    assert checkpoint(tmp_path)[UID].phase is ClaimPhase.STARTED


async def test_disk_full_on_checkpoint_is_a_claim_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    claim = make_claim(UID)
    state, backend = build(tmp_path, FakeClaimSource([claim]))
    await state.start()
    before = (tmp_path / "state" / "checkpoint.json").read_bytes()
    monkeypatch.setattr(agent.core.atomicfile, "write_all", disk_full)
    results = await state.prepare([ref_of(claim)])
    assert "cannot write the checkpoint" in results[UID].error
    assert "free space" in results[UID].error
    assert backend.prepare_calls == 0
    assert (tmp_path / "state" / "checkpoint.json").read_bytes() == before
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == ["checkpoint.json"]


async def test_unprepare(tmp_path: Path) -> None:
    claim = make_claim(UID, devices=("gpu-0", "gpu-1"))
    metrics = Metrics()
    state, backend = build(tmp_path, FakeClaimSource([claim]), metrics=metrics)
    await state.prepare([ref_of(claim)])
    unknown = ClaimRef("default", "nope", "u-unknown")
    assert await state.unprepare([ref_of(claim), unknown]) == {UID: "", "u-unknown": ""}
    assert backend.prepared == {}
    assert not spec_path(tmp_path, UID).exists()
    assert checkpoint(tmp_path) == {}
    assert state.prepared_claims() == {}
    assert metrics.prepared_devices.labels(DRIVER)._value.get() == 0
    assert metrics.claim_operations.labels(DRIVER, "unprepare", "success")._value.get() == 2
    # Again: unknown now, still success.
    assert await state.unprepare([ref_of(claim)]) == {UID: ""}


async def test_unprepare_makes_no_api_call(tmp_path: Path) -> None:
    claim = make_claim(UID)
    source = FakeClaimSource([claim])
    state, _ = build(tmp_path, source)
    await state.prepare([ref_of(claim)])
    source.down = True
    gets = source.gets
    assert await state.unprepare([ref_of(claim)]) == {UID: ""}
    assert source.gets == gets


async def test_unprepare_backend_failure_keeps_entry_for_retry(tmp_path: Path) -> None:
    claim = make_claim(UID)
    state, backend = build(tmp_path, FakeClaimSource([claim]))
    await state.prepare([ref_of(claim)])
    backend.fail_unprepare.add("gpu-0")
    error = (await state.unprepare([ref_of(claim)]))[UID]
    assert "unprepare device 'gpu-0'" in error
    assert spec_path(tmp_path, UID).exists()
    assert UID in checkpoint(tmp_path)
    backend.fail_unprepare.clear()
    assert await state.unprepare([ref_of(claim)]) == {UID: ""}


async def test_unprepare_unknown_claim_removes_stray_spec(tmp_path: Path) -> None:
    state, _ = build(tmp_path, FakeClaimSource())
    spec_path(tmp_path, UID).parent.mkdir(parents=True)
    spec_path(tmp_path, UID).write_text("---\n")
    assert await state.unprepare([ClaimRef("ns", "n", UID)]) == {UID: ""}
    assert not spec_path(tmp_path, UID).exists()


async def test_unprepare_disk_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    claim = make_claim(UID)
    state, _ = build(tmp_path, FakeClaimSource([claim]))
    await state.prepare([ref_of(claim)])
    monkeypatch.setattr(agent.core.atomicfile, "write_all", disk_full)
    error = (await state.unprepare([ref_of(claim)]))[UID]
    assert "cannot write the checkpoint" in error
    monkeypatch.undo()
    assert await state.unprepare([ref_of(claim)]) == {UID: ""}

    def cannot_unlink(path: Path) -> bool:
        raise PermissionError(errno.EACCES, "Permission denied")

    await state.prepare([ref_of(claim)])
    monkeypatch.setattr(state.cdi, "remove_claim_spec", cannot_unlink)
    assert "cannot remove CDI spec" in (await state.unprepare([ref_of(claim)]))[UID]
    assert "Permission denied" in (await state.unprepare([ClaimRef("a", "b", "unknown")]))["unknown"]


async def test_hundred_claims_concurrently(tmp_path: Path) -> None:
    claims = [make_claim(f"u{i:03d}", devices=(f"gpu-{i % 8}",)) for i in range(100)]
    backend = FakeBackend(delay=0.01)
    state, _ = build(tmp_path, FakeClaimSource(claims), backend)
    await state.start()
    results = await state.prepare([ref_of(c) for c in claims])
    assert len(results) == 100
    assert all(r.error == "" and len(r.devices) == 1 for r in results.values())
    assert backend.max_in_flight > 1  # claims really ran concurrently
    assert len(checkpoint(tmp_path)) == 100
    assert len(list((tmp_path / "cdi").iterdir())) == 100
    assert set((await state.unprepare([ref_of(c) for c in claims])).values()) == {""}
    assert checkpoint(tmp_path) == {}
    assert list((tmp_path / "cdi").iterdir()) == []


async def test_same_claim_in_concurrent_calls_is_prepared_once(tmp_path: Path) -> None:
    claim = make_claim(UID)
    backend = FakeBackend(delay=0.01)
    state, _ = build(tmp_path, FakeClaimSource([claim]), backend)
    answers: list[Any] = []

    async def call() -> None:
        answers.append(await state.prepare([ref_of(claim)]))

    async with anyio.create_task_group() as tg:
        for _ in range(5):
            tg.start_soon(call)
    assert backend.prepare_calls == 1
    assert all(a == answers[0] for a in answers)
    assert backend.max_in_flight == 1


async def test_file_lock_serializes_and_gets_happen_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    claim = make_claim(UID)
    source = FakeClaimSource([claim])
    lock_path = tmp_path / "serialize.lock"
    state, backend = build(tmp_path, source, lock_path=lock_path)
    other_agent = FileLock(lock_path)  # a second open file description, as another pod has
    fetched = anyio.Event()
    real_get = source.get_resource_claim

    async def get(namespace: str, name: str) -> Any:
        claim = await real_get(namespace, name)
        fetched.set()
        return claim

    monkeypatch.setattr(source, "get_resource_claim", get)
    await other_agent.acquire()
    async with anyio.create_task_group() as tg:
        tg.start_soon(state.prepare, [ref_of(claim)])
        with anyio.fail_after(5):
            await fetched.wait()
        await anyio.sleep(0.05)
        assert backend.prepare_calls == 0  # the GET happened; prepare waits for the lock
        other_agent.release()
    assert backend.prepare_calls == 1
    other_agent.close()


class BlockingBackend(FakeBackend):
    """Blocks forever in prepare of `block`, after setting `blocked`."""

    def __init__(self, block: str) -> None:
        super().__init__()
        self.block = block
        self.blocked = anyio.Event()

    async def prepare(self, device: str, claim: ClaimRef) -> Any:
        if device == self.block:
            self.blocked.set()
            await anyio.sleep_forever()
        return await super().prepare(device, claim)


async def test_cancelled_prepare_rolls_back(tmp_path: Path) -> None:
    claim = make_claim(UID, devices=("gpu-0", "gpu-1"))
    backend = BlockingBackend("gpu-1")
    state, _ = build(tmp_path, FakeClaimSource([claim]), backend)
    async with anyio.create_task_group() as tg:
        tg.start_soon(state.prepare, [ref_of(claim)])
        with anyio.fail_after(5):
            await backend.blocked.wait()
        assert backend.prepared == {UID: {"gpu-0"}}
        tg.cancel_scope.cancel()  # the kubelet's deadline passed
    assert backend.prepared == {}
    assert checkpoint(tmp_path) == {}
    assert not spec_path(tmp_path, UID).exists()


async def test_cancelled_during_prepare_started_write_rolls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    claim = make_claim(UID)
    state, backend = build(tmp_path, FakeClaimSource([claim]))
    real_put = state.store.put
    writing = anyio.Event()

    async def slow_put(entry: Any, durable: bool = True) -> None:
        await real_put(entry, durable=durable)
        if entry.phase is ClaimPhase.STARTED:
            writing.set()
            await anyio.sleep_forever()

    monkeypatch.setattr(state.store, "put", slow_put)
    async with anyio.create_task_group() as tg:
        tg.start_soon(state.prepare, [ref_of(claim)])
        with anyio.fail_after(5):
            await writing.wait()
        tg.cancel_scope.cancel()
    assert checkpoint(tmp_path) == {}
    assert backend.prepare_calls == 0


async def test_unexpected_backend_exception_is_a_claim_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    claim = make_claim(UID)
    state, backend = build(tmp_path, FakeClaimSource([claim]))

    async def broken(device: str, ref: ClaimRef) -> Any:
        raise RuntimeError("bug")

    monkeypatch.setattr(backend, "prepare", broken)
    results = await state.prepare([ref_of(claim)])
    assert "backend failed: RuntimeError('bug')" in results[UID].error


async def test_internal_errors_answer_every_claim(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    claim = make_claim(UID)
    state, _ = build(tmp_path, FakeClaimSource([claim]))

    async def broken(*args: Any) -> Any:
        raise RuntimeError("bug")

    monkeypatch.setattr(agent.claims.state.prepare, "_prepare_claim", broken)
    monkeypatch.setattr(agent.claims.state.unprepare, "_unprepare_claim", broken)
    assert "internal error" in (await state.prepare([ref_of(claim)]))[UID].error
    assert "internal error" in (await state.unprepare([ref_of(claim)]))[UID]


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (KubeApiError("forbidden", status=403), "PERMISSION_DENIED"),
        (KubeApiError("overloaded", status=429), "UNAVAILABLE"),
        (KubeApiError("internal", status=500), "UNAVAILABLE"),
        (KubeApiError("bad", status=400), "FAILED_PRECONDITION"),
        (ConnectionResetError("reset by peer"), "UNAVAILABLE"),
        (TimeoutError("timed out"), "UNAVAILABLE"),
    ],
)
async def test_api_errors_map_to_grpc_codes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: Exception, code: str
) -> None:
    source = FakeClaimSource()

    async def failing(namespace: str, name: str) -> Any:
        raise error

    monkeypatch.setattr(source, "get_resource_claim", failing)
    metrics = Metrics()
    state, _ = build(tmp_path, source, metrics=metrics)
    with pytest.raises(ClaimRequestError, match="retrieve claim default/c: ") as info:
        await state.prepare([ClaimRef("default", "c", "u")])
    assert info.value.code == code
    assert metrics.claim_errors.labels(DRIVER, "prepare", "api")._value.get() == 1


async def test_rollback_survives_cdi_removal_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    claim = make_claim(UID, devices=("gpu-0", "gpu-1"))
    backend = FakeBackend(fail_prepare={"gpu-1"})
    state, _ = build(tmp_path, FakeClaimSource([claim]), backend)

    def cannot_unlink(uid: str) -> bool:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(state.cdi, "remove_claim_spec", cannot_unlink)
    assert "device busy" in (await state.prepare([ref_of(claim)]))[UID].error
    # Not clean: the entry stays PrepareStarted so that the next start rolls it back again.
    assert checkpoint(tmp_path)[UID].phase is ClaimPhase.STARTED
    assert backend.prepared == {}


async def test_two_agents_in_a_rolling_update_share_the_checkpoint(tmp_path: Path) -> None:
    c1, c2 = make_claim(UID), make_claim("u2", devices=("gpu-1",))
    source = FakeClaimSource([c1, c2])
    lock = tmp_path / "serialize.lock"
    old, _ = build(tmp_path, source, lock_path=lock)
    await old.start()
    assert (await old.prepare([ref_of(c1)]))[UID].error == ""
    new, _ = build(tmp_path, source, lock_path=lock)
    await new.start()
    assert (await new.prepare([ref_of(c2)]))["u2"].error == ""
    # The old pod still serves a last unprepare: it must not drop the new pod's entry.
    assert await old.unprepare([ref_of(c1)]) == {UID: ""}
    assert set(checkpoint(tmp_path)) == {"u2"}
    assert await new.unprepare([ref_of(c2)]) == {"u2": ""}
    assert checkpoint(tmp_path) == {}


async def test_corrupt_checkpoint_seen_under_the_file_lock_is_rewritten_from_memory(tmp_path: Path) -> None:
    claim = make_claim(UID)
    events = FakeEvents()
    state, _ = build(tmp_path, FakeClaimSource([claim]), lock_path=tmp_path / "serialize.lock", events=events)
    await state.start()
    await state.prepare([ref_of(claim)])
    (tmp_path / "state" / "checkpoint.json").write_bytes(b"{torn")
    assert await state.unprepare([ClaimRef("ns", "other", "u-other")]) == {"u-other": ""}
    assert [r for r, _, _ in events.recorded] == ["CheckpointRecovered"]
    assert "rebuilt from memory" in events.recorded[0][1]
    assert set(checkpoint(tmp_path)) == {UID}
    assert await state.unprepare([ref_of(claim)]) == {UID: ""}
    assert checkpoint(tmp_path) == {}


async def test_checkpoint_that_cannot_be_rewritten_under_the_lock_is_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    claim = make_claim(UID)
    state, _ = build(tmp_path, FakeClaimSource([claim]), lock_path=tmp_path / "serialize.lock")
    await state.prepare([ref_of(claim)])
    (tmp_path / "state" / "checkpoint.json").write_bytes(b"{torn")
    monkeypatch.setattr(agent.core.atomicfile, "write_all", disk_full)
    # The rewrite fails (logged); the claim's entry is still known from memory.
    assert "cannot write the checkpoint" in (await state.unprepare([ref_of(claim)]))[UID]
    assert set(state.store.entries()) == {UID}


async def test_failed_prepare_completed_write_rolls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    claim = make_claim(UID)
    state, backend = build(tmp_path, FakeClaimSource([claim]))
    real_put = state.store.put

    async def fail_completed(entry: Any, durable: bool = True, before: Any = None) -> None:
        if entry.phase is ClaimPhase.COMPLETED:
            before()  # the spec is written in the hop of the write that fails
            raise CheckpointWriteError("cannot write the checkpoint: No space left on device")
        await real_put(entry, durable=durable, before=before)

    monkeypatch.setattr(state.store, "put", fail_completed)
    assert "No space left on device" in (await state.prepare([ref_of(claim)]))[UID].error
    assert backend.prepared == {}
    assert not spec_path(tmp_path, UID).exists()
    assert checkpoint(tmp_path) == {}


async def test_steps_are_reported_in_order(tmp_path: Path) -> None:
    seen: list[tuple[str, str]] = []

    class Recorder:
        def reached(self, step: Step, claim_uid: str) -> None:
            seen.append((step.value, claim_uid))

    claim = make_claim(UID)
    state, _ = build(tmp_path, FakeClaimSource([claim]), hooks=Recorder())
    await state.prepare([ref_of(claim)])
    await state.unprepare([ref_of(claim)])
    assert [s for s, _ in seen] == [s.value for s in Step]
    assert {u for _, u in seen} == {UID}


async def test_file_lock_rereads_the_checkpoint_only_after_another_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache of `DriverState.serialized`: memory is trusted while the file is our last write."""
    c1, c2 = make_claim(UID), make_claim("u2", devices=("gpu-1",))
    source = FakeClaimSource([c1, c2])
    lock = tmp_path / "serialize.lock"
    reads: list[Path] = []
    real_load = agent.claims.checkpoint.file.load_checkpoint

    def counting(path: Path, now: float | None = None) -> Any:
        reads.append(path)
        return real_load(path, now)

    monkeypatch.setattr(agent.claims.checkpoint.file, "load_checkpoint", counting)
    old, _ = build(tmp_path, source, lock_path=lock)
    await old.start()
    assert (await old.prepare([ref_of(c1)]))[UID].error == ""
    assert await old.unprepare([ref_of(c1)]) == {UID: ""}
    assert (await old.prepare([ref_of(c1)]))[UID].error == ""
    assert (await old.prepare([ref_of(c1)]))[UID].error == ""  # answered from memory: no write
    assert reads == []  # the start reads with its own call, then every call trusts memory
    new, _ = build(tmp_path, source, lock_path=lock)
    await new.start()
    assert (await new.prepare([ref_of(c2)]))["u2"].error == ""
    reads.clear()
    # The old pod sees the new pod's write and keeps its entry.
    assert (await old.prepare([ref_of(c1)]))[UID].error == ""
    assert len(reads) == 1
    assert await old.unprepare([ref_of(c1)]) == {UID: ""}
    assert len(reads) == 1
    assert set(checkpoint(tmp_path)) == {"u2"}


class RecordingListener:
    """Keeps the prepared claims as the deltas tell them, and each delta's changed UIDs."""

    def __init__(self) -> None:
        self.prepared: dict[str, tuple[str, ...]] = {}
        self.told: list[tuple[set[str], set[str]]] = []
        """(prepared UIDs, unprepared UIDs) of each call."""

    def prepared_changed(self, driver: str, prepared: Any, unprepared: Any) -> None:
        for ref in unprepared:
            del self.prepared[ref.uid]  # never told of one it did not know
        for ref, devices in prepared.items():
            self.prepared[ref.uid] = devices
        self.told.append(({ref.uid for ref in prepared}, {ref.uid for ref in unprepared}))

    def claims_read(self, claims: Any) -> None:
        pass


def prepared_gauges(metrics: Metrics) -> tuple[float | None, float | None]:
    sample = metrics.registry.get_sample_value
    labels = {"driver": DRIVER}
    return sample("dra_agent_prepared_claims", labels), sample("dra_agent_prepared_devices", labels)


@pytest.mark.parametrize("file_lock", [False, True], ids=["no-lock", "file-lock"])
async def test_concurrent_calls_report_the_prepared_claims_once_the_last_one_ends(
    tmp_path: Path, file_lock: bool
) -> None:
    """With the file lock, the calls share its hold: the last out releases it, whichever took it."""
    claims = [make_claim(f"u{i}", devices=(f"gpu-{i % 4}",)) for i in range(20)]
    listener = RecordingListener()
    metrics = Metrics()
    state, _ = build(
        tmp_path,
        FakeClaimSource(claims, delay=0.001),
        listener=listener,
        metrics=metrics,
        lock_path=tmp_path / "serialize.lock" if file_lock else None,
    )
    await state.start()
    async with anyio.create_task_group() as tg:
        for claim in claims:
            tg.start_soon(state.prepare, [ref_of(claim)])
    assert 1 <= len(listener.told) < 20
    assert set(listener.prepared) == {f"u{i}" for i in range(20)}
    assert sum(len(prepared) for prepared, _ in listener.told) == 20  # each claim told once
    assert prepared_gauges(metrics) == (20, 20)
    # A call that fails as a whole changes nothing, and tells nothing.
    listener.told.clear()
    with pytest.raises(ClaimRequestError):
        await state.prepare([ClaimRef("default", "missing", "u-missing")])
    assert listener.told == []
    assert prepared_gauges(metrics) == (20, 20)
    assert await state.unprepare([ref_of(c) for c in claims]) == {f"u{i}": "" for i in range(20)}
    assert listener.told[-1] == (set(), {f"u{i}" for i in range(20)})
    assert listener.prepared == {}
    assert prepared_gauges(metrics) == (0, 0)


async def test_the_listener_and_gauges_hear_only_the_claims_that_changed(tmp_path: Path) -> None:
    """With many claims prepared, a prepare and an unprepare tell the one claim each (the cost of a
    call does not grow with the claims on the node); a failed unprepare, rolled back, tells nothing;
    a restart tells every prepared claim again."""
    held = [make_claim(f"h{i}", devices=(f"gpu-{i % 4}",)) for i in range(30)]
    one = make_claim("one", devices=("gpu-0", "gpu-1"))
    source = FakeClaimSource([*held, one])
    listener, metrics = RecordingListener(), Metrics()
    state, backend = build(tmp_path, source, listener=listener, metrics=metrics)
    await state.start()
    assert listener.told == []  # nothing prepared: nothing to tell
    for claim in held:
        await state.prepare([ref_of(claim)])
    listener.told.clear()
    await state.prepare([ref_of(one)])
    assert listener.told == [({"one"}, set())]
    assert listener.prepared["one"] == ("gpu-0", "gpu-1")
    assert prepared_gauges(metrics) == (31, 32)
    await state.prepare([ref_of(one)])  # prepared already: no change
    assert listener.told == [({"one"}, set())]
    backend.fail_unprepare.add("gpu-1")
    assert (await state.unprepare([ref_of(one)]))["one"] != ""
    assert listener.told == [({"one"}, set())] and prepared_gauges(metrics) == (31, 32)
    backend.fail_unprepare.clear()
    assert await state.unprepare([ref_of(one)]) == {"one": ""}
    assert listener.told[-1] == (set(), {"one"})
    assert prepared_gauges(metrics) == (30, 30)
    restarted_listener, restarted_metrics = RecordingListener(), Metrics()
    restarted, _ = build(tmp_path, source, listener=restarted_listener, metrics=restarted_metrics)
    await restarted.start()
    assert restarted_listener.told == [({f"h{i}" for i in range(30)}, set())]
    assert prepared_gauges(restarted_metrics) == (30, 30)


class GatedBackend(FakeBackend):
    """Prepare of `gated` waits for `open`, after setting `entered`."""

    def __init__(self, gated: str) -> None:
        super().__init__()
        self.gated = gated
        self.entered = anyio.Event()
        self.open = anyio.Event()

    async def prepare(self, device: str, claim: ClaimRef) -> Any:
        if device == self.gated:
            self.entered.set()
            await self.open.wait()
        return await super().prepare(device, claim)


async def test_calls_of_one_process_share_the_file_lock_and_exclude_another_agent(tmp_path: Path) -> None:
    slow, fast = make_claim(UID, devices=("gpu-0",)), make_claim("u2", devices=("gpu-1",))
    lock_path = tmp_path / "serialize.lock"
    backend = GatedBackend("gpu-0")
    state, _ = build(tmp_path, FakeClaimSource([slow, fast]), backend, lock_path=lock_path)
    await state.start()
    other_agent = FileLock(lock_path, poll_interval=0.001)
    other_took = anyio.Event()

    async def other() -> None:
        async with other_agent:
            other_took.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(state.prepare, [ref_of(slow)])
        with anyio.fail_after(5):
            await backend.entered.wait()
        tg.start_soon(other)
        with anyio.fail_after(5):  # not queued behind the slow call of the same process
            assert (await state.prepare([ref_of(fast)]))["u2"].error == ""
        await anyio.sleep(0.02)
        assert not other_took.is_set()  # the slow call still holds the lock for this process
        backend.open.set()
        with anyio.fail_after(5):
            await other_took.wait()
    assert set(checkpoint(tmp_path)) == {UID, "u2"}
    other_agent.close()
