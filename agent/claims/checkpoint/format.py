"""The checkpoint's entries and file format (snapshot and journal lines); see `agent.claims.checkpoint`."""

from __future__ import annotations

import enum
import hashlib
import json
import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from agent.core.boundedfile import MIB, BoundedFileError, decode_utf8, parse_json
from agent.core.errors import AgentError
from agent.core.logs import log_fields
from agent.core.sharing import OpaqueConfig

log = logging.getLogger("agent.claims.checkpoint")


FORMAT_VERSION = 1
CHECKPOINT_FILE = "checkpoint.json"


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
