"""The crash-safe record of prepared claims (``<state dir>/checkpoint.json``): a snapshot and a journal.

The first line is the snapshot: format version, the node's boot ID and the entries per claim UID,
with a sha256 checksum over the canonical JSON of boot ID and entries (the whole file of earlier
releases, which a fresh snapshot still is). Every change after it is appended as one more line,
a journal record (``op`` ``put`` with the entry, or ``delete``) with a sha256 checksum of its own;
replaying the records over the snapshot gives the entries. An append and one fsync cost about a
quarter of the temp file, fsync, rename and directory fsync of a new file (0.10-0.13 against
0.38-0.54 ms on an ext4 disk here, ``benchmarks/README.md``); the file is compacted into a new
snapshot, written that crash-safe way, once the journal outgrows the snapshot (and at start).

Each claim moves ``PrepareStarted`` (written before the backend or CDI is touched) ->
``PrepareCompleted``. A last record without its line end is one whose write never finished (the
power went while it was written: its change was never acknowledged) and is dropped; any damage, or a
file that cannot be read or parsed (within `MAX_CHECKPOINT_BYTES` and the depth limit of
`agent.core.boundedfile`), moves the file aside under a name of its own and the agent rebuilds the
entries from the CDI specs (never a crash loop, see `agent.claims.recovery`). Writes are coalesced:
concurrent changes share one write (group commit), so 100 claims prepared at once do not mean 200
fsyncs. A change may bring a blocking action (the CDI spec of a completed claim) that the write
carrying the change runs first in its worker thread: one thread hop for both, and the spec is on
disk before any checkpoint names the claim completed.

Agents before the journal read only a snapshot: while another agent shares the file (a rolling
update's other pod, `PeerWatch`), every write is a snapshot (README, "Upgrades and rollbacks").
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from agent.core import atomicfile
from agent.core.atomicfile import TEMP_SUFFIX, quarantine, write_atomic
from agent.core.boundedfile import MIB, BoundedFileError, decode_utf8, parse_json, read_bytes
from agent.core.errors import AgentError
from agent.core.logs import log_fields
from agent.core.sharing import OpaqueConfig

log = logging.getLogger("agent.claims.checkpoint")

FORMAT_VERSION = 1
CHECKPOINT_FILE = "checkpoint.json"
BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")
MAX_CHECKPOINT_BYTES = 64 * MIB
"""About 40,000 claims of 32 devices: far above what a node runs, far below what hurts memory."""


class ClaimPhase(enum.Enum):
    """How far the preparation of a claim got."""

    STARTED = "PrepareStarted"
    COMPLETED = "PrepareCompleted"


@dataclass(frozen=True)
class CheckpointDevice:
    """One device of a claim as recorded (CDI IDs are known once the claim is completed)."""

    pool: str
    device: str
    requests: tuple[str, ...] = ()
    share_id: str | None = None
    cdi_device_ids: tuple[str, ...] = ()
    consumed: tuple[tuple[str, str], ...] = ()
    """The allocation's ``consumedCapacity`` (name, quantity) of a shared device."""
    config: OpaqueConfig | None = None
    """The opaque config that applies to the device, recorded so a restart can resume its sharing."""


@dataclass(frozen=True)
class ClaimEntry:
    """The checkpoint entry of one claim."""

    uid: str
    namespace: str
    name: str
    phase: ClaimPhase
    devices: tuple[CheckpointDevice, ...] = ()


@dataclass(frozen=True)
class CheckpointData:
    """Everything the checkpoint file holds."""

    boot_id: str
    entries: Mapping[str, ClaimEntry] = field(default_factory=dict)


class CheckpointCorruptError(AgentError):
    """The checkpoint file cannot be used; `reason` is a short label for metrics."""

    def __init__(self, message: str, reason: str) -> None:
        self.reason = reason
        super().__init__(message)


class CheckpointWriteError(AgentError):
    """The checkpoint could not be written; the previous file is intact."""


def entry_json(entry: ClaimEntry) -> dict[str, Any]:
    """The JSON form of an entry (without its UID, the key it is stored under)."""
    return {
        "namespace": entry.namespace,
        "name": entry.name,
        "state": entry.phase.value,
        "devices": [_device_json(d) for d in entry.devices],
    }


