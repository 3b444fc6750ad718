"""The checkpoint file: round trip, verification, recovery and failed writes."""

from __future__ import annotations

import errno
import functools
import hashlib
import itertools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

import agent.claims.checkpoint.commit
import agent.claims.checkpoint.file
import agent.claims.checkpoint.store
import agent.core.atomicfile
from agent.claims.checkpoint.commit import PeerWatch
from agent.claims.checkpoint.file import load_checkpoint, read_boot_id, remove_temp_files
from agent.claims.checkpoint.format import (
    CheckpointCorruptError,
    CheckpointData,
    CheckpointDevice,
    ClaimEntry,
    ClaimPhase,
    EntryTexts,
    _checksum,
    decode,
    decode_file,
    encode,
    encode_record,
    entry_json,
)
from agent.claims.checkpoint.store import CheckpointStore, CheckpointWriteError, _InFlight
from agent.core.sharing import OpaqueConfig
from tests.support.hops import count_hops

ENTRY = ClaimEntry(
    uid="u1",
    namespace="default",
    name="c1",
    phase=ClaimPhase.COMPLETED,
    devices=(
        CheckpointDevice("node-a", "gpu-0", ("gpu",), None, ("k8s.x/claim=u1-gpu-0", "vendor/gpu=uuid")),
        CheckpointDevice("node-a", "gpu-1", ("gpu", "b"), "s1", ()),
    ),
)


def disk_full(fd: int, data: bytes) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def count_writes(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """From now on, one item per checkpoint write (group commit) is appended to the list returned."""
    writes: list[object] = []
    real = agent.claims.checkpoint.commit._write_group

    def counting(*args: Any) -> Any:
        writes.append(args[1])
        return real(*args)

    monkeypatch.setattr(agent.claims.checkpoint.store, "_write_group", counting)
    return writes


async def holding_entry(tmp_path: Path) -> tuple[Path, CheckpointStore]:
    """A store of ``tmp_path/checkpoint.json`` that has written `ENTRY`."""
    path = tmp_path / "checkpoint.json"
    store = CheckpointStore(path, "boot-1")
    await store.put(ENTRY)
    return path, store


def listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_encoding_is_the_canonical_json_of_the_document_and_reuses_unchanged_entries() -> None:
    """`encode` joins cached entry texts: byte for byte the ``json.dumps`` of the whole document."""

    def canonical(data: CheckpointData) -> bytes:
        entries = {uid: entry_json(e) for uid, e in data.entries.items()}
        doc = {
            "version": 1,
            "bootID": data.boot_id,
            "checksum": _checksum(data.boot_id, entries),
            "entries": entries,
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode() + b"\n"

    shared = CheckpointDevice(
        "node-a",
        "gpu-2",
        ("gpu",),
        "share-1",
        ("k8s.x/claim=u3",),
        consumed=(("memory", "10Gi"),),
        config=OpaqueConfig("gpu.nvidia.com", {"sharing": {"strategy": "MPS", "n": [1, 2.5, None]}}),
    )
    texts = EntryTexts()
    entries = {
        "u1": ENTRY,
        "u2": ClaimEntry("u2", "ns", "c2", ClaimPhase.STARTED),
        "u3": ClaimEntry("u3", "ñs", 'clé "x"', ClaimPhase.COMPLETED, (shared,)),
    }
    for change in (None, "replace u2", "drop u1"):
        if change == "replace u2":
            entries["u2"] = ClaimEntry("u2", "ns", "c2", ClaimPhase.COMPLETED, ENTRY.devices)
        elif change == "drop u1":
            del entries["u1"]
        data = CheckpointData("boot-1", dict(entries))
        assert encode(data, texts) == canonical(data) == encode(data)
        assert decode(encode(data, texts)) == data
    assert set(texts._texts) == {"u2", "u3"}  # a dropped entry's text goes with it


def test_round_trip() -> None:
    data = CheckpointData("boot-1", {"u1": ENTRY, "u2": ClaimEntry("u2", "ns", "c2", ClaimPhase.STARTED)})
    raw = encode(data)
    assert decode(raw) == data
    doc = json.loads(raw)
    assert doc["version"] == 1
    assert doc["bootID"] == "boot-1"
    assert doc["checksum"].startswith("sha256:")
    assert doc["entries"]["u1"]["state"] == "PrepareCompleted"


def tamper(raw: bytes, change: str) -> bytes:
    doc = json.loads(raw)
    if change == "entry":
        doc["entries"]["u1"]["name"] = "other"
    elif change == "version":
        doc["version"] = 99
    elif change == "schema":
        doc["entries"] = []
    elif change == "bad-state":
        doc["entries"]["u1"]["state"] = "Half"
        doc["checksum"] = "x"
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"{not json", "invalid_json"),
        (b"\xff\xfe", "invalid_json"),
        (b"[1]", "invalid_json"),
        (b"[" * 100_000 + b"]" * 100_000, "invalid_json"),  # json.loads alone: RecursionError
        (b'{"entries": ' * 70 + b"{}" + b"}" * 70, "invalid_json"),
        (tamper(encode(CheckpointData("b", {"u1": ENTRY})), "entry"), "checksum_mismatch"),
        (tamper(encode(CheckpointData("b", {"u1": ENTRY})), "version"), "unknown_version"),
        (tamper(encode(CheckpointData("b", {"u1": ENTRY})), "schema"), "invalid_schema"),
        (tamper(encode(CheckpointData("b", {"u1": ENTRY})), "bad-state"), "checksum_mismatch"),
    ],
)
def test_decode_rejects_bad_files(raw: bytes, reason: str) -> None:
    with pytest.raises(CheckpointCorruptError) as info:
        decode(raw)
    assert info.value.reason == reason


