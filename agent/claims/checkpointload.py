"""Reading the checkpoint at start: the boot ID, a bad file moved aside, temp files a crash left."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from agent.claims.checkpoint import (
    CHECKPOINT_FILE,
    MAX_CHECKPOINT_BYTES,
    CheckpointCorruptError,
    CheckpointData,
    FileShape,
    decode_file,
)
from agent.core.atomicfile import TEMP_SUFFIX, quarantine
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
