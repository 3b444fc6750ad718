"""The dynamic-MIG journal: which MIG devices this backend is creating, holds or destroys.

One small JSON file owned by the NVIDIA backend (not the agent's claim checkpoint). Every step
of a prepare is written before and after it happens (creating the GPU instance, creating the
compute instance, prepared), so that after a crash the start-up reconcile knows which GPU and
compute instances are ours, and which of them no prepared claim holds. Writes are atomic
(temporary file, fsync, rename) and blocking: call them from a worker thread.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from agent.core.errors import BackendError

VERSION = 1
MAX_JOURNAL_BYTES = 4 * 1024 * 1024

CREATING_GI = "creating-gi"
CREATING_CI = "creating-ci"
CI_CREATED = "ci-created"
PREPARED = "prepared"
DESTROYING = "destroying"
STEPS = (CREATING_GI, CREATING_CI, CI_CREATED, PREPARED, DESTROYING)


@dataclass(frozen=True)
class MigEntry:
    """One MIG device of one claim, and how far its creation (or destruction) got."""

    claim_uid: str
    device: str
    gpu_uuid: str
    profile_id: int
    start: int
    size: int
    step: str
    gi_id: int | None = None
    ci_id: int | None = None
    mig_uuid: str = ""
    preexisting_gis: tuple[int, ...] = ()
    """GPU instance IDs that existed before ours was created: never ours, never destroyed."""

    @property
    def key(self) -> str:
        return f"{self.claim_uid}/{self.device}"

    def at(self, step: str, **changes: Any) -> MigEntry:
        return replace(self, step=step, **changes)


class MigJournal:
    """The journal file; every change is written through before the call returns."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._entries: dict[str, MigEntry] = {}

    def load(self) -> None:
        """Read the file (a missing file is an empty journal); raise `BackendError` when unreadable."""
        try:
            with self.path.open("rb") as handle:
                raw = handle.read(MAX_JOURNAL_BYTES + 1)
        except FileNotFoundError:
            return
        except OSError as error:
            raise BackendError(
                f"NVIDIA dynamic MIG: cannot read the journal {self.path}: {error.strerror}: "
                "check the setting dynamic-mig-dir and the volume mounted there"
            ) from None
        try:
            if len(raw) > MAX_JOURNAL_BYTES:
                raise ValueError(f"larger than {MAX_JOURNAL_BYTES} bytes")
            data = json.loads(raw)
            if data.get("version") != VERSION:
                raise ValueError(f"version {data.get('version')!r}, expected {VERSION}")
            entries = [_entry(item) for item in data["entries"]]
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise BackendError(
                f"NVIDIA dynamic MIG: the journal {self.path} is damaged ({error}): check "
                "'nvidia-smi mig -lgi' for MIG devices no claim uses, destroy them, then remove the file"
            ) from None
        with self._lock:
            self._entries = {e.key: e for e in entries}

    def entries(self) -> list[MigEntry]:
        with self._lock:
            return list(self._entries.values())

    def get(self, claim_uid: str, device: str) -> MigEntry | None:
        with self._lock:
            return self._entries.get(f"{claim_uid}/{device}")

    def put(self, entry: MigEntry) -> None:
        with self._lock:
            entries = {**self._entries, entry.key: entry}
            self._write(entries)
            self._entries = entries

    def remove(self, entry: MigEntry) -> None:
        with self._lock:
            entries = {k: v for k, v in self._entries.items() if k != entry.key}
            self._write(entries)
            self._entries = entries

    def _write(self, entries: dict[str, MigEntry]) -> None:
        body = json.dumps(
            {"version": VERSION, "entries": [asdict(e) for e in entries.values()]}, sort_keys=True
        ).encode()
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tmp.open("wb") as handle:
                handle.write(body)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, self.path)
            directory = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
        except OSError as error:
            raise BackendError(
                f"NVIDIA dynamic MIG: cannot write the journal {self.path}: {error.strerror}: "
                "check the setting dynamic-mig-dir and the free space there"
            ) from None


def _entry(item: Any) -> MigEntry:
    entry = MigEntry(
        claim_uid=str(item["claim_uid"]),
        device=str(item["device"]),
        gpu_uuid=str(item["gpu_uuid"]),
        profile_id=int(item["profile_id"]),
        start=int(item["start"]),
        size=int(item["size"]),
        step=str(item["step"]),
        gi_id=None if item.get("gi_id") is None else int(item["gi_id"]),
        ci_id=None if item.get("ci_id") is None else int(item["ci_id"]),
        mig_uuid=str(item.get("mig_uuid", "")),
        preexisting_gis=tuple(int(i) for i in item.get("preexisting_gis", ())),
    )
    if entry.step not in STEPS:
        raise ValueError(f"unknown step {entry.step!r}")
    return entry
