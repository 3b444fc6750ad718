"""The claim state machine of one driver: `DeviceState` implements `agent.claims.preparer.ClaimPreparer`.

Prepare: GET every claim concurrently (before any lock), check it, then per claim under its own
lock: checkpoint ``PrepareStarted`` -> backend prepare of each device -> one CDI spec -> checkpoint
``PrepareCompleted`` (spec and checkpoint in one worker-thread hop, see `CheckpointStore.put`). Any
failure rolls back what was done for that claim. Unprepare reverses it. `start` repairs the
checkpoint and reconciles it with the CDI files and the API server so that, after any crash, no CDI
spec exists without an entry and no completed entry lacks its spec. A corrupt checkpoint is rebuilt
from the specs (`agent.claims.recovery`), whose claims the kubelet still believes prepared. A spec
is deleted only once the checkpoint no longer holds its claim, and a prepare answered from the
checkpoint first checks that the spec is still there.

`DeviceState` is built in layers, one module each, every layer using only those below it:
`agent.claims.statebase` (construction, locks, what every path shares), `stateunprepare`
(unprepare and rollback), `stateplanned` (the one-hop prepare of a planning backend),
`stateprepare` (prepare), `statereconcile` (the start-up reconcile) and this module (the calls:
`start`, `prepare`, `unprepare`). `agent.claims.statehooks` holds the steps and the protocols of
what the machine tells outside it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import anyio
import anyio.to_thread

from agent.claims.checkpoint import ClaimEntry, ClaimPhase
from agent.claims.checkpointload import load_checkpoint
from agent.claims.checkpointstore import CheckpointWriteError
from agent.claims.preparer import PrepareResult
from agent.claims.reader import check_claim
from agent.claims.statebase import _each
from agent.claims.statereconcile import StartupReconcile
from agent.core.backend import ClaimRef
from agent.core.errors import ClaimRequestError
from agent.core.logs import log_fields

log = logging.getLogger("agent.claims.state")


class DeviceState(StartupReconcile):
    """Prepares and unprepares claims of one driver on this node (a `ClaimPreparer`)."""

    async def start(self) -> None:
        """Load (or rebuild) the checkpoint and reconcile it with the CDI files and the API server."""
        async with self._serialized(reload=False):
            await anyio.to_thread.run_sync(self._prepare_dirs)
            outcome = await anyio.to_thread.run_sync(load_checkpoint, self.store.path, self.clock.time())
            entries = outcome.data.entries if outcome.data is not None else {}
            if outcome.problem is not None:
                entries = await self._rebuild(outcome.problem.reason, str(outcome.problem), outcome.moved_to)
            elif outcome.shape is not None and outcome.shape.torn_tail:
                entries = await self._complete_from_specs(entries)
            self.store.load(entries)
            boot_changed = outcome.data is not None and outcome.data.boot_id != self._boot_id
            if boot_changed:
                log.info(
                    "node rebooted since the checkpoint was written; rewriting CDI specs",
                    extra=log_fields(driver=self.driver, claims=len(entries)),
                )
            # Rebuilt entries get their specs rewritten too: the boot they were written in is unknown.
            await self._reconcile(boot_changed, rebuilt=outcome.problem is not None)
            await self._resume_shares()
            try:
                await self.store.flush()
            except CheckpointWriteError as error:
                log.error("cannot write the checkpoint at start", extra=log_fields(error=str(error)))
            self._update_gauges()

    async def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, PrepareResult]:
        """Prepare every claim; see `agent.claims.preparer.ClaimPreparer.prepare`."""
        refs = list({ref.uid: ref for ref in claims}.values())
        if not refs:
            return {}
        with self._counted_call():
            return await self._prepare(refs)

    async def _prepare(self, refs: Sequence[ClaimRef]) -> Mapping[str, PrepareResult]:
        objects = await self._fetch_claims(refs)
        try:
            for ref in refs:
                check_claim(ref, objects[ref.uid])
        except ClaimRequestError:
            self._count("prepare", "error", "claim_state")
            raise
        results: dict[str, PrepareResult] = {}
        async with self._serialized():
            await _each(lambda ref: self._prepare_one(ref, objects[ref.uid], results), refs)
        if self.listener is not None:
            read = {ref: objects[ref.uid] for ref in refs if not results[ref.uid].error}
            try:
                self.listener.claims_read(read)
            except Exception as error:  # metrics must never fail a prepare
                log.warning("prepared-claims listener failed", extra=log_fields(error=repr(error)))
        return results

    async def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, str]:
        """Unprepare every claim; unknown claims succeed. No API call."""
        refs = list({ref.uid: ref for ref in claims}.values())
        if not refs:
            return {}
        results: dict[str, str] = {}
        with self._counted_call():
            async with self._serialized():
                await _each(lambda ref: self._unprepare_one(ref, results), refs)
        return results

    def prepared_claims(self) -> dict[str, ClaimEntry]:
        """Completed claims by UID (for metrics and debugging)."""
        return {uid: e for uid, e in self.store.entries().items() if e.phase is ClaimPhase.COMPLETED}
