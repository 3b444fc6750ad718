"""The start-up: the checkpoint loaded (or rebuilt from the CDI specs), then reconciled with specs and API.

After any crash no CDI spec exists without an entry and no completed entry lacks its spec: stale
PrepareStarted entries are rolled back, claims deleted meanwhile unprepared, lost specs rewritten,
orphan specs removed, and a sharing backend told which shares survived. A corrupt checkpoint is
rebuilt from the specs (`rebuild_from_specs`): each carries its claim's completed entry
(`agent.claims.cdi.RECORD_PREFIX`); a spec without a usable record is reported and removed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.to_thread

from agent.claims.cdi import CdiSpecWriter
from agent.claims.checkpoint.file import load_checkpoint, remove_temp_files
from agent.claims.checkpoint.format import ClaimEntry, ClaimPhase, entry_from_json
from agent.claims.checkpoint.store import CheckpointWriteError
from agent.claims.reader import claim_key
from agent.claims.state.driver import ClaimFailure, DriverState, share
from agent.claims.state.prepare import refresh
from agent.claims.state.unprepare import undo
from agent.core.backend import ClaimRef
from agent.core.boundedfile import BoundedFileError
from agent.core.errors import KubeApiError
from agent.core.logs import log_fields

log = logging.getLogger("agent.claims.state")


RECONCILE_CONCURRENCY = 16
"""Claim GETs in flight at once while reconciling at start (spares the API server)."""


async def start(s: DriverState) -> None:
    """Load (or rebuild) the checkpoint and reconcile it with the CDI files and the API server."""
    async with s.serialized(reload=False):
        await anyio.to_thread.run_sync(_prepare_dirs, s)
        outcome = await anyio.to_thread.run_sync(load_checkpoint, s.store.path, s.clock.time())
        entries = outcome.data.entries if outcome.data is not None else {}
        if outcome.problem is not None:
            entries = await _rebuild(s, outcome.problem.reason, str(outcome.problem), outcome.moved_to)
        elif outcome.shape is not None and outcome.shape.torn_tail:
            entries = await _complete_from_specs(s, entries)
        s.store.load(entries)
        boot_changed = outcome.data is not None and outcome.data.boot_id != s.store.boot_id
        if boot_changed:
            log.info(
                "node rebooted since the checkpoint was written; rewriting CDI specs",
                extra=log_fields(driver=s.driver, claims=len(entries)),
            )
        # Rebuilt entries get their specs rewritten too: the boot they were written in is unknown.
        await _reconcile(s, boot_changed, rebuilt=outcome.problem is not None)
        await _resume_shares(s)
        try:
            await s.store.flush()
        except CheckpointWriteError as error:
            log.error("cannot write the checkpoint at start", extra=log_fields(error=str(error)))
        s.report.update_gauges()


def _prepare_dirs(s: DriverState) -> None:
    s.state_dir.mkdir(parents=True, exist_ok=True)
    remove_temp_files(s.state_dir)
    s.cdi.remove_temp_files()


@dataclass(frozen=True)
class Rebuilt:
    """The entries rebuilt from spec files, and the specs that could not be used (UID -> why)."""

    entries: dict[str, ClaimEntry]
    unusable: dict[str, str]


def rebuild_from_specs(cdi: CdiSpecWriter) -> Rebuilt:
    """Entries for every spec of `cdi`'s driver that records its claim (blocking)."""
    entries: dict[str, ClaimEntry] = {}
    unusable: dict[str, str] = {}
    for uid in sorted(cdi.claim_spec_uids()):
        try:
            entries[uid] = _entry_of(cdi, uid)
        except ValueError as error:
            unusable[uid] = str(error)
    return Rebuilt(entries, unusable)


def _entry_of(cdi: CdiSpecWriter, uid: str) -> ClaimEntry:
    """The completed entry a spec records; raises ValueError saying why there is none."""
    try:
        record = cdi.read_claim_record(uid)
    except BoundedFileError as error:
        raise ValueError(str(error)) from None
    if record is None:
        raise ValueError("the spec has no claim record (written by an older agent)")
    if not isinstance(record, dict) or record.get("uid") != uid:
        raise ValueError("the claim record does not name the claim of the spec file")
    try:
        entry = entry_from_json(uid, record)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise ValueError(f"malformed claim record: {error!r}") from None
    if entry.phase is not ClaimPhase.COMPLETED or not entry.devices:
        raise ValueError("the claim record is not a prepared claim")
    return entry


async def _rebuild(s: DriverState, reason: str, problem: str, moved_to: Path | None) -> dict[str, ClaimEntry]:
    """Entries from the surviving CDI specs of a corrupt checkpoint, reported as a recovery."""
    rebuilt = await anyio.to_thread.run_sync(rebuild_from_specs, s.cdi)
    for uid, why in rebuilt.unusable.items():
        log.error(
            "cannot rebuild a claim from its CDI spec; the spec will be removed",
            extra=log_fields(driver=s.driver, uid=uid, error=why),
        )
    outcome = f"from the CDI specs of {len(rebuilt.entries)} prepared claim(s)"
    if rebuilt.unusable:
        outcome += (
            f"; {len(rebuilt.unusable)} spec(s) without a usable claim record are removed, "
            "their pods may need a restart"
        )
    await s.report.recovery(reason, problem, moved_to, rebuilt=outcome)
    return rebuilt.entries


