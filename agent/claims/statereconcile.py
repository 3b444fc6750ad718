"""The start-up reconcile: the checkpoint repaired or rebuilt, then checked against the CDI specs and API.

After any crash no CDI spec exists without an entry and no completed entry lacks its spec: stale
PrepareStarted entries are rolled back, claims deleted meanwhile unprepared, lost specs rewritten,
orphan specs removed, and a sharing backend told which shares survived.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.to_thread

from agent.claims.checkpoint import ClaimEntry, ClaimPhase
from agent.claims.checkpointload import remove_temp_files
from agent.claims.reader import claim_key
from agent.claims.recovery import rebuild_from_specs
from agent.claims.statebase import _ClaimFailure, _share
from agent.claims.stateprepare import PreparePath
from agent.core.backend import ClaimRef
from agent.core.errors import KubeApiError
from agent.core.logs import log_fields

log = logging.getLogger("agent.claims.state")


RECONCILE_CONCURRENCY = 16
"""Claim GETs in flight at once while reconciling at start (spares the API server)."""


@dataclass(frozen=True)
class _Lookup:
    """What the API server said about a checkpointed claim at start."""

    exists: bool | None
    """True: the same claim exists; False: deleted or replaced; None: unknown (API unreachable)."""


class StartupReconcile(PreparePath):
    """The start-up reconcile of `DeviceState` (not used alone)."""

    async def _resume_shares(self) -> None:
        """Tell a sharing backend which shares survived the restart (it re-adopts or undoes its set-up)."""
        if self._sharing is None:
            return
        shares = [
            _share(ClaimRef(e.namespace, e.name, e.uid), d)
            for e in self.store.entries().values()
            if e.phase is ClaimPhase.COMPLETED
            for d in e.devices
        ]
        try:
            await self._sharing.resume_shares(shares)
        except Exception as error:  # the shares stay prepared; the next prepare of a device repairs it
            log.error(
                "cannot resume the shared devices' set-up",
                extra=log_fields(driver=self.driver, error=repr(error)),
            )

    def _prepare_dirs(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        remove_temp_files(self.state_dir)
        self.cdi.remove_temp_files()

    async def _rebuild(self, reason: str, problem: str, moved_to: Path | None) -> dict[str, ClaimEntry]:
        """Entries from the surviving CDI specs of a corrupt checkpoint, reported as a recovery."""
        rebuilt = await anyio.to_thread.run_sync(rebuild_from_specs, self.cdi)
        for uid, why in rebuilt.unusable.items():
            log.error(
                "cannot rebuild a claim from its CDI spec; the spec will be removed",
                extra=log_fields(driver=self.driver, uid=uid, error=why),
            )
        outcome = f"from the CDI specs of {len(rebuilt.entries)} prepared claim(s)"
        if rebuilt.unusable:
            outcome += (
                f"; {len(rebuilt.unusable)} spec(s) without a usable claim record are removed, "
                "their pods may need a restart"
            )
        await self._report_recovery(reason, problem, moved_to, rebuilt=outcome)
        return rebuilt.entries

    async def _complete_from_specs(self, entries: Mapping[str, ClaimEntry]) -> dict[str, ClaimEntry]:
        """`entries` of a checkpoint whose unfinished last record was dropped, plus what the specs add.

        After a power loss the specs (on a tmpfs) are gone and nothing is added. A spec that
        survives with a completed claim the entries lack or hold as started was written before
        its PrepareCompleted record: the file was cut within the journal (or that record with it),
        and the claim is taken from the spec, as from a corrupt checkpoint.
        """
        rebuilt = await anyio.to_thread.run_sync(rebuild_from_specs, self.cdi)
        restored = {
            uid: e
            for uid, e in rebuilt.entries.items()
            if uid not in entries or entries[uid].phase is not ClaimPhase.COMPLETED
        }
        if restored:
            await self._report_recovery(
                "torn_journal",
                "its last journal record was cut short",
                None,
                rebuilt=f"{len(restored)} claim(s) from their CDI specs",
            )
        return {**entries, **restored}

    async def _lookup(self, entry: ClaimEntry) -> _Lookup:
        try:
            claim = await self.claims.get_resource_claim(entry.namespace, entry.name)
        except KubeApiError as error:
            if error.status == 404:
                return _Lookup(exists=False)
            log.warning(
                "cannot check claim at start; keeping it",
                extra=log_fields(uid=entry.uid, claim=f"{entry.namespace}/{entry.name}", error=str(error)),
            )
            return _Lookup(exists=None)
        except (OSError, TimeoutError) as error:
            log.warning(
                "cannot check claim at start; keeping it", extra=log_fields(uid=entry.uid, error=str(error))
            )
            return _Lookup(exists=None)
        metadata = claim.get("metadata") or {}
        return _Lookup(exists=str(metadata.get("uid", "")) == entry.uid)

    async def _reconcile(self, boot_changed: bool, *, rebuilt: bool = False) -> None:
        entries = self.store.entries()
        lookups: dict[str, _Lookup] = {}

        limiter = anyio.CapacityLimiter(RECONCILE_CONCURRENCY)

        async def lookup(entry: ClaimEntry) -> None:
            async with limiter:
                lookups[entry.uid] = await self._lookup(entry)

        completed = [e for e in entries.values() if e.phase is ClaimPhase.COMPLETED]
        async with anyio.create_task_group() as tg:
            for entry in completed:
                tg.start_soon(lookup, entry)
        for entry in entries.values():
            ref = ClaimRef(entry.namespace, entry.name, entry.uid)
            if entry.phase is ClaimPhase.STARTED:
                log.info("rolling back a preparation a crash interrupted", extra=log_fields(uid=entry.uid))
                await self._undo(ref, entry, reason="stale PrepareStarted")
            elif lookups[entry.uid].exists is False:
                log.info(
                    "unpreparing a claim deleted while the agent was down", extra=log_fields(uid=entry.uid)
                )
                await self._undo(ref, entry, reason="claim deleted")
            elif (
                boot_changed
                or rebuilt
                or not await anyio.to_thread.run_sync(self.cdi.has_claim_spec, entry.uid)
            ):
                if rebuilt and lookups[entry.uid].exists is None:
                    log.warning(
                        "keeping a claim rebuilt from its CDI spec unverified: the API server did not answer",
                        extra=log_fields(uid=entry.uid, claim=f"{entry.namespace}/{entry.name}"),
                    )
                await self._restore_spec(ref, entry)
        owned = set(self.store.entries())
        for uid in await anyio.to_thread.run_sync(self.cdi.claim_spec_uids):
            if uid not in owned:
                log.info("removing a CDI spec no checkpoint entry owns", extra=log_fields(uid=uid))
                try:
                    await anyio.to_thread.run_sync(self.cdi.remove_claim_spec, uid)
                except OSError as error:
                    log.error("cannot remove orphan CDI spec", extra=log_fields(uid=uid, error=str(error)))

    async def _restore_spec(self, ref: ClaimRef, entry: ClaimEntry) -> None:
        """Re-run backend prepare (idempotent) and rewrite a completed claim's lost CDI spec."""
        try:
            await self._refresh(ref, entry)
            log.info("rewrote the CDI spec of a prepared claim", extra=log_fields(uid=entry.uid))
        except _ClaimFailure as error:
            # A completed entry without its spec breaks the invariant: drop the claim instead.
            log.error(
                "cannot restore a prepared claim; unpreparing it",
                extra=log_fields(uid=entry.uid, claim=claim_key(ref), error=str(error)),
            )
            await self._undo(ref, entry, reason="restore failed")
            if self.events is not None:
                try:
                    await self.events.record(
                        "ClaimRestoreFailed",
                        f"claim {claim_key(ref)} ({entry.uid}) could not be restored after restart: {error}",
                        "Warning",
                    )
                except Exception as event_error:
                    log.warning("cannot record event", extra=log_fields(error=repr(event_error)))