def test_decode_rejects_a_malformed_entry_with_valid_checksum() -> None:
    raw = json.loads(encode(CheckpointData("b", {"u1": ENTRY})))
    raw["entries"]["u1"]["state"] = "Half"
    raw["checksum"] = _checksum("b", raw["entries"])
    with pytest.raises(CheckpointCorruptError) as info:
        decode(json.dumps(raw).encode())
    assert info.value.reason == "invalid_schema"


def test_load_missing_file(tmp_path: Path) -> None:
    outcome = load_checkpoint(tmp_path / "checkpoint.json")
    assert outcome.data is None
    assert outcome.problem is None


def test_load_corrupt_file_moves_it_aside(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    path.write_bytes(b"garbage")
    outcome = load_checkpoint(path, now=1234.0)
    assert outcome.data is None
    assert outcome.problem is not None
    assert outcome.problem.reason == "invalid_json"
    assert outcome.moved_to == tmp_path / "checkpoint.json.corrupt-1234"
    assert outcome.moved_to.read_bytes() == b"garbage"
    assert not path.exists()


def test_quarantine_names_are_unique_within_one_second(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    moved = []
    for content in (b"first", b"second", b"third"):
        path.write_bytes(content)
        moved.append(load_checkpoint(path, now=1234.9).moved_to)
    assert [p.name for p in moved if p is not None] == [
        "checkpoint.json.corrupt-1234",
        "checkpoint.json.corrupt-1234-1",
        "checkpoint.json.corrupt-1234-2",
    ]
    assert [p.read_bytes() for p in moved if p is not None] == [b"first", b"second", b"third"]


def test_deeply_nested_file_is_quarantined_not_a_recursion_error(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    path.write_bytes(b"[" * 100_000 + b"]" * 100_000)
    outcome = load_checkpoint(path, now=1.0)
    assert outcome.problem is not None
    assert "nested more than 64 levels deep" in str(outcome.problem)
    assert outcome.moved_to == tmp_path / "checkpoint.json.corrupt-1"


def test_oversized_file_is_quarantined_without_reading_it_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import agent.claims.checkpoint.file

    monkeypatch.setattr(agent.claims.checkpoint.file, "MAX_CHECKPOINT_BYTES", 100)
    path = tmp_path / "checkpoint.json"
    path.write_bytes(encode(CheckpointData("b", {"u1": ENTRY})))
    outcome = load_checkpoint(path, now=1.0)
    assert outcome.problem is not None
    assert outcome.problem.reason == "unreadable"
    assert "larger than 100 bytes" in str(outcome.problem)
    assert outcome.moved_to is not None


def test_load_unreadable_file(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    path.mkdir()  # reading a directory fails with an OSError other than "missing"
    outcome = load_checkpoint(path, now=1.0)
    assert outcome.problem is not None
    assert outcome.problem.reason == "unreadable"
    assert outcome.moved_to == tmp_path / "checkpoint.json.corrupt-1"


def test_read_boot_id(tmp_path: Path) -> None:
    (tmp_path / "boot_id").write_text("abc\n")
    assert read_boot_id(tmp_path / "boot_id") == "abc"
    assert read_boot_id(tmp_path / "missing") == ""


def test_remove_temp_files(tmp_path: Path) -> None:
    (tmp_path / ".checkpoint.json.1234.tmp").write_text("x")
    (tmp_path / "checkpoint.json").write_text("x")
    remove_temp_files(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.json"]
    remove_temp_files(tmp_path / "missing")


async def test_store_put_remove_and_flush(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoint.json", "boot-1")
    await store.put(ENTRY)
    assert decode((tmp_path / "checkpoint.json").read_bytes()).entries == {"u1": ENTRY}
    assert store.get("u1") == ENTRY
    await store.remove("u1")
    await store.remove("u1")
    assert decode((tmp_path / "checkpoint.json").read_bytes()).entries == {}
    store.load({"u1": ENTRY})
    await store.flush()
    assert decode((tmp_path / "checkpoint.json").read_bytes()) == CheckpointData("boot-1", {"u1": ENTRY})


async def test_disk_full_keeps_previous_file_and_reverts_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, store = await holding_entry(tmp_path)
    before = path.read_bytes()

    monkeypatch.setattr(agent.core.atomicfile, "write_all", disk_full)
    other = ClaimEntry("u2", "ns", "c2", ClaimPhase.STARTED)
    with pytest.raises(CheckpointWriteError, match="No space left on device"):
        await store.put(other)
    with pytest.raises(CheckpointWriteError):
        await store.put(ClaimEntry("u1", "default", "c1", ClaimPhase.STARTED))
    with pytest.raises(CheckpointWriteError):
        await store.remove("u1")
    assert store.entries() == {"u1": ENTRY}
    assert path.read_bytes() == before
    assert listing(tmp_path) == ["checkpoint.json"]


async def test_concurrent_changes_share_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writes = count_writes(monkeypatch)
    store = CheckpointStore(tmp_path / "checkpoint.json", "boot-1")
    async with anyio.create_task_group() as tg:
        for i in range(50):
            tg.start_soon(store.put, ClaimEntry(f"u{i}", "ns", f"c{i}", ClaimPhase.STARTED))
    assert len(decode((tmp_path / "checkpoint.json").read_bytes()).entries) == 50
    assert len(writes) < 50


async def test_non_durable_put_skips_fsync_and_a_later_durable_write_syncs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    syncs: list[int] = []
    monkeypatch.setattr(os, "fsync", syncs.append)
    store = CheckpointStore(tmp_path / "checkpoint.json", "boot-1")
    await store.put(ClaimEntry("u1", "ns", "c1", ClaimPhase.STARTED), durable=False)
    assert syncs == []
    assert set(decode((tmp_path / "checkpoint.json").read_bytes()).entries) == {"u1"}
    await store.flush()
    assert len(syncs) == 2  # the file and its directory


def test_decode_rejects_non_string_requests() -> None:
    raw = json.loads(encode(CheckpointData("b", {"u1": ENTRY})))
    raw["entries"]["u1"]["devices"][0]["requests"] = "gpu"
    raw["checksum"] = _checksum("b", raw["entries"])
    with pytest.raises(CheckpointCorruptError) as info:
        decode(json.dumps(raw).encode())
    assert info.value.reason == "invalid_schema"


def test_corrupt_file_that_cannot_be_moved_is_still_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "checkpoint.json"
    path.write_bytes(b"garbage")

    def refuse(self: Path, target: Path) -> Path:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "replace", refuse)
    outcome = load_checkpoint(path, now=1.0)
    assert outcome.problem is not None
    assert outcome.moved_to is None
    assert outcome.data is None


async def test_every_waiter_of_a_group_commit_returns_once_its_change_is_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "checkpoint.json"
    synced: list[set[str]] = []
    real = os.fsync

    def recording(fd: int) -> None:  # what the file holds once each fsync (append or compaction) is done
        real(fd)
        synced.append(set(decode(path.read_bytes()).entries) if path.exists() else set())

    store = CheckpointStore(path, "boot-1")
    await store.flush()
    monkeypatch.setattr(os, "fsync", recording)

    async def put(uid: str) -> None:
        await store.put(ClaimEntry(uid, "ns", uid, ClaimPhase.STARTED))
        # Returned: some durable write that completed already holds this change.
        assert any(uid in written for written in synced)

    async with anyio.create_task_group() as tg:
        for i in range(20):
            tg.start_soon(put, f"u{i}")
    assert len(synced) < 20
    assert any(len(b - a) > 1 for a, b in zip([set(), *synced], synced, strict=False))  # coalesced


async def test_fsync_failure_reaches_every_waiter_of_a_group_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, store = await holding_entry(tmp_path)
    before = path.read_bytes()

    def failing(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing)
    failures: list[str] = []

    async def put(uid: str) -> None:
        try:
            await store.put(ClaimEntry(uid, "ns", uid, ClaimPhase.STARTED))
        except CheckpointWriteError as error:
            failures.append(str(error))

    async with anyio.create_task_group() as tg:
        for i in range(10):
            tg.start_soon(put, f"u{i}")
    assert len(failures) == 10
    assert all("Input/output error" in f for f in failures)
    assert store.entries() == {"u1": ENTRY}  # every change reverted
    assert path.read_bytes() == before
    assert listing(tmp_path) == ["checkpoint.json"]


async def test_is_current_until_another_writer_replaces_or_edits_the_file(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    store = CheckpointStore(path, "boot-1")
    assert not store.is_current()  # nothing written yet
    await store.put(ENTRY)
    assert store.is_current()
    # Another agent (rolling update) replaces the file with content of the same size.
    other = CheckpointStore(path, "boot-1")
    await other.put(ClaimEntry("u1", "default", "c2", ENTRY.phase, ENTRY.devices))
    assert path.stat().st_size == len(encode(CheckpointData("boot-1", {"u1": ENTRY})))
    assert not store.is_current()
    assert other.is_current()
    # Edited in place (same inode): the size or times differ.
    with path.open("ab") as f:
        f.write(b" ")
    assert not other.is_current()
    # Reading the file (another writer's content) forgets what was written last.
    await store.put(ENTRY)
    store.load({"u1": ENTRY})
    assert not store.is_current()
    path.unlink()
    await other.flush()
    assert other.is_current()
    path.unlink()
    assert not other.is_current()
    store.close()
    other.close()
    assert not other.is_current()


async def test_actions_run_in_the_hop_of_the_write_that_carries_their_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CDI spec of a completed claim is written before any checkpoint write names the claim."""
    path = tmp_path / "checkpoint.json"
    store = CheckpointStore(path, "boot-1")
    await store.flush()
    hops = count_hops(monkeypatch)
    seen_at_action: dict[str, set[str]] = {}

    def action(uid: str) -> Callable[[], None]:
        def run() -> None:
            seen_at_action[uid] = set(decode(path.read_bytes()).entries)

        return run

    async with anyio.create_task_group() as tg:
        for i in range(10):
            entry = ClaimEntry(f"u{i}", "ns", f"c{i}", ClaimPhase.COMPLETED)
            tg.start_soon(functools.partial(store.put, entry, before=action(f"u{i}")))
    assert all(uid not in on_disk for uid, on_disk in seen_at_action.items())
    assert set(decode(path.read_bytes()).entries) == {f"u{i}" for i in range(10)}
    assert len(hops) < 10  # actions and writes share hops


async def test_a_failed_action_fails_its_change_only(tmp_path: Path) -> None:
    path, store = await holding_entry(tmp_path)
    failures: dict[str, BaseException] = {}

    def cdi_full() -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    async def put(uid: str) -> None:
        try:
            await store.put(
                ClaimEntry(uid, "ns", uid, ClaimPhase.COMPLETED), before=cdi_full if uid == "u3" else None
            )
        except OSError as error:
            failures[uid] = error

    async with anyio.create_task_group() as tg:
        for i in range(2, 6):
            tg.start_soon(put, f"u{i}")
    assert list(failures) == ["u3"]
    assert not isinstance(failures["u3"], CheckpointWriteError)  # the action's own error
    assert set(decode(path.read_bytes()).entries) == {"u1", "u2", "u4", "u5"}
    assert set(store.entries()) == {"u1", "u2", "u4", "u5"}


async def test_an_action_that_fails_with_the_write_reports_the_action(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, store = await holding_entry(tmp_path)

    def cdi_full() -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(agent.core.atomicfile, "write_all", disk_full)
    with pytest.raises(OSError, match="Read-only"):
        await store.put(ClaimEntry("u2", "ns", "c2", ClaimPhase.COMPLETED), before=cdi_full)
    assert store.entries() == {"u1": ENTRY}


async def test_a_put_cancelled_before_its_write_drops_its_entry_and_action(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    store = CheckpointStore(path, "boot-1")
    ran: list[str] = []
    held, release = anyio.Event(), anyio.Event()

    async def writing() -> None:  # a write in progress: the put waits for it
        store._in_flight = write = _InFlight(0)
        held.set()
        await release.wait()
        store._in_flight = None
        write.ended.set()
        write.done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(writing)
        await held.wait()
        with anyio.move_on_after(0.01):
            await store.put(
                ClaimEntry("u2", "ns", "c2", ClaimPhase.COMPLETED), before=lambda: ran.append("u2")
            )
        release.set()
    await store.put(ENTRY)
    assert ran == []
    assert set(decode(path.read_bytes()).entries) == {"u1"}
    assert set(store.entries()) == {"u1"}


async def test_afters_run_once_the_removal_is_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CDI spec of an unprepared claim goes only once no checkpoint on disk names the claim."""
    path = tmp_path / "checkpoint.json"
    store = CheckpointStore(path, "boot-1")
    store.load({f"u{i}": ClaimEntry(f"u{i}", "ns", f"c{i}", ClaimPhase.COMPLETED) for i in range(10)})
    await store.flush()
    syncs = 0
    real_fsync = os.fsync

    def counting(fd: int) -> None:
        nonlocal syncs
        syncs += 1
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting)
    seen: dict[str, tuple[set[str], int]] = {}

    def action(uid: str) -> Callable[[], None]:
        def run() -> None:
            seen[uid] = (set(decode(path.read_bytes()).entries), syncs)

        return run

    async with anyio.create_task_group() as tg:
        for i in range(10):
            tg.start_soon(functools.partial(store.remove, f"u{i}", after=action(f"u{i}")))
            # Non-durable writes in between must not run the afters.
            entry = ClaimEntry(f"s{i}", "ns", f"s{i}", ClaimPhase.STARTED)
            tg.start_soon(functools.partial(store.put, entry, durable=False))
    assert set(seen) == {f"u{i}" for i in range(10)}
    assert all(uid not in on_disk and synced > 0 for uid, (on_disk, synced) in seen.items())
    assert set(decode(path.read_bytes()).entries) == {f"s{i}" for i in range(10)}


async def test_a_failed_after_is_raised_and_a_failed_write_runs_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "checkpoint.json"
    store = CheckpointStore(path, "boot-1")
    store.load({"u1": ENTRY, "u2": ClaimEntry("u2", "ns", "c2", ClaimPhase.COMPLETED)})
    await store.flush()

    def busy() -> None:
        raise OSError(errno.EBUSY, "Device or resource busy")

    with pytest.raises(OSError, match="busy"):
        await store.remove("u2", after=busy)
    assert set(store.entries()) == {"u1"}  # dropped all the same
    assert set(decode(path.read_bytes()).entries) == {"u1"}

    monkeypatch.setattr(agent.core.atomicfile, "write_all", disk_full)
    ran: list[str] = []
    with pytest.raises(CheckpointWriteError):
        await store.remove("u1", after=lambda: ran.append("u1"))
    assert ran == []
    assert set(store.entries()) == {"u1"}
    monkeypatch.undo()
    await store.remove("u1", after=lambda: ran.append("u1"))  # the kubelet's retry
    assert ran == ["u1"]


# ----------------------------------------------------------------- the journal

STARTED = ClaimEntry("u2", "ns", "c2", ClaimPhase.STARTED)


def records(path: Path) -> list[dict[str, Any]]:
    """The journal records after the snapshot line."""
    return [json.loads(line) for line in path.read_bytes().splitlines()[1:]]


async def test_changes_are_appended_as_canonical_records_and_replayed(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    store = CheckpointStore(path, "boot-1")
    await store.flush()
    snapshot = path.read_bytes()
    await store.put(ENTRY)
    await store.put(STARTED, durable=False)
    await store.remove("u2")
    raw = path.read_bytes()
    assert raw.startswith(snapshot)  # appended, not rewritten
    assert [(r["op"], r["uid"]) for r in records(path)] == [("put", "u1"), ("put", "u2"), ("delete", "u2")]
    for line in raw.splitlines()[1:]:
        assert line.decode() == json.dumps(json.loads(line), sort_keys=True, separators=(",", ":"))
    assert decode(raw) == CheckpointData("boot-1", {"u1": ENTRY})
    assert records(path)[0]["entry"] == entry_json(ENTRY)  # jq-readable: the entry as in a snapshot


def test_a_pretty_printed_snapshot_of_an_earlier_release_still_reads() -> None:
    data = CheckpointData("b", {"u1": ENTRY})
    assert decode(json.dumps(json.loads(encode(data)), indent=2).encode()) == data


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda r: {**r, "uid": "u9"}, "checksum_mismatch"),
        (lambda r: {k: v for k, v in r.items() if k != "checksum"}, "checksum_mismatch"),
        (lambda r: "not a record", "invalid_json"),
    ],
)
def test_a_damaged_whole_record_is_corruption_wherever_it_is(
    change: Callable[[Any], Any], reason: str
) -> None:
    snapshot = encode(CheckpointData("b", {}))
    good = encode_record("u1", ENTRY)
    bad = json.dumps(change(json.loads(good))).encode() + b"\n"
    for raw in (snapshot + bad + good, snapshot + good + bad):
        with pytest.raises(CheckpointCorruptError, match="journal record on line") as info:
            decode(raw)
        assert info.value.reason == reason


def test_a_record_with_a_valid_checksum_but_no_op_is_invalid_schema() -> None:
    body = {"uid": "u1", "op": "rename"}
    line = json.dumps({**body, "checksum": "sha256:" + hashlib.sha256(_canon(body)).hexdigest()})
    with pytest.raises(CheckpointCorruptError) as info:
        decode(encode(CheckpointData("b", {})) + line.encode() + b"\n")
    assert info.value.reason == "invalid_schema"


def _canon(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def test_an_unfinished_last_record_is_dropped_and_reported_in_the_shape(tmp_path: Path) -> None:
    good = encode_record("u1", ENTRY)
    raw = encode(CheckpointData("b", {})) + good + encode_record("u2", STARTED)[:-5]
    data, shape = decode_file(raw)
    assert data.entries == {"u1": ENTRY}
    assert shape.torn_tail
    assert shape.journal_bytes == len(good)
    path = tmp_path / "checkpoint.json"
    path.write_bytes(raw)
    outcome = load_checkpoint(path)
    assert outcome.shape is not None and outcome.shape.torn_tail and outcome.problem is None


async def test_the_journal_is_compacted_once_it_outgrows_its_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(agent.claims.checkpoint.file, "COMPACT_AFTER_BYTES", 2_000)
    path = tmp_path / "checkpoint.json"
    store = CheckpointStore(path, "boot-1")
    sizes = []
    for i in range(40):
        await store.put(ClaimEntry(f"u{i % 3}", "ns", f"c{i}", ClaimPhase.STARTED))
        sizes.append(path.stat().st_size)
    assert max(sizes) < 2_000 + 1_000
    assert any(b < a for a, b in itertools.pairwise(sizes))  # compacted along the way
    assert decode(path.read_bytes()).entries == store.entries()
    assert listing(tmp_path) == ["checkpoint.json"]


async def test_a_large_snapshots_journal_is_compacted_before_the_file_outgrows_its_read_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(agent.claims.checkpoint.file, "COMPACT_AFTER_BYTES", 100)
    monkeypatch.setattr(agent.claims.checkpoint.file, "MAX_CHECKPOINT_BYTES", 20_000)
    path = tmp_path / "checkpoint.json"
    store = CheckpointStore(path, "boot-1")
    for i in range(40):  # a snapshot larger than a quarter of the limit
        store.load(
            {**store.entries(), f"big{i}": ClaimEntry(f"big{i}", "ns", "c" * 100, ClaimPhase.COMPLETED)}
        )
    await store.flush()
    assert path.stat().st_size > 5_000  # the snapshot alone
    journals = []
    for i in range(60):
        await store.put(ClaimEntry(f"u{i}", "ns", f"c{i}", ClaimPhase.STARTED))
        journals.append(decode_file(path.read_bytes())[1].journal_bytes)
    assert 0 in journals  # compacted along the way
    assert (
        max(journals) < 5_000 + 500
    )  # at a quarter of the limit (one record past it), not at the snapshot's size
    assert load_checkpoint(path).problem is None


async def test_a_failed_append_is_taken_back_and_the_next_write_compacts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, store = await holding_entry(tmp_path)
    before = path.read_bytes()

    def half_then_full(fd: int, data: bytes) -> None:
        os.write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(agent.core.atomicfile, "write_all", half_then_full)
    with pytest.raises(CheckpointWriteError):
        await store.put(STARTED)
    assert path.read_bytes() == before  # the half record truncated away
    monkeypatch.undo()
    await store.put(STARTED)
    assert path.read_bytes().count(b"\n") == 1  # a new snapshot, not an append after a failure
    assert decode(path.read_bytes()).entries == {"u1": ENTRY, "u2": STARTED}


async def test_a_file_replaced_behind_the_store_is_compacted_not_appended_to(tmp_path: Path) -> None:
    """Appending to the open descriptor of a replaced file would write to a file nobody reads."""
    path, store = await holding_entry(tmp_path)
    path.unlink()
    path.write_bytes(encode(CheckpointData("boot-1", {})))
    await store.put(STARTED)
    assert decode(path.read_bytes()).entries == {"u1": ENTRY, "u2": STARTED}
    path.unlink()
    await store.remove("u2")
    assert decode(path.read_bytes()).entries == {"u1": ENTRY}


async def test_a_durable_append_after_an_unsynced_compaction_syncs_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[str] = []
    real = os.fsync

    def recording(fd: int) -> None:
        synced.append("dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "file")
        real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    store = CheckpointStore(tmp_path / "checkpoint.json", "boot-1")
    await store.put(STARTED, durable=False)  # the first write: a new snapshot, renamed unsynced
    assert synced == []
    await store.put(ENTRY)
    assert synced == ["file", "dir"]
    await store.remove("u1")
    assert synced == ["file", "dir", "file"]


async def test_a_reload_of_a_file_with_an_unfinished_record_compacts_at_the_next_write(
    tmp_path: Path,
) -> None:
    path = tmp_path / "checkpoint.json"
    writer = CheckpointStore(path, "boot-1")
    await writer.put(ENTRY)
    writer.close()
    with path.open("ab") as f:
        f.write(encode_record("u2", STARTED)[:-3])
    reader = CheckpointStore(path, "boot-1")
    outcome = await reader.reload(now=1.0)
    assert outcome.problem is None and reader.entries() == {"u1": ENTRY}
    assert reader.is_current()
    await reader.put(STARTED)
    assert path.read_bytes().count(b"\n") == 1
    assert decode(path.read_bytes()).entries == {"u1": ENTRY, "u2": STARTED}
    reader.close()


# ----------------------------------------------------------------- staged puts (one hop)


async def test_a_staged_put_writes_started_then_runs_its_work_then_writes_the_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "checkpoint.json"
    store = CheckpointStore(path, "boot-1")
    await store.flush()
    seen: list[list[str]] = []
    hops = count_hops(monkeypatch)

    def complete() -> ClaimEntry:  # the started record is in the file when the work runs
        seen.append([r["entry"]["state"] for r in records(path)])
        return ENTRY

    assert await store.put_staged(ClaimEntry("u1", "default", "c1", ClaimPhase.STARTED), complete) == ENTRY
    assert len(hops) == 1
    assert seen == [["PrepareStarted"]]
    assert [r["entry"]["state"] for r in records(path)] == ["PrepareStarted", "PrepareCompleted"]
    assert store.get("u1") == ENTRY
    assert decode(path.read_bytes()).entries == {"u1": ENTRY}
    await store.remove("u1")  # the result is not written a second time
    assert [r["op"] for r in records(path)] == ["put", "put", "delete"]


async def test_a_staged_put_whose_work_fails_keeps_started_for_the_rollback(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    store = CheckpointStore(path, "boot-1")
    started = ClaimEntry("u1", "default", "c1", ClaimPhase.STARTED)

    def complete() -> ClaimEntry:
        raise ValueError("backend failed")

    with pytest.raises(ValueError, match="backend failed"):
        await store.put_staged(started, complete)
    assert store.get("u1") == started
    assert decode(path.read_bytes()).entries == {"u1": started}
    await store.remove("u1")
    assert decode(path.read_bytes()).entries == {}


async def test_a_staged_put_whose_write_fails_keeps_started_in_memory_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, store = await holding_entry(tmp_path)
    ran: list[str] = []
    real_fsync = os.fsync

    def failing(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    def complete() -> ClaimEntry:
        ran.append("work")
        return ClaimEntry("u2", "ns", "c2", ClaimPhase.COMPLETED)

    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(CheckpointWriteError, match="Input/output error"):
        await store.put_staged(STARTED, complete)
    assert ran == ["work"]  # the work ran; its result is not on disk: the caller rolls back
    assert store.get("u2") == STARTED
    monkeypatch.setattr(os, "fsync", real_fsync)
    await store.remove("u2")
    assert decode(path.read_bytes()).entries == {"u1": ENTRY}


async def test_staged_puts_of_a_burst_share_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "checkpoint.json"
    store = CheckpointStore(path, "boot-1")
    writes = count_writes(monkeypatch)

    async def prepare(i: int) -> None:
        done = ClaimEntry(f"u{i}", "ns", f"c{i}", ClaimPhase.COMPLETED)
        assert (
            await store.put_staged(ClaimEntry(f"u{i}", "ns", f"c{i}", ClaimPhase.STARTED), lambda: done)
            == done
        )

    async with anyio.create_task_group() as tg:
        for i in range(20):
            tg.start_soon(prepare, i)
    assert len(writes) < 20
    assert {e.phase for e in decode(path.read_bytes()).entries.values()} == {ClaimPhase.COMPLETED}
    assert len(store.entries()) == 20


async def test_a_removal_whose_before_fails_keeps_the_entry_and_skips_its_after(tmp_path: Path) -> None:
    path, store = await holding_entry(tmp_path)
    afters: list[str] = []

    def before() -> None:
        raise ValueError("device busy")

    with pytest.raises(ValueError, match="device busy"):
        await store.remove("u1", before=before, after=lambda: afters.append("spec removed"))
    assert afters == []
    assert store.get("u1") == ENTRY
    assert decode(path.read_bytes()).entries == {"u1": ENTRY}
    await store.flush()
    assert afters == []  # not run by a later write either
    await store.remove("u1", before=lambda: None, after=lambda: afters.append("spec removed"))
    assert afters == ["spec removed"]
    assert decode(path.read_bytes()).entries == {}


# ----------------------------------------------------------------- another agent sharing the file


def test_the_peer_check_is_asked_at_most_once_a_second_and_again_after_a_foreign_write() -> None:
    asked: list[bool] = []
    now = [0.0]

    def check() -> bool:
        asked.append(True)
        return len(asked) == 1

    watch = PeerWatch(check, clock=lambda: now[0])
    assert watch.present() and watch.present()
    assert len(asked) == 1
    now[0] = 0.99
    assert watch.present() and len(asked) == 1
    now[0] = 1.0
    assert not watch.present() and len(asked) == 2
    watch.forget()
    assert not watch.present() and len(asked) == 3


def test_a_peer_check_that_fails_says_shared() -> None:
    def broken() -> bool:
        raise PermissionError(13, "Permission denied")

    assert PeerWatch(broken).present()


async def test_while_another_agent_shares_the_file_every_write_is_a_snapshot(tmp_path: Path) -> None:
    """An agent of a release before the journal reads only a snapshot (README, "Upgrades")."""
    path = tmp_path / "checkpoint.json"
    shared = [True]
    now = [0.0]
    store = CheckpointStore(path, "boot-1", peers=PeerWatch(lambda: shared[0], clock=lambda: now[0]))
    await store.put(ENTRY)
    await store.put(STARTED, durable=False)
    done = ClaimEntry("u3", "ns", "c3", ClaimPhase.COMPLETED)
    assert await store.put_staged(ClaimEntry("u3", "ns", "c3", ClaimPhase.STARTED), lambda: done) == done
    assert path.read_bytes().count(b"\n") == 1
    assert json.loads(path.read_bytes())["entries"].keys() == {"u1", "u2", "u3"}  # what an old agent reads
    shared[0] = False
    now[0] = 1.0
    await store.remove("u2")
    assert [r["op"] for r in records(path)] == ["delete"]
    assert decode(path.read_bytes()).entries == {"u1": ENTRY, "u3": done}
