"""Held health conditions kept durably in the state directory, so a restart re-seeds them.

The published taints are not enough: after an outage longer than 30 s the kubelet deletes the
node's ResourceSlices (the plugin deregistered), and a restarted agent would find nothing to
restore. So each driver keeps ``<state-dir>/<driver>/health.json``: every tracked condition with
its kind, first and last occurrence, clear time and the taint effect it had then. It is written
like the checkpoint (temp file, fsync, rename, directory fsync) in a worker thread, at most once a
second (`WRITE_INTERVAL_SECONDS`) and only after a change; it is bounded on read
(`MAX_HEALTH_FILE_BYTES`), and a file that cannot be used is moved aside
(``health.json.corrupt-<unix ts>``) and logged: the published taints still seed what they hold.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from agent.core.atomicfile import quarantine, write_atomic
from agent.core.backend import ConditionKind
from agent.core.boundedfile import MIB, BoundedFileError, parse_json, read_text
from agent.core.clock import Clock
from agent.core.logs import log_fields
from agent.core.model import HealthCondition, Severity
from agent.health.tracker import HealthTracker, HeldCondition

log = logging.getLogger("agent.health.persist")

HEALTH_FILE = "health.json"
FORMAT_VERSION = 1
MAX_HEALTH_FILE_BYTES = 4 * MIB
"""64 conditions on each of 256 devices take ~5 MiB at most; a real node holds a few."""
WRITE_INTERVAL_SECONDS = 1.0

EffectOf = Callable[[str, HealthCondition], str | None]
"""The taint effect a condition of a device has now (None: no taint)."""


class HealthFileError(ValueError):
    """The held-conditions file cannot be used (it is moved aside)."""


@dataclass(frozen=True)
class LoadedConditions:
    """What `load_held` found: the conditions, and where a bad file was moved (None: not moved)."""

    held: tuple[HeldCondition, ...] = ()
    moved_to: Path | None = None
    problem: str = ""


def encode_held(driver: str, held: Sequence[HeldCondition], effect_of: EffectOf) -> bytes:
    """The file's bytes: sorted, one condition per entry, with the effect it is published with now."""
    entries = []
    for h in held:
        c = h.condition
        entries.append(
            {
                "device": h.device,
                "condition": c.condition,
                "value": c.value,
                "severity": c.severity.label,
                "kind": h.kind.value,
                "message": c.message,
                "since": c.since,
                "lastSeen": h.last_seen,
                "clearedAt": h.cleared_at,
                "effect": effect_of(h.device, c) or "",
            }
        )
    document = {"version": FORMAT_VERSION, "driver": driver, "conditions": entries}
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode() + b"\n"


def _number(entry: dict[str, Any], key: str, *, optional: bool = False) -> float | None:
    value = entry.get(key)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise HealthFileError(f"{key} {value!r} is not a number")
    return float(value)


def decode_held(text: str, path: Path, driver: str) -> tuple[HeldCondition, ...]:
    """Parse the file; raise `HealthFileError` naming what is wrong."""
    try:
        document = parse_json(text, path, what="held-conditions file")
    except BoundedFileError as error:
        raise HealthFileError(error.problem) from None
    if not isinstance(document, dict) or document.get("version") != FORMAT_VERSION:
        raise HealthFileError(f"not a version {FORMAT_VERSION} held-conditions document")
    if document.get("driver") != driver:
        raise HealthFileError(f"written for driver {document.get('driver')!r}, not {driver!r}")
    entries = document.get("conditions")
    if not isinstance(entries, list):
        raise HealthFileError("conditions is not a list")
    held = []
    for index, entry in enumerate(entries):
        try:
            if not isinstance(entry, dict):
                raise HealthFileError("not an object")
            texts = {k: entry.get(k) for k in ("device", "condition", "value", "message", "effect")}
            if not all(isinstance(v, str) for v in texts.values()) or not texts["device"]:
                raise HealthFileError("device, condition, value, message and effect must be strings")
            try:
                severity = Severity[str(entry.get("severity")).upper()]
                kind = ConditionKind(entry.get("kind"))
            except (KeyError, ValueError):
                raise HealthFileError("unknown severity or kind") from None
            since = _number(entry, "since")
            last_seen = _number(entry, "lastSeen")
            assert since is not None and last_seen is not None
            condition = HealthCondition(
                str(texts["condition"]),
                severity,
                str(texts["value"]),
                str(texts["message"]),
                since,
                held_effect=str(texts["effect"]),
            )
            cleared = _number(entry, "clearedAt", optional=True)
            held.append(HeldCondition(str(texts["device"]), condition, kind, last_seen, cleared))
        except HealthFileError as error:
            raise HealthFileError(f"conditions[{index}]: {error}") from None
    return tuple(held)


def load_held(path: Path, driver: str, now: float | None = None) -> LoadedConditions:
    """Read the held conditions (blocking); none when there is no file; a bad file is moved aside."""
    try:
        text = read_text(path, max_bytes=MAX_HEALTH_FILE_BYTES, what="held-conditions file")
        return LoadedConditions(decode_held(text, path, driver))
    except BoundedFileError as error:
        if not path.exists():
            return LoadedConditions()
        problem = error.problem
    except HealthFileError as error:
        problem = str(error)
    try:
        aside: Path | None = quarantine(path, int(now if now is not None else time.time()))
    except OSError as error:
        log.error(
            "cannot move the unusable held-conditions file aside; it will be overwritten",
            extra=log_fields(path=str(path), error=str(error)),
        )
        aside = None
    return LoadedConditions(moved_to=aside, problem=problem)


async def restore(tracker: HealthTracker, path: Path, clock: Clock) -> int:
    """Seed `tracker` with the conditions held in `path`; the number restored."""
    loaded = await anyio.to_thread.run_sync(load_held, path, tracker.driver, clock.time())
    if loaded.problem:
        log.warning(
            "held-conditions file unusable; moved aside, the published taints still restore what they hold",
            extra=log_fields(
                driver=tracker.driver,
                path=str(path),
                problem=loaded.problem,
                moved_to=str(loaded.moved_to or ""),
            ),
        )
    for h in loaded.held:
        tracker.seed(
            h.device,
            h.condition,
            kind=h.kind,
            last_seen=h.last_seen,
            cleared_at=h.cleared_at,
            source=f"{path.name} (held before the agent restarted)",
        )
    return len(loaded.held)


class HealthFileWriter:
    """Keeps `path` equal to the tracker's held conditions; `run` until cancelled."""

    def __init__(
        self,
        tracker: HealthTracker,
        path: Path,
        effect_of: EffectOf,
        clock: Clock,
        *,
        interval: float = WRITE_INTERVAL_SECONDS,
    ) -> None:
        self._tracker = tracker
        self._path = path
        self._effect_of = effect_of
        self._clock = clock
        self._interval = interval
        self._written: bytes | None = None

    async def run(self) -> None:
        seen = -1
        while True:
            seen = await self._tracker.wait_changed(seen)
            await self.write_now()
            await self._clock.sleep(self._interval)  # coalesce a storm into one write a second

    async def write_now(self) -> None:
        """Write the file when it differs from the last write (raises OSError: the part restarts)."""
        data = encode_held(self._tracker.driver, self._tracker.held(), self._effect_of)
        if data == self._written:
            return
        await anyio.to_thread.run_sync(self._write, data)
        self._written = data

    def _write(self, data: bytes) -> None:
        self._path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self._path, data, mode=0o600)