def _device_json(device: CheckpointDevice) -> dict[str, Any]:
    out: dict[str, Any] = {
        "pool": device.pool,
        "device": device.device,
        "requests": list(device.requests),
        "shareID": device.share_id,
        "cdiDeviceIDs": list(device.cdi_device_ids),
    }
    # Only when set: entries of unshared, unconfigured devices keep the format they always had.
    if device.consumed:
        out["consumedCapacity"] = dict(device.consumed)
    if device.config is not None:
        out["config"] = device.config.to_json()
    return out


def _checksum(boot_id: str, entries: Mapping[str, Any]) -> str:
    return _sha256(_canonical({"bootID": boot_id, "entries": entries}))


class EntryTexts:
    """The canonical JSON text of each entry, kept while its (immutable) entry object stays.

    A snapshot encodes every entry and a journal record one: an entry is encoded once, when it
    first goes into either, and its text reused by the next snapshot. Used by one write at a time
    (the store's write lock).
    """

    def __init__(self) -> None:
        self._texts: dict[str, tuple[ClaimEntry, str]] = {}

    def text(self, uid: str, entry: ClaimEntry) -> str:
        cached = self._texts.get(uid)
        if cached is not None and cached[0] is entry:
            return cached[1]
        text = _canonical(entry_json(entry))
        self._texts[uid] = (entry, text)
        return text

    def forget(self, uid: str) -> None:
        self._texts.pop(uid, None)

    def keep_only(self, uids: Collection[str]) -> None:
        for uid in [u for u in self._texts if u not in uids]:
            del self._texts[uid]


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _sha256(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def encode(data: CheckpointData, texts: EntryTexts | None = None) -> bytes:
    """A snapshot line for `data`: compact JSON with sorted keys, checksum over boot ID and entries.

    Built from the entries' canonical texts, byte for byte what ``json.dumps(doc, sort_keys=True,
    separators=(",", ":"))`` of the whole document gives (a test holds it to that); read it with jq.
    """
    texts = texts or EntryTexts()
    pairs = (f"{_canonical(uid)}:{texts.text(uid, e)}" for uid, e in sorted(data.entries.items()))
    entries = "{" + ",".join(pairs) + "}"
    texts.keep_only(data.entries.keys())
    boot = _canonical(data.boot_id)
    checksum = _sha256(f'{{"bootID":{boot},"entries":{entries}}}')
    doc = f'{{"bootID":{boot},"checksum":"{checksum}","entries":{entries},"version":{FORMAT_VERSION}}}'
    return doc.encode() + b"\n"


def encode_record(uid: str, entry: ClaimEntry | None, texts: EntryTexts | None = None) -> bytes:
    """The journal line of one change: `entry` put under `uid`, or (None) the entry of `uid` deleted.

    Canonical JSON like the snapshot; the checksum covers the record without its checksum field.
    """
    key = _canonical(uid)
    if entry is None:
        if texts is not None:
            texts.forget(uid)
        body = f'"op":"delete","uid":{key}}}'
    else:
        text = texts.text(uid, entry) if texts is not None else _canonical(entry_json(entry))
        body = f'"entry":{text},"op":"put","uid":{key}}}'
    return f'{{"checksum":"{_sha256("{" + body)}",{body}\n'.encode()


def _strs(value: object) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TypeError("expected a list of strings")
    return tuple(value)


def entry_from_json(uid: str, raw: Mapping[str, Any]) -> ClaimEntry:
    """The entry of `uid` from its JSON form; raises KeyError, TypeError, ValueError or AttributeError."""
    devices = tuple(
        CheckpointDevice(
            pool=str(d["pool"]),
            device=str(d["device"]),
            requests=_strs(d.get("requests", [])),
            share_id=None if d.get("shareID") is None else str(d["shareID"]),
            cdi_device_ids=_strs(d.get("cdiDeviceIDs", [])),
            consumed=tuple(sorted((str(k), str(v)) for k, v in (d.get("consumedCapacity") or {}).items())),
            config=OpaqueConfig.from_json(d["config"]) if d.get("config") is not None else None,
        )
        for d in raw["devices"]
    )
    return ClaimEntry(
        uid=uid,
        namespace=str(raw["namespace"]),
        name=str(raw["name"]),
        phase=ClaimPhase(raw["state"]),
        devices=devices,
    )


@dataclass(frozen=True)
class FileShape:
    """How a checkpoint file is laid out: what the store needs to append to it or compact it."""

    snapshot_bytes: int
    journal_bytes: int = 0
    """The records after the snapshot (a dropped torn record not counted)."""
    torn_tail: bool = False
    """An unfinished last record was dropped: the next write compacts (appends would follow it)."""


def decode(raw: bytes, path: Path | str = CHECKPOINT_FILE) -> CheckpointData:
    """Parse and verify file content; raises `CheckpointCorruptError` with the reason."""
    return decode_file(raw, path)[0]


def decode_file(raw: bytes, path: Path | str = CHECKPOINT_FILE) -> tuple[CheckpointData, FileShape]:
    """`decode`, with the file's layout."""
    try:
        text = decode_utf8(path, raw, what="checkpoint")
    except BoundedFileError as error:
        raise CheckpointCorruptError(error.problem, "invalid_json") from None
    first, _, rest = text.partition("\n")
    try:
        doc = _parse(first, path)
    except CheckpointCorruptError:
        # A snapshot of an earlier release edited by hand (pretty-printed over several lines).
        doc, rest = _parse(text, path), ""
    boot_id, entries = _snapshot(doc)
    shape = FileShape(snapshot_bytes=len(first.encode()) + 1)
    if rest:
        entries, shape = _replay(rest, entries, shape, path)
    return CheckpointData(boot_id=boot_id, entries=entries), shape


def _parse(text: str, path: Path | str) -> Any:
    try:
        return parse_json(text, path, what="checkpoint")
    except BoundedFileError as error:
        raise CheckpointCorruptError(error.problem, "invalid_json") from None


def _snapshot(doc: Any) -> tuple[str, dict[str, ClaimEntry]]:
    if not isinstance(doc, dict):
        raise CheckpointCorruptError("not a JSON object", "invalid_json")
    version = doc.get("version")
    if version != FORMAT_VERSION:
        raise CheckpointCorruptError(
            f"format version {version!r} is not the supported version {FORMAT_VERSION} "
            "(written by another agent release?)",
            "unknown_version",
        )
    entries = doc.get("entries")
    boot_id = doc.get("bootID")
    if not isinstance(entries, dict) or not isinstance(boot_id, str):
        raise CheckpointCorruptError("entries or bootID missing", "invalid_schema")
    if doc.get("checksum") != _checksum(boot_id, entries):
        raise CheckpointCorruptError("checksum mismatch (the file was changed or torn)", "checksum_mismatch")
    try:
        return boot_id, {uid: entry_from_json(uid, e) for uid, e in entries.items()}
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise CheckpointCorruptError(f"malformed entry: {error!r}", "invalid_schema") from error


def _replay(
    text: str, entries: dict[str, ClaimEntry], shape: FileShape, path: Path | str
) -> tuple[dict[str, ClaimEntry], FileShape]:
    """Apply the journal records of `text` (what follows the snapshot line) to `entries`.

    A record is written with its line end in one ``write``, and acknowledged only once written
    (and, for a durable change, fsynced): a last line without its line end is a write that never
    finished, and is dropped. Every whole line must be a valid record: damage there (a changed
    byte, a lost sector) is corruption, whatever the line's place.
    """
    lines = text.split("\n")
    cut = lines.pop()  # "" when the file ends with a line end
    used = 0
    for number, line in enumerate(lines, start=2):
        try:
            uid, entry = _record(line, path)
        except CheckpointCorruptError as error:
            raise CheckpointCorruptError(f"journal record on line {number}: {error}", error.reason) from None
        if entry is None:
            entries.pop(uid, None)
        else:
            entries[uid] = entry
        used += len(line.encode()) + 1
    if cut:
        log.warning(
            "dropped the unfinished last record of the checkpoint journal (its write was cut short)",
            extra=log_fields(path=str(path), line=len(lines) + 2, bytes=len(cut.encode())),
        )
    return entries, replace(shape, journal_bytes=used, torn_tail=bool(cut))


def _record(line: str, path: Path | str) -> tuple[str, ClaimEntry | None]:
    """The change a journal line records; raises `CheckpointCorruptError`."""
    record = _parse(line, path)
    if not isinstance(record, dict):
        raise CheckpointCorruptError("not a JSON object", "invalid_json")
    checksum = record.pop("checksum", None)
    if checksum != _sha256(_canonical(record)):
        raise CheckpointCorruptError(
            "checksum mismatch (the record was changed or torn)", "checksum_mismatch"
        )
    uid, op = record.get("uid"), record.get("op")
    if not isinstance(uid, str) or op not in ("put", "delete"):
        raise CheckpointCorruptError("uid or op missing", "invalid_schema")
    if op == "delete":
        return uid, None
    try:
        return uid, entry_from_json(uid, record["entry"])
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise CheckpointCorruptError(f"malformed entry: {error!r}", "invalid_schema") from error


def read_boot_id(path: Path = BOOT_ID_PATH) -> str:
    """The kernel's boot ID (changes on every reboot); ``""`` when it cannot be read."""
    try:
        return path.read_text().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class LoadOutcome:
    """What `load_checkpoint` found."""

    data: CheckpointData | None
    """None when there was no usable file (missing or moved aside)."""
    problem: CheckpointCorruptError | None = None
    moved_to: Path | None = None
    shape: FileShape | None = None


def load_checkpoint(path: Path, now: float | None = None) -> LoadOutcome:
    """Read the checkpoint; a bad file is renamed ``<name>.corrupt-<unix ts>[-<n>]`` (blocking)."""
    try:
        raw = read_bytes(path, max_bytes=MAX_CHECKPOINT_BYTES, what="checkpoint")
    except BoundedFileError as error:
        if not path.exists():
            return LoadOutcome(data=None)
        problem = CheckpointCorruptError(f"cannot use {path}: {error.problem}", "unreadable")
    else:
        try:
            data, shape = decode_file(raw, path)
            return LoadOutcome(data=data, shape=shape)
        except CheckpointCorruptError as error:
            problem = error
    try:
        aside = quarantine(path, int(now if now is not None else time.time()))
    except OSError as error:
        log.error(
            "cannot move the corrupt checkpoint aside; it will be overwritten",
            extra=log_fields(path=str(path), error=str(error)),
        )
        return LoadOutcome(data=None, problem=problem)
    return LoadOutcome(data=None, problem=problem, moved_to=aside)


def remove_temp_files(state_dir: Path) -> None:
    """Delete checkpoint temp files left by a crash mid-write (blocking)."""
    if state_dir.is_dir():
        for p in state_dir.glob(f".{CHECKPOINT_FILE}.*{TEMP_SUFFIX}"):
            p.unlink(missing_ok=True)


FileIdentity = tuple[int, int, int, int, int]
"""Device, inode, size, mtime and ctime (ns) of a file: equal means not replaced nor rewritten."""

COMPACT_AFTER_BYTES = 64 * 1024
"""The journal is compacted once it is larger than this and than its snapshot (or a quarter of
`MAX_CHECKPOINT_BYTES`, whichever is less): a replay at start or reload stays cheap, a compaction
(a new file) comes once every few hundred changes, and a large checkpoint's journal cannot take
the file past the size it is read at."""


def _journal_limit(shape: FileShape) -> int:
    """How large the journal after `shape`'s snapshot may grow before the next write compacts."""
    return max(COMPACT_AFTER_BYTES, min(shape.snapshot_bytes, MAX_CHECKPOINT_BYTES // 4))


PEER_CHECK_SECONDS = 1.0
"""How long the answer of the peer check is kept (it runs in the write's worker thread)."""


class PeerWatch:
    """Whether another agent shares the checkpoint now (a rolling update's other pod), asked at most
    once every `PEER_CHECK_SECONDS`.

    While one does, every write is a whole snapshot: an agent of a release before the journal
    reads only that, and one that finds journal records moves the file aside and writes what its
    memory holds, losing the claims the other pod prepared. Used by one write at a time.
    """

    def __init__(self, check: Callable[[], bool], clock: Callable[[], float] = time.monotonic) -> None:
        self._check = check
        self._clock = clock
        self._answer = True
        self._asked: float | None = None

    def forget(self) -> None:
        """Ask again at the next write: another agent just wrote the file."""
        self._asked = None

    def present(self) -> bool:
        """The check's answer, asked again once it is older than `PEER_CHECK_SECONDS` (blocking)."""
        now = self._clock()
        if self._asked is None or now - self._asked >= PEER_CHECK_SECONDS:
            try:
                self._answer = self._check()
            except OSError as error:  # unknown: shared, the safe answer
                log.warning(
                    "cannot tell whether another agent shares the checkpoint",
                    extra=log_fields(error=str(error)),
                )
                self._answer = True
            self._asked = now
        return self._answer


def _identity(st: os.stat_result) -> FileIdentity:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(frozen=True)
class _OpenFile:
    """The checkpoint file as this store last wrote or read it, held open for appending.

    While the descriptor is open its inode number cannot be given to another file, so a file at
    the path with that inode, size and times is this one, unchanged (`CheckpointStore.is_current`).
    """

    fd: int
    identity: FileIdentity
    shape: FileShape
    rename_unsynced: bool = False
    """Written by a compaction without fsync: the next durable append fsyncs the directory too."""


def _open_for_append(path: Path, shape: FileShape, rename_unsynced: bool = False) -> _OpenFile | None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
    except OSError:
        return None  # the next write compacts into a new file
    return _OpenFile(fd, _identity(os.fstat(fd)), shape, rename_unsynced)


def _still_open(path: Path, file: _OpenFile) -> bool:
    """Whether the file at `path` is `file`, as this store left it."""
    try:
        return _identity(os.stat(path)) == file.identity
    except OSError:
        return False


def _close(file: _OpenFile | None) -> None:
    if file is not None:
        os.close(file.fd)


def _read_file(path: Path, now: float, previous: _OpenFile | None) -> tuple[LoadOutcome, _OpenFile | None]:
    """`load_checkpoint`, keeping the file read open when it did not change while read."""
    _close(previous)
    try:
        fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
    except OSError:
        fd = None
    outcome = load_checkpoint(path, now)
    if fd is not None:
        try:
            read = _identity(os.fstat(fd))
            if outcome.shape is not None and _identity(os.stat(path)) == read:
                return outcome, _OpenFile(fd, read, outcome.shape)
        except OSError:
            pass
        os.close(fd)
    return outcome, None


class _Action:
    """A blocking action tied to the change of `uid`, run in the worker thread of a checkpoint write.

    Before: run first by the write that first carries the change (its failure leaves the change
    out). After: run by the durable write that carries the change, once it is on disk.
    """

    def __init__(self, uid: str, previous: ClaimEntry | None, action: Callable[[], None]) -> None:
        self.uid = uid
        self.previous = previous
        self.action = action
        self.done = False
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            self.action()
        except Exception as error:  # the owner of the change gets it; the others' changes go on
            self.error = error
        self.done = True


class _Stage:
    """A change made in two records within one write: `started` first, then what `complete` returns.

    `complete` (blocking) runs in the write's worker thread once `started` is written.
    """

    def __init__(self, uid: str, complete: Callable[[], ClaimEntry]) -> None:
        self.uid = uid
        self.complete = complete
        self.result: ClaimEntry | None = None
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            self.result = self.complete()
        except Exception as error:  # the owner of the change gets it; the others' changes go on
            self.error = error


@dataclass(frozen=True)
class _Write:
    """One group commit: the entries at its start, the UIDs changed since the last write, the actions."""

    boot_id: str
    entries: dict[str, ClaimEntry]
    changed: Collection[str]
    befores: list[_Action]
    afters: list[_Action]
    stages: list[_Stage]
    durable: bool
    compact: bool
    """Write a new snapshot, whatever the journal's size (at start, after a failed write)."""
    peers: PeerWatch | None = None
    """Asked in the worker thread: while another agent shares the file, snapshots only."""


def _write_group(
    path: Path, job: _Write, file: _OpenFile | None, texts: EntryTexts
) -> tuple[_OpenFile | None, OSError | None]:
    """Run the befores of a group, write its changes less those whose before failed, run the afters.

    The stages' first records go with the changes (not fsynced), then their `complete` runs and
    what it returns is written (durably when the group is). Returns the file now open and the
    write's failure: none of the group's changes is then sure to be on disk (a stage's first
    record may be), and no after has run.
    """
    entries = job.entries
    for before in job.befores:
        before.run()
        if before.error is not None:
            if before.previous is None:
                entries.pop(before.uid, None)
            else:
                entries[before.uid] = before.previous
    shared = job.peers is not None and job.peers.present()
    try:
        file = _write_changes(
            path,
            job.boot_id,
            entries=entries,
            changed=job.changed,
            file=file,
            durable=job.durable and not job.stages,
            compact=job.compact or shared,
            texts=texts,
        )
        if job.stages:
            for stage in job.stages:
                stage.run()
                if stage.result is not None:
                    entries[stage.uid] = stage.result
            done = [stage.uid for stage in job.stages if stage.result is not None]
            file = _write_changes(
                path,
                job.boot_id,
                entries=entries,
                changed=done,
                file=file,
                durable=job.durable,
                compact=shared,
                texts=texts,
            )
    except OSError as error:
        return file, error
    undone = {before.uid for before in job.befores if before.error is not None}
    for after in job.afters:
        if after.uid in undone:  # its change was left out: nothing to follow it
            after.done = True
        else:
            after.run()
    return file, None


def _write_changes(
    path: Path,
    boot_id: str,
    *,
    entries: dict[str, ClaimEntry],
    changed: Collection[str],
    file: _OpenFile | None,
    durable: bool,
    compact: bool,
    texts: EntryTexts,
) -> _OpenFile | None:
    """Append the records of `changed`, or compact: a new snapshot of `entries`, replacing the file
    crash-safely, when asked (`compact`), when the journal outgrew its snapshot, or when the file at
    `path` is not the one open (replaced or edited by someone else). Raises OSError with `file`
    untouched."""
    if (
        compact
        or file is None
        or file.shape.journal_bytes > _journal_limit(file.shape)
        or not _still_open(path, file)
    ):
        return _compact(path, CheckpointData(boot_id, entries), file, durable, texts)
    records = b"".join(encode_record(uid, entries.get(uid), texts) for uid in changed)
    return _append(path, records, file, durable)


def _compact(
    path: Path, data: CheckpointData, file: _OpenFile | None, durable: bool, texts: EntryTexts
) -> _OpenFile | None:
    path.parent.mkdir(parents=True, exist_ok=True)
    snapshot = encode(data, texts)
    write_atomic(path, snapshot, mode=0o600, durable=durable)
    _close(file)
    return _open_for_append(path, FileShape(snapshot_bytes=len(snapshot)), rename_unsynced=not durable)


def _append(path: Path, records: bytes, file: _OpenFile, durable: bool) -> _OpenFile:
    try:
        atomicfile.write_all(file.fd, records)
        if durable:
            os.fsync(file.fd)
            if file.rename_unsynced:
                atomicfile.fsync_dir(path.parent)
    except OSError:
        # Take back what part of the records was written: the journal stays a sequence of whole
        # records, and the file what memory holds once the caller has undone the changes.
        with contextlib.suppress(OSError):
            os.ftruncate(file.fd, file.identity[2])
        raise
    shape = replace(file.shape, journal_bytes=file.shape.journal_bytes + len(records))
    return replace(
        file,
        identity=_identity(os.fstat(file.fd)),
        shape=shape,
        rename_unsynced=file.rename_unsynced and not durable,
    )


class CheckpointStore:
    """The entries in memory plus their durable copy; every change is on disk when its call returns.

    The store keeps the file it wrote or read last open (`_OpenFile`): appends go there, and an
    agent that shares the file (rolling update) need not read it again while it is unchanged.
    """

    def __init__(self, path: Path, boot_id: str, *, peers: PeerWatch | None = None) -> None:
        self.path = path
        self.boot_id = boot_id
        self._peers = peers
        self._entries: dict[str, ClaimEntry] = {}
        self._texts = EntryTexts()
        self._by_device: dict[str, dict[str, None]] = {}
        """Device name -> UIDs of the entries naming it: a share's peers without a scan of all entries."""
        self._changed: dict[str, None] = {}
        """UIDs changed since the last write took its changes: the records of the next append."""
        self._touched: set[str] = set()
        """UIDs changed in memory since `take_touched` (what the gauges and listener must look at)."""
        self._compact = True
        """The next write writes a new snapshot (the file is not known to hold memory's entries)."""
        self._write_lock = anyio.Lock(fast_acquire=True)  # no loop trip when uncontended
        self._changes = 0
        self._written = 0
        self._synced = 0
        self._file: _OpenFile | None = None
        self._befores: list[_Action] = []
        self._afters: list[_Action] = []
        self._stages: list[_Stage] = []

    def load(self, entries: Mapping[str, ClaimEntry]) -> None:
        """Replace the in-memory entries (at start, or after reading the file another agent wrote)."""
        self._replace_all(entries)
        self.close()
        self._compact = True

    def is_current(self) -> bool:
        """Whether the file is still the one this store wrote or read last, i.e. the entries in memory.

        A ``stat`` of a file just written, answered from the kernel's inode cache: cheaper than
        the worker-thread hop that reading and verifying the whole file would take.
        """
        return self._file is not None and _still_open(self.path, self._file)

    async def reload(self, now: float) -> LoadOutcome:
        """Read the file another agent may have written: its entries replace memory unless unusable.

        A corrupt file is moved aside (`load_checkpoint`) and memory kept: the caller decides.
        """
        previous, self._file = self._file, None
        if self._peers is not None:
            self._peers.forget()  # another agent wrote the file: it may be one that reads no journal
        outcome, file = await anyio.to_thread.run_sync(_read_file, self.path, now, previous)
        if outcome.problem is None:
            self._replace_all(outcome.data.entries if outcome.data is not None else {})
            self._file = file
            self._compact = file is None or file.shape.torn_tail
        else:
            _close(file)
            self._compact = True
        return outcome

    def close(self) -> None:
        """Let go of the file written last."""
        _close(self._file)
        self._file = None

    def get(self, uid: str) -> ClaimEntry | None:
        """The entry of a claim."""
        return self._entries.get(uid)

    def entries(self) -> dict[str, ClaimEntry]:
        """A copy of all entries."""
        return dict(self._entries)

    def holders(self, device: str) -> list[ClaimEntry]:
        """The entries that name `device`."""
        return [self._entries[uid] for uid in self._by_device.get(device, ())]

    async def put(
        self, entry: ClaimEntry, *, durable: bool = True, before: Callable[[], None] | None = None
    ) -> None:
        """Add or replace an entry; raises `CheckpointWriteError` (memory reverted).

        `before` (blocking) runs in the worker thread of the write that first carries the entry,
        before that write; what it raises is raised here, and the entry is then left out
        of the file and memory (the other changes of the group are written).

        `durable=False` skips the fsyncs: the agent uses it for PrepareStarted, which guards state
        that a power loss erases anyway (CDI specs on a tmpfs, device preparation); a killed agent
        still finds the entry (the page cache survives it).
        """
        previous = self._entries.get(entry.uid)
        self._set(entry.uid, entry)
        if before is None:
            await self._commit(lambda: self._restore(entry.uid, previous), durable=durable)
            return
        # The action runs in the hop of the write that carries the entry (one hop for both).
        pending = _Action(entry.uid, previous, before)
        self._befores.append(pending)
        try:
            await self._commit(lambda: self._restore(entry.uid, previous), durable=durable)
        except CheckpointWriteError:
            if pending.error is None:
                raise  # else the action's failure is the one to report
        finally:
            if pending in self._befores:  # cancelled before a write took it: none may carry the entry
                self._befores.remove(pending)
                self._restore(entry.uid, previous)
        if pending.error is not None:
            raise pending.error

    async def put_staged(self, started: ClaimEntry, complete: Callable[[], ClaimEntry]) -> ClaimEntry:
        """Put `started`, run `complete` (blocking) and put what it returns, durably: one write, one hop.

        In the worker thread of one group commit: the record of `started` is written (not fsynced),
        then `complete` runs, then the entry it returns is written and fsynced. Returns that entry.
        On any failure, what `complete` raised or `CheckpointWriteError`, `started` stays in memory
        (and maybe on disk): the caller rolls back what `complete` may have done and removes it.
        """
        self._set(started.uid, started)
        stage = _Stage(started.uid, complete)
        self._stages.append(stage)
        try:
            await self._commit(lambda: None)
        finally:
            if stage in self._stages:  # cancelled before a write took it
                self._stages.remove(stage)
        if stage.error is not None:
            raise stage.error
        if stage.result is None:  # cancelled before a write took it
            raise CheckpointWriteError(f"the checkpoint write of claim {started.uid} was cancelled")
        return stage.result

    async def remove(
        self,
        uid: str,
        *,
        before: Callable[[], None] | None = None,
        after: Callable[[], None] | None = None,
    ) -> None:
        """Drop an entry durably (no-op when absent); raises `CheckpointWriteError` (memory reverted).

        `before` (blocking) runs in the worker thread of the write that first carries the removal,
        before that write; what it raises is raised here and the entry is kept (memory and file).
        `after` (blocking) runs in the worker thread of the durable write that drops the entry,
        once that write is on disk; what it raises is raised here (the entry stays dropped).
        """
        if uid not in self._entries:
            return
        previous = self._entries[uid]
        self._set(uid, None)
        first = _Action(uid, previous, before) if before is not None else None
        last = _Action(uid, previous, after) if after is not None else None
        if first is not None:
            self._befores.append(first)
        if last is not None:
            self._afters.append(last)
        try:
            await self._commit(lambda: self._restore(uid, previous))
        except CheckpointWriteError:
            if first is None or first.error is None:
                raise  # else the action's failure is the one to report
        finally:
            if first is not None and first in self._befores:  # cancelled before a write took it
                self._befores.remove(first)
                self._restore(uid, previous)
            if last is not None and last in self._afters:  # failed or cancelled before a write took it
                self._afters.remove(last)
        for action in (first, last):
            if action is not None and action.error is not None:
                raise action.error

    async def flush(self) -> None:
        """Write the current entries as a new snapshot (at start: records the new boot ID)."""
        self._compact = True
        await self._commit(lambda: None)

    def _restore(self, uid: str, previous: ClaimEntry | None) -> None:
        self._set(uid, previous)

    def take_touched(self) -> set[str]:
        """The UIDs whose entry changed (or was restored) since the last call."""
        touched, self._touched = self._touched, set()
        return touched

    def _set(self, uid: str, entry: ClaimEntry | None) -> None:
        """Add, replace (`entry`) or drop (None) the entry of `uid`, keeping the device index."""
        self._changed[uid] = None
        self._touched.add(uid)
        old = self._entries.get(uid)
        if old is not None:
            for device in old.devices:
                uids = self._by_device.get(device.device)
                if uids is not None:
                    uids.pop(uid, None)
                    if not uids:
                        del self._by_device[device.device]
        if entry is None:
            self._entries.pop(uid, None)
            return
        self._entries[uid] = entry
        for device in entry.devices:
            self._by_device.setdefault(device.device, {})[uid] = None

    def _replace_all(self, entries: Mapping[str, ClaimEntry]) -> None:
        self._touched.update(self._entries)  # the entries that go are changes too
        self._entries, self._by_device = {}, {}
        for uid, entry in entries.items():
            self._set(uid, entry)
        self._changed = {}

    async def _commit(self, undo: Callable[[], None], *, durable: bool = True) -> None:
        self._changes += 1
        mine = self._changes
        try:
            async with self._write_lock:
                # A write that started after our change already covered it (group commit).
                if (self._synced if durable else self._written) >= mine:
                    return
                covered = self._changes
                befores, self._befores = self._befores, []
                afters: list[_Action] = []
                if durable:  # an after waits for its change to be durable
                    afters, self._afters = self._afters, []
                stages, self._stages = self._stages, []
                durable = durable or bool(stages)
                job = _Write(
                    self.boot_id,
                    dict(self._entries),
                    self._changed,
                    befores,
                    afters,
                    stages,
                    durable,
                    self._compact,
                    self._peers,
                )
                self._changed = {}
                failed: OSError | None = None
                try:
                    self._file, failed = await anyio.to_thread.run_sync(
                        _write_group, self.path, job, self._file, self._texts
                    )
                finally:
                    for before in befores:
                        if before.error is not None:
                            self._restore(before.uid, before.previous)
                    for stage in stages:
                        if failed is not None and stage.error is None:  # started stays; the owner rolls back
                            stage.error = self._write_error(failed)
                        elif stage.result is not None:
                            self._set(stage.uid, stage.result)
                            self._changed.pop(stage.uid, None)  # on disk already
                    # The write failed: the afters wait for the next durable write (their owners retry).
                    self._afters.extend(a for a in afters if not a.done)
                if failed is not None:
                    self._compact = True  # memory is undone below: only a new snapshot is sure to match
                    raise failed
                self._compact = False
                self._written = covered
                if durable:
                    self._synced = covered
        except OSError as error:
            # No await between the failed write and the undo: no other write sees our change.
            undo()
            raise self._write_error(error) from error

    def _write_error(self, error: OSError) -> CheckpointWriteError:
        return CheckpointWriteError(
            f"cannot write the checkpoint {self.path}: {error.strerror or error}; "
            "free space on the node's disk (the previous checkpoint is intact)"
        )
