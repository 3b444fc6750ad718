"""The checkpoint file on disk: read at start (`load_checkpoint`, a bad file moved aside), then held
open (`_OpenFile`) for appends of journal records, or replaced by a compaction (temp file, fsync,
rename) when asked, when the journal outgrew its snapshot, or when it is not the file held open.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Collection
from dataclasses import dataclass, replace
from pathlib import Path

from agent.claims.checkpoint.format import (
    CHECKPOINT_FILE,
    MAX_CHECKPOINT_BYTES,
    CheckpointCorruptError,
    CheckpointData,
    ClaimEntry,
    EntryTexts,
    FileShape,
    decode_file,
    encode,
    encode_record,
)
from agent.core import atomicfile
from agent.core.atomicfile import TEMP_SUFFIX, quarantine, write_atomic
from agent.core.boundedfile import BoundedFileError, read_bytes
from agent.core.logs import log_fields

log = logging.getLogger("agent.claims.checkpoint")


BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")


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