async def _complete_from_specs(s: DriverState, entries: Mapping[str, ClaimEntry]) -> dict[str, ClaimEntry]:
    """`entries` of a checkpoint whose unfinished last record was dropped, plus what the specs add.

    After a power loss the specs (on a tmpfs) are gone and nothing is added. A spec that
    survives with a completed claim the entries lack or hold as started was written before
    its PrepareCompleted record: the file was cut within the journal (or that record with it),
    and the claim is taken from the spec, as from a corrupt checkpoint.
    """
    rebuilt = await anyio.to_thread.run_sync(rebuild_from_specs, s.cdi)
    restored = {
        uid: e
        for uid, e in rebuilt.entries.items()
        if uid not in entries or entries[uid].phase is not ClaimPhase.COMPLETED
    }
    if restored:
        await s.report.recovery(
            "torn_journal",
            "its last journal record was cut short",
            None,
            rebuilt=f"{len(restored)} claim(s) from their CDI specs",
        )
    return {**entries, **restored}


async def _exists(s: DriverState, entry: ClaimEntry) -> bool | None:
    """Whether the API server has the claim: True, False (deleted or replaced) or None (unknown)."""
    try:
        claim = await s.claims.get_resource_claim(entry.namespace, entry.name)
    except (KubeApiError, OSError, TimeoutError) as error:
        if isinstance(error, KubeApiError) and error.status == 404:
            return False
        log.warning(
            "cannot check claim at start; keeping it",
            extra=log_fields(uid=entry.uid, claim=f"{entry.namespace}/{entry.name}", error=str(error)),
        )
        return None
    metadata = claim.get("metadata") or {}
    return str(metadata.get("uid", "")) == entry.uid


async def _reconcile(s: DriverState, boot_changed: bool, *, rebuilt: bool = False) -> None:
    entries = s.store.entries()
    exists: dict[str, bool | None] = {}
    limiter = anyio.CapacityLimiter(RECONCILE_CONCURRENCY)

    async def lookup(entry: ClaimEntry) -> None:
        async with limiter:
            exists[entry.uid] = await _exists(s, entry)

    completed = [e for e in entries.values() if e.phase is ClaimPhase.COMPLETED]
    async with anyio.create_task_group() as tg:
        for entry in completed:
            tg.start_soon(lookup, entry)
    for entry in entries.values():
        ref = ClaimRef(entry.namespace, entry.name, entry.uid)
        if entry.phase is ClaimPhase.STARTED:
            log.info("rolling back a preparation a crash interrupted", extra=log_fields(uid=entry.uid))
            await undo(s, ref, entry, reason="stale PrepareStarted")
        elif exists[entry.uid] is False:
            log.info("unpreparing a claim deleted while the agent was down", extra=log_fields(uid=entry.uid))
            await undo(s, ref, entry, reason="claim deleted")
        elif boot_changed or rebuilt or not await anyio.to_thread.run_sync(s.cdi.has_claim_spec, entry.uid):
            if rebuilt and exists[entry.uid] is None:
                log.warning(
                    "keeping a claim rebuilt from its CDI spec unverified: the API server did not answer",
                    extra=log_fields(uid=entry.uid, claim=f"{entry.namespace}/{entry.name}"),
                )
            await _restore_spec(s, ref, entry)
    owned = set(s.store.entries())
    for uid in await anyio.to_thread.run_sync(s.cdi.claim_spec_uids):
        if uid not in owned:
            log.info("removing a CDI spec no checkpoint entry owns", extra=log_fields(uid=uid))
            try:
                await anyio.to_thread.run_sync(s.cdi.remove_claim_spec, uid)
            except OSError as error:
                log.error("cannot remove orphan CDI spec", extra=log_fields(uid=uid, error=str(error)))


async def _restore_spec(s: DriverState, ref: ClaimRef, entry: ClaimEntry) -> None:
    """Re-run backend prepare (idempotent) and rewrite a completed claim's lost CDI spec."""
    try:
        await refresh(s, ref, entry)
        log.info("rewrote the CDI spec of a prepared claim", extra=log_fields(uid=entry.uid))
    except ClaimFailure as error:
        # A completed entry without its spec breaks the invariant: drop the claim instead.
        log.error(
            "cannot restore a prepared claim; unpreparing it",
            extra=log_fields(uid=entry.uid, claim=claim_key(ref), error=str(error)),
        )
        await undo(s, ref, entry, reason="restore failed")
        await s.report.event(
            "ClaimRestoreFailed",
            f"claim {claim_key(ref)} ({entry.uid}) could not be restored after restart: {error}",
        )


async def _resume_shares(s: DriverState) -> None:
    """Tell a sharing backend which shares survived the restart (it re-adopts or undoes its set-up)."""
    if s.sharing is None:
        return
    shares = [
        share(ClaimRef(e.namespace, e.name, e.uid), d)
        for e in s.store.entries().values()
        if e.phase is ClaimPhase.COMPLETED
        for d in e.devices
    ]
    try:
        await s.sharing.resume_shares(shares)
    except Exception as error:  # the shares stay prepared; the next prepare of a device repairs it
        log.error(
            "cannot resume the shared devices' set-up", extra=log_fields(driver=s.driver, error=repr(error))
        )
