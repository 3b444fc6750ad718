"""Start-up: checkpoint recovery and reconciling entries, CDI specs and the API server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agent.claims.checkpoint.format import (
    CheckpointData,
    CheckpointDevice,
    ClaimEntry,
    ClaimPhase,
    decode,
    encode,
)
from agent.claims.state.machine import DeviceState
from agent.core.clock import SystemClock
from agent.observe.metrics import Metrics
from tests.kubelet.fakes import DRIVER, NODE, FakeBackend, FakeClaimSource, FakeEvents, make_claim, ref_of

U1 = "0b7c6a2e-1111-4222-8333-444455556666"
U2 = "1c7c6a2e-1111-4222-8333-444455556666"


class FrozenClock(SystemClock):
    """Always the same second (two corruptions found within one)."""

    def time(self) -> float:
        return 1_700_000_000.0


def build(
    tmp_path: Path,
    source: FakeClaimSource,
    backend: Any,
    boot: str = "boot-1",
    driver: str = DRIVER,
    **kw: Any,
) -> DeviceState:
    return DeviceState(
        driver,
        backend,
        source,
        node_name=NODE,
        cdi_root=tmp_path / "cdi",
        state_dir=tmp_path / "state",
        boot_id=boot,
        **kw,
    )


def spec(tmp_path: Path, uid: str) -> Path:
    return tmp_path / "cdi" / f"k8s.{DRIVER}-claim_{uid}.yaml"


def entries(tmp_path: Path) -> dict[str, ClaimEntry]:
    return dict(decode((tmp_path / "state" / "checkpoint.json").read_bytes()).entries)


def assert_invariants(tmp_path: Path) -> None:
    """No CDI spec without an entry, no completed entry without its spec."""
    recorded = entries(tmp_path)
    specs = {p.name for p in (tmp_path / "cdi").iterdir()} if (tmp_path / "cdi").exists() else set()
    assert specs == {
        spec(tmp_path, uid).name for uid, e in recorded.items() if e.phase is ClaimPhase.COMPLETED
    }


async def prepared(tmp_path: Path, *claims: dict[str, Any]) -> tuple[FakeClaimSource, FakeBackend]:
    source = FakeClaimSource(claims)
    backend = FakeBackend()
    state = build(tmp_path, source, backend)
    await state.start()
    await state.prepare([ref_of(c) for c in claims])
    return source, backend


async def test_start_without_checkpoint_writes_an_empty_one(tmp_path: Path) -> None:
    state = build(tmp_path, FakeClaimSource(), FakeBackend())
    await state.start()
    data = decode((tmp_path / "state" / "checkpoint.json").read_bytes())
    assert data == CheckpointData("boot-1", {})


async def test_restart_keeps_prepared_claims(tmp_path: Path) -> None:
    source, backend = await prepared(tmp_path, make_claim(U1))
    before = spec(tmp_path, U1).stat().st_mtime_ns
    state = build(tmp_path, source, backend)
    await state.start()
    assert set(state.prepared_claims()) == {U1}
    assert spec(tmp_path, U1).stat().st_mtime_ns == before  # same boot, spec present: untouched
    # The restarted agent answers a repeated prepare from its checkpoint.
    calls = backend.prepare_calls
    assert (await state.prepare([ref_of(make_claim(U1))]))[U1].devices[0].device == "gpu-0"
    assert backend.prepare_calls == calls


async def test_reboot_rewrites_lost_specs(tmp_path: Path) -> None:
    source, backend = await prepared(tmp_path, make_claim(U1))
    spec(tmp_path, U1).unlink()  # /var/run/cdi is a tmpfs
    backend.prepared.clear()  # devices are reset by the reboot too
    state = build(tmp_path, source, backend, boot="boot-2")
    await state.start()
    assert spec(tmp_path, U1).exists()
    assert backend.prepared == {U1: {"gpu-0"}}
    assert decode((tmp_path / "state" / "checkpoint.json").read_bytes()).boot_id == "boot-2"
    assert_invariants(tmp_path)


async def test_missing_spec_is_rewritten_on_same_boot(tmp_path: Path) -> None:
    source, backend = await prepared(tmp_path, make_claim(U1))
    spec(tmp_path, U1).unlink()
    await build(tmp_path, source, backend).start()
    assert spec(tmp_path, U1).exists()
    assert_invariants(tmp_path)


async def test_changed_extra_cdi_ids_are_recorded_on_restore(tmp_path: Path) -> None:
    source, backend = await prepared(tmp_path, make_claim(U1))
    backend.extra_cdi_ids = ("vendor.com/gpu=new",)
    await build(tmp_path, source, backend, boot="boot-2").start()
    assert entries(tmp_path)[U1].devices[0].cdi_device_ids[1:] == ("vendor.com/gpu=new",)


async def test_claims_deleted_or_replaced_while_down_are_unprepared(tmp_path: Path) -> None:
    c1, c2 = make_claim(U1), make_claim(U2)
    source, backend = await prepared(tmp_path, c1, c2)
    source.delete("default", c1["metadata"]["name"])
    source.add(make_claim("new-uid", name=c2["metadata"]["name"]))
    await build(tmp_path, source, backend).start()
    assert entries(tmp_path) == {}
    assert backend.prepared == {}
    assert not spec(tmp_path, U1).exists()
    assert not spec(tmp_path, U2).exists()


async def test_api_down_at_start_keeps_entries(tmp_path: Path) -> None:
    source, backend = await prepared(tmp_path, make_claim(U1))
    source.down = True
    spec(tmp_path, U1).unlink()
    await build(tmp_path, source, backend).start()
    assert set(entries(tmp_path)) == {U1}
    assert backend.prepared == {U1: {"gpu-0"}}
    assert_invariants(tmp_path)


async def test_api_oserror_at_start_keeps_entries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source, backend = await prepared(tmp_path, make_claim(U1))

    async def refused(namespace: str, name: str) -> Any:
        raise ConnectionRefusedError("connection refused")

    monkeypatch.setattr(source, "get_resource_claim", refused)
    await build(tmp_path, source, backend).start()
    assert set(entries(tmp_path)) == {U1}


async def test_stale_prepare_started_is_rolled_back(tmp_path: Path) -> None:
    backend = FakeBackend()
    backend.prepared = {U1: {"gpu-0"}}
    (tmp_path / "state").mkdir()
    (tmp_path / "cdi").mkdir()
    spec(tmp_path, U1).write_text("---\n")
    started = ClaimEntry(
        U1, "default", "c1", ClaimPhase.STARTED, (CheckpointDevice(NODE, "gpu-0", ("gpu",)),)
    )
    (tmp_path / "state" / "checkpoint.json").write_bytes(encode(CheckpointData("boot-1", {U1: started})))
    await build(tmp_path, FakeClaimSource([make_claim(U1, name="c1")]), backend).start()
    assert entries(tmp_path) == {}
    assert backend.prepared == {}
    assert not spec(tmp_path, U1).exists()


async def test_orphan_specs_and_temp_files_are_removed(tmp_path: Path) -> None:
    source, backend = await prepared(tmp_path, make_claim(U1))
    spec(tmp_path, U2).write_text("---\n")
    foreign = tmp_path / "cdi" / "k8s.other.example.com-claim_x.yaml"
    foreign.write_text("---\n")
    (tmp_path / "cdi" / f".k8s.{DRIVER}-claim_{U2}.yaml.1234.tmp").write_text("torn")
    (tmp_path / "state" / ".checkpoint.json.1234.tmp").write_text("torn")
    await build(tmp_path, source, backend).start()
    assert sorted(p.name for p in (tmp_path / "cdi").iterdir()) == sorted(
        [spec(tmp_path, U1).name, foreign.name]
    )
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == ["checkpoint.json"]


def flip_one_byte(raw: bytes) -> bytes:
    """The checkpoint with one bit of one byte in the middle of its entries flipped."""
    at = raw.index(b'"namespace"') + 3
    return raw[:at] + bytes([raw[at] ^ 0x01]) + raw[at + 1 :]


CORRUPTIONS = {
    "torn": lambda raw: b"{torn",
    "unknown-version": lambda raw: b'{"version": 7, "bootID": "b", "entries": {}}',
    "one-flipped-byte": flip_one_byte,
    "snapshot-truncated": lambda raw: raw[: raw.index(b"\n") // 2],
    "journal-record-flipped": lambda raw: raw[:-10] + bytes([raw[-10] ^ 0x01]) + raw[-9:],
    "binary-garbage": lambda raw: bytes(range(256)) * 4,
    "deeply-nested": lambda raw: b"[" * 100_000 + b"]" * 100_000,
}


@pytest.mark.parametrize("corrupt", CORRUPTIONS.values(), ids=CORRUPTIONS.keys())
async def test_corrupt_checkpoint_is_moved_aside_reported_and_rebuilt_from_the_specs(
    tmp_path: Path, corrupt: Any
) -> None:
    """The kubelet still believes the claims prepared: their entries and specs must come back.

    Upstream `pkg/kubelet/cm/dra/manager.go` (PrepareResources, GetResources) records a claim
    as prepared in the kubelet's own checkpoint, skips NodePrepareResources for it from then on
    ("Already prepared this claim") and hands every later container the CDI IDs of that first
    answer: those IDs must keep resolving to spec files.
    """
    c1, c2 = make_claim(U1, devices=("gpu-0", "gpu-1")), make_claim(U2, namespace="team", devices=("gpu-2",))
    source, backend = await prepared(tmp_path, c1, c2)
    before = entries(tmp_path)
    specs = {uid: spec(tmp_path, uid).read_bytes() for uid in (U1, U2)}
    content = corrupt((tmp_path / "state" / "checkpoint.json").read_bytes())
    (tmp_path / "state" / "checkpoint.json").write_bytes(content)
    backend.prepared.clear()  # a restarted agent's backend has no memory of the claims
    events = FakeEvents()
    metrics = Metrics()
    state = build(tmp_path, source, backend, events=events, metrics=metrics)
    await state.start()
    aside = [p for p in (tmp_path / "state").iterdir() if p.name.startswith("checkpoint.json.corrupt-")]
    assert len(aside) == 1
    assert aside[0].read_bytes() == content
    assert entries(tmp_path) == before
    assert {uid: spec(tmp_path, uid).read_bytes() for uid in (U1, U2)} == specs
    assert backend.prepared == {U1: {"gpu-0", "gpu-1"}, U2: {"gpu-2"}}
    assert [(r, t) for r, _, t in events.recorded] == [("CheckpointRecovered", "Warning")]
    assert "rebuilt from the CDI specs of 2 prepared claim(s)" in events.recorded[0][1]
    recoveries = sum(
        s.value
        for m in metrics.checkpoint_recoveries.collect()
        for s in m.samples
        if s.name.endswith("_total")
    )
    assert recoveries == 1
    assert_invariants(tmp_path)
    # The kubelet's next prepare gets the same answer; its unprepare releases everything.
    gets = source.gets
    answer = (await state.prepare([ref_of(c1)]))[U1]
    assert [(d.device, d.cdi_device_ids) for d in answer.devices] == [
        (d.device, d.cdi_device_ids) for d in before[U1].devices
    ]
    assert source.gets == gets + 1
    assert await state.unprepare([ref_of(c1), ref_of(c2)]) == {U1: "", U2: ""}
    assert entries(tmp_path) == {}
    assert backend.prepared == {}
    assert_invariants(tmp_path)


@pytest.mark.parametrize("cut", ["mid-record", "line-end"])
async def test_journal_cut_short_keeps_its_whole_records_and_takes_the_rest_from_the_specs(
    tmp_path: Path, cut: str
) -> None:
    """A last record without its line end is a write that never finished: dropped, the file kept.

    After a power loss the specs (tmpfs) are gone with it; a file cut anywhere else in its
    journal loses records of claims the kubelet believes prepared, and their specs bring them back.
    """
    c1, c2 = make_claim(U1, devices=("gpu-0", "gpu-1")), make_claim(U2, namespace="team", devices=("gpu-2",))
    source, backend = await prepared(tmp_path, c1, c2)
    before = entries(tmp_path)
    path = tmp_path / "state" / "checkpoint.json"
    raw = path.read_bytes()
    lines = raw.splitlines(keepends=True)
    assert len(lines) > 2  # the snapshot and the records of the two prepares
    content = raw[:-1] if cut == "line-end" else b"".join(lines[:2]) + lines[2][:40]
    path.write_bytes(content)
    backend.prepared.clear()
    events = FakeEvents()
    state = build(tmp_path, source, backend, events=events)
    await state.start()
    assert [p.name for p in (tmp_path / "state").iterdir()] == ["checkpoint.json"]  # nothing moved aside
    assert entries(tmp_path) == before
    assert path.read_bytes().count(b"\n") == 1  # compacted into a new snapshot at start
    assert_invariants(tmp_path)
    assert [r for r, _, _ in events.recorded] == ["CheckpointRecovered"]
    assert "its last journal record was cut short" in events.recorded[0][1]


async def test_journal_cut_short_after_its_last_acknowledged_record_changes_nothing(tmp_path: Path) -> None:
    """A record the power cut short was never acknowledged: every claim keeps its entry, none is reported."""
    c1 = make_claim(U1)
    source, backend = await prepared(tmp_path, c1)
    path = tmp_path / "state" / "checkpoint.json"
    acknowledged = path.read_bytes()
    path.write_bytes(acknowledged + b'{"checksum":"sha256:')  # a started record the power cut short
    before = entries(tmp_path)
    events = FakeEvents()
    state = build(tmp_path, source, backend, events=events)
    await state.start()
    assert entries(tmp_path) == before
    assert events.recorded == []


async def test_rebuilt_claim_deleted_in_the_api_is_unprepared(tmp_path: Path) -> None:
    c1, c2 = make_claim(U1), make_claim(U2, devices=("gpu-1",))
    source, backend = await prepared(tmp_path, c1, c2)
    (tmp_path / "state" / "checkpoint.json").write_bytes(b"{torn")
    source.delete("default", c2["metadata"]["name"])
    source.add(make_claim("replaced-uid", name=c1["metadata"]["name"]))  # c1 deleted and recreated
    await build(tmp_path, source, backend).start()
    assert entries(tmp_path) == {}
    assert not (tmp_path / "cdi").exists() or not any((tmp_path / "cdi").iterdir())
    assert backend.prepared == {}


async def test_rebuilt_claims_are_kept_unverified_when_the_api_is_down(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source, backend = await prepared(tmp_path, make_claim(U1))
    (tmp_path / "state" / "checkpoint.json").write_bytes(b"{torn")
    source.down = True
    await build(tmp_path, source, backend).start()
    assert set(entries(tmp_path)) == {U1}
    assert spec(tmp_path, U1).exists()
    assert "keeping a claim rebuilt from its CDI spec unverified" in caplog.text


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"---\ncdiVersion: 0.5.0\n", "no claim record (written by an older agent)"),
        (b"---\n\xb8\xff\n", "not UTF-8"),
        (b'---\n# dra-agent claim: {"uid": "someone-else"}\n', "does not name the claim of the spec file"),
        (b'---\n# dra-agent claim: {"uid": "%s"}\n' % U2.encode(), "malformed claim record"),
        (
            b'---\n# dra-agent claim: {"uid": "%s", "namespace": "n", "name": "c", '
            b'"state": "PrepareStarted", "devices": []}\n' % U2.encode(),
            "not a prepared claim",
        ),
    ],
    ids=["no-record", "garbage", "other-uid", "malformed", "not-completed"],
)
async def test_specs_without_a_usable_record_are_reported_and_removed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes, why: str
) -> None:
    source, backend = await prepared(tmp_path, make_claim(U1))
    spec(tmp_path, U2).write_bytes(content)
    (tmp_path / "state" / "checkpoint.json").write_bytes(b"{torn")
    events = FakeEvents()
    await build(tmp_path, source, backend, events=events).start()
    assert set(entries(tmp_path)) == {U1}
    assert not spec(tmp_path, U2).exists()
    assert "1 spec(s) without a usable claim record are removed" in events.recorded[0][1]
    logged = [r.fields for r in caplog.records if r.getMessage().startswith("cannot rebuild a claim")]  # type: ignore[attr-defined]
    assert [f["uid"] for f in logged] == [U2]
    assert why in str(logged[0]["error"])
    assert_invariants(tmp_path)


async def test_corruption_seen_twice_in_one_second_keeps_both_files(tmp_path: Path) -> None:
    (tmp_path / "state").mkdir()
    for content in (b"{first", b"{second"):
        (tmp_path / "state" / "checkpoint.json").write_bytes(content)
        await build(tmp_path, FakeClaimSource(), FakeBackend(), clock=FrozenClock()).start()
    aside = sorted(p.read_bytes() for p in (tmp_path / "state").glob("checkpoint.json.corrupt-*"))
    assert aside == [b"{first", b"{second"]


async def test_event_failure_does_not_stop_start(tmp_path: Path) -> None:
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "checkpoint.json").write_bytes(b"{torn")

    class BrokenEvents:
        async def record(self, reason: str, message: str, type: str) -> None:
            raise RuntimeError("API down")

    state = build(tmp_path, FakeClaimSource(), FakeBackend(), events=BrokenEvents())
    await state.start()
    assert entries(tmp_path) == {}


async def test_restore_failure_unprepares_the_claim(tmp_path: Path) -> None:
    source, backend = await prepared(tmp_path, make_claim(U1))
    backend.devices.discard("gpu-0")  # the device is gone after the reboot
    events = FakeEvents()
    await build(tmp_path, source, backend, boot="boot-2", events=events).start()
    assert entries(tmp_path) == {}
    assert not spec(tmp_path, U1).exists()
    assert [r for r, _, _ in events.recorded] == ["ClaimRestoreFailed"]


async def test_checkpoint_write_failure_at_start_is_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    import agent.core.atomicfile

    def full(fd: int, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(agent.core.atomicfile, "write_all", full)
    state = build(tmp_path, FakeClaimSource(), FakeBackend())
    await state.start()  # does not raise
    assert not (tmp_path / "state" / "checkpoint.json").exists()


async def test_with_the_fake_backend_package(tmp_path: Path) -> None:
    """Prepare, reboot and unprepare with `backends.fake` (the profile's first device)."""
    from agent.core.backend import BackendOptions
    from backends.fake import create_backend

    backend: Any = create_backend(
        BackendOptions(NODE, settings={"profile": "nvidia-a100-8x", "control": "off"})
    )[0]
    device = (await backend.discover())[0].name
    driver = backend.driver_name
    claim = make_claim(U1, driver=driver, devices=(device,))
    source = FakeClaimSource([claim])

    def agent(boot: str) -> DeviceState:
        return DeviceState(
            driver,
            backend,
            source,
            node_name=NODE,
            cdi_root=tmp_path / "cdi",
            state_dir=tmp_path / "state",
            boot_id=boot,
        )

    state = agent("boot-1")
    await state.start()
    result = (await state.prepare([ref_of(claim)]))[U1]
    assert result.error == ""
    path = tmp_path / "cdi" / f"k8s.{driver}-claim_{U1}.yaml"
    written = path.read_text()
    assert "NVIDIA_VISIBLE_DEVICES=" in written
    path.unlink()
    restarted = agent("boot-2")
    await restarted.start()
    assert path.read_text() == written
    assert await restarted.unprepare([ref_of(claim)]) == {U1: ""}
    assert not path.exists()
    assert backend.prepared == {}


async def test_corrupt_checkpoint_with_the_fake_backend_package(tmp_path: Path) -> None:
    """The record in a real backend's spec (device nodes, env, shared device) rebuilds the entry."""
    from agent.core.backend import BackendOptions
    from backends.fake import create_backend

    backend: Any = create_backend(BackendOptions(NODE, settings={"profile": "mixed", "control": "off"}))[0]
    device = (await backend.discover())[0].name
    results = [
        {"request": "gpu", "driver": backend.driver_name, "pool": NODE, "device": device, "shareID": "s-1"}
    ]
    claim = make_claim(U1, driver=backend.driver_name, results=results)
    source = FakeClaimSource([claim])

    state = build(tmp_path, source, backend, driver=backend.driver_name)
    await state.start()
    first = (await state.prepare([ref_of(claim)]))[U1]
    path = tmp_path / "cdi" / f"k8s.{backend.driver_name}-claim_{U1}.yaml"
    written = path.read_bytes()
    checkpoint = tmp_path / "state" / "checkpoint.json"
    recorded = decode(checkpoint.read_bytes()).entries
    checkpoint.write_bytes(checkpoint.read_bytes().replace(b"PrepareCompleted", b"PrepareCompletes"))
    restarted = build(tmp_path, source, backend, driver=backend.driver_name)
    await restarted.start()
    assert decode(checkpoint.read_bytes()).entries == recorded
    assert path.read_bytes() == written
    assert (await restarted.prepare([ref_of(claim)]))[U1] == first


async def test_orphan_spec_that_cannot_be_removed_does_not_stop_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "cdi").mkdir()
    spec(tmp_path, U2).write_text("---\n")
    state = build(tmp_path, FakeClaimSource(), FakeBackend())

    def cannot_unlink(uid: str) -> bool:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(state.cdi, "remove_claim_spec", cannot_unlink)
    await state.start()
    assert spec(tmp_path, U2).exists()


async def test_restore_failure_with_broken_events_still_unprepares(tmp_path: Path) -> None:
    source, backend = await prepared(tmp_path, make_claim(U1))
    backend.devices.discard("gpu-0")

    class BrokenEvents:
        async def record(self, reason: str, message: str, type: str) -> None:
            raise RuntimeError("API down")

    await build(tmp_path, source, backend, boot="boot-2", events=BrokenEvents()).start()
    assert entries(tmp_path) == {}
