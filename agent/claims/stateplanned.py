"""The planned prepare: PrepareStarted, the backend, the CDI spec and PrepareCompleted in one thread hop.

Only for exclusive devices without configuration of a backend that plans its work
(`agent.core.backend.PlansPrepare`); everything else takes the async path of `agent.claims.stateprepare`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from agent.claims.checkpoint import CheckpointDevice, ClaimEntry
from agent.claims.checkpointstore import CheckpointWriteError
from agent.claims.reader import claim_key
from agent.claims.statebase import _ClaimFailure
from agent.claims.statehooks import Step
from agent.claims.stateunprepare import UnpreparePath
from agent.core.backend import ClaimRef, ContainerEdits, PreparePlan

log = logging.getLogger("agent.claims.state")


class PlannedPath(UnpreparePath):
    """The one-hop prepare of `DeviceState` (not used alone)."""

    async def _prepare_planned(
        self, ref: ClaimRef, entry: ClaimEntry, plans: Sequence[PreparePlan]
    ) -> ClaimEntry:
        """PrepareStarted, backend, CDI spec and PrepareCompleted of `_prepare_claim` in one thread hop."""

        def complete() -> ClaimEntry:  # in the checkpoint write's worker thread, PrepareStarted written
            self._step(Step.PREPARE_AFTER_PREPARE_STARTED, ref.uid)
            edits = [
                self._run_plan(ref, device, plan) for device, plan in zip(entry.devices, plans, strict=True)
            ]
            self._step(Step.PREPARE_AFTER_BACKEND_PREPARE, ref.uid)
            completed, cdi_devices, record = self._completed(ref, entry, edits)
            try:
                self.cdi.write_claim_spec(ref.uid, cdi_devices, record)
            except OSError as error:
                raise self._spec_failure(ref, error) from error
            self._step(Step.PREPARE_AFTER_CDI_WRITE, ref.uid)
            return completed

        try:
            completed = await self.store.put_staged(entry, complete)
        except CheckpointWriteError as error:
            await self._rollback(ref, entry)
            raise _ClaimFailure(f"prepare claim {claim_key(ref)}: {error}", "checkpoint") from error
        except BaseException:
            await self._rollback(ref, entry)
            raise
        self._step(Step.PREPARE_AFTER_PREPARE_COMPLETED, ref.uid)
        return completed

    def _plans(self, ref: ClaimRef, devices: Sequence[CheckpointDevice]) -> list[PreparePlan] | None:
        """The backend's blocking prepare of every device (`PlansPrepare`), or None: the async path.

        Only exclusive devices without configuration and without another claim on them: shares
        and their set-up go through the backend's own calls, and their conflict checks with it.
        """
        if self._planner is None or not all(self._exclusive(ref, d) for d in devices):
            return None
        plans = []
        for device in devices:
            try:
                plan = self._planner.plan_prepare(device.device, ref)
            except Exception as error:
                raise self._backend_failure(ref, device, error) from error
            if plan is None:
                return None
            plans.append(plan)
        return plans

    def _run_plan(self, ref: ClaimRef, device: CheckpointDevice, plan: PreparePlan) -> ContainerEdits:
        try:
            return plan()
        except Exception as error:
            raise self._backend_failure(ref, device, error) from error
