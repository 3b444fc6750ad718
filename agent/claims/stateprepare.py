"""Prepare: GET the claims, check them, then per claim under its lock the planned or the async path.

The async path: checkpoint ``PrepareStarted`` -> backend prepare of each device -> CDI spec and
``PrepareCompleted`` in one worker-thread hop. Any failure rolls back what was done for the claim.
A claim answered from the checkpoint first checks that its spec is still there.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import anyio.to_thread

from agent.claims.checkpoint import CheckpointDevice, ClaimEntry, ClaimPhase
from agent.claims.checkpointstore import CheckpointWriteError
from agent.claims.preparer import PrepareResult
from agent.claims.reader import ClaimAllocationError, claim_key, parse_allocation, parse_device_configs
from agent.claims.statebase import _ClaimFailure, _each, _share
from agent.claims.statehooks import Step
from agent.claims.stateplanned import PlannedPath
from agent.core.backend import ClaimRef, ContainerEdits
from agent.core.errors import ClaimRequestError, KubeApiError
from agent.core.logs import log_fields
from agent.core.sharing import select_config

log = logging.getLogger("agent.claims.state")


def _api_error_code(error: Exception) -> str:
    status = getattr(error, "status", 0)
    if status == 404:
        return "NOT_FOUND"
    if status == 403:
        return "PERMISSION_DENIED"
    if status in (0, 429) or status >= 500:
        return "UNAVAILABLE"
    return "FAILED_PRECONDITION"


class PreparePath(PlannedPath):
    """Prepare of `DeviceState` (not used alone)."""

    async def _fetch_claims(self, refs: Sequence[ClaimRef]) -> dict[str, Mapping[str, Any]]:
        objects: dict[str, Mapping[str, Any]] = {}
        errors: dict[str, ClaimRequestError] = {}

        async def fetch(ref: ClaimRef) -> None:
            try:
                objects[ref.uid] = await self.claims.get_resource_claim(ref.namespace, ref.name)
            except (KubeApiError, OSError, TimeoutError) as error:
                errors[ref.uid] = ClaimRequestError(
                    f"retrieve claim {claim_key(ref)}: {error}", _api_error_code(error)
                )

        await _each(fetch, refs)
        for ref in refs:
            if ref.uid in errors:
                self._count("prepare", "error", "api")
                raise errors[ref.uid]
        return objects

    async def _prepare_one(
        self, ref: ClaimRef, claim: Mapping[str, Any], results: dict[str, PrepareResult]
    ) -> None:
        started = self.clock.monotonic()
        try:
            results[ref.uid] = await self._prepare_claim(ref, claim)
            self._count("prepare", "success")
        except _ClaimFailure as failure:
            results[ref.uid] = PrepareResult(error=str(failure))
            self._count("prepare", "error", failure.reason)
            log.warning(
                "claim preparation failed",
                extra=log_fields(driver=self.driver, claim=claim_key(ref), uid=ref.uid, error=str(failure)),
            )
        except Exception as error:  # a bug must not take the other claims of the call with it
            log.exception("claim preparation failed unexpectedly", extra=log_fields(uid=ref.uid))
            results[ref.uid] = PrepareResult(error=f"internal error preparing {claim_key(ref)}: {error!r}")
            self._count("prepare", "error", "internal")
        finally:
            if self.metrics is not None:
                self._child(self.metrics.claim_latency, self.driver, "prepare").observe(
                    self.clock.monotonic() - started
                )

    async def _prepare_claim(self, ref: ClaimRef, claim: Mapping[str, Any]) -> PrepareResult:
        try:
            allocated = parse_allocation(ref, claim, driver=self.driver, pool=self.node_name)
            configs = parse_device_configs(ref, claim, driver=self.driver)
        except ClaimAllocationError as error:
            raise _ClaimFailure(str(error), error.reason) from error
        if not allocated.devices:
            return PrepareResult()
        async with self._claim_lock(ref.uid):
            existing = self.store.get(ref.uid)
            if existing is not None and existing.phase is ClaimPhase.COMPLETED:
                # Never answer CDI IDs that do not resolve: the spec may be gone (a CDI root cleaned
                # behind our back) or the backend released (an unprepare that could not drop the entry).
                if ref.uid in self._released or not await anyio.to_thread.run_sync(
                    self.cdi.has_claim_spec, ref.uid
                ):
                    log.warning(
                        "prepared claim lost its CDI spec or backend state; preparing it again",
                        extra=log_fields(driver=self.driver, claim=claim_key(ref), uid=ref.uid),
                    )
                    existing = await self._refresh(ref, existing)
                return self._result(existing)
            entry = ClaimEntry(
                uid=ref.uid,
                namespace=ref.namespace,
                name=ref.name,
                phase=ClaimPhase.STARTED,
                devices=tuple(
                    CheckpointDevice(
                        pool=d.pool,
                        device=d.device,
                        requests=d.requests,
                        share_id=d.share_id,
                        consumed=d.consumed,
                        config=select_config(configs, d.requests),
                    )
                    for d in allocated.devices
                ),
            )
            plans = self._plans(ref, entry.devices)
            self._step(Step.PREPARE_BEFORE_CHECKPOINT_START, ref.uid)
            if plans is not None:
                return self._result(await self._prepare_planned(ref, entry, plans))
            try:
                # Not fsynced: it guards the CDI tmpfs and device state, which a power loss resets.
                await self.store.put(entry, durable=False)
            except CheckpointWriteError as error:
                raise _ClaimFailure(f"prepare claim {claim_key(ref)}: {error}", "checkpoint") from error
            except BaseException:
                await self._rollback(ref, entry)  # cancelled mid-write: the entry may be on disk
                raise
            self._step(Step.PREPARE_AFTER_PREPARE_STARTED, ref.uid)
            try:
                completed = await self._prepare_devices(ref, entry)
            except BaseException:
                await self._rollback(ref, entry)
                raise
            self._step(Step.PREPARE_AFTER_PREPARE_COMPLETED, ref.uid)
            return self._result(completed)

    async def _prepare_devices(self, ref: ClaimRef, entry: ClaimEntry) -> ClaimEntry:
        """Backend prepare, CDI spec, checkpoint completed; raises `_ClaimFailure` (caller rolls back)."""
        edits = await self._backend_prepare(ref, entry.devices)
        self._step(Step.PREPARE_AFTER_BACKEND_PREPARE, ref.uid)
        completed, cdi_devices, record = self._completed(ref, entry, edits)

        def write_spec() -> None:  # in the checkpoint write's worker thread, before that write
            self.cdi.write_claim_spec(ref.uid, cdi_devices, record)
            self._step(Step.PREPARE_AFTER_CDI_WRITE, ref.uid)

        try:
            await self.store.put(completed, before=write_spec)
        except OSError as error:
            raise self._spec_failure(ref, error) from error
        except CheckpointWriteError as error:
            raise _ClaimFailure(f"prepare claim {claim_key(ref)}: {error}", "checkpoint") from error
        return completed

    async def _refresh(self, ref: ClaimRef, entry: ClaimEntry) -> ClaimEntry:
        """Redo a completed claim's backend prepare (idempotent) and spec; raises `_ClaimFailure`."""
        edits = await self._backend_prepare(ref, entry.devices)
        completed = await self._write_spec(ref, entry, edits)
        if completed != entry:
            await self._put(ref, completed)
        self._released.discard(ref.uid)
        return completed

    async def _put(self, ref: ClaimRef, entry: ClaimEntry) -> None:
        try:
            await self.store.put(entry)
        except CheckpointWriteError as error:
            raise _ClaimFailure(f"prepare claim {claim_key(ref)}: {error}", "checkpoint") from error

    async def _backend_prepare(
        self, ref: ClaimRef, devices: Sequence[CheckpointDevice]
    ) -> list[ContainerEdits]:
        edits: list[ContainerEdits] = []
        for index, device in enumerate(devices):
            try:
                if self._sharing is not None:
                    async with self._device_lock(device.device):
                        share = _share(ref, device)
                        peers = self._peers(ref, devices, index)
                        edits.append(await self._sharing.prepare_share(share, peers))
                else:
                    edits.append(await self.backend.prepare(device.device, ref))
            except Exception as error:
                raise self._backend_failure(ref, device, error) from error
        return edits

    async def _write_spec(
        self, ref: ClaimRef, entry: ClaimEntry, edits: Sequence[ContainerEdits]
    ) -> ClaimEntry:
        """Write the claim's CDI spec, recording in it the completed entry (with CDI IDs) returned."""
        completed, cdi_devices, record = self._completed(ref, entry, edits)
        try:
            await anyio.to_thread.run_sync(self.cdi.write_claim_spec, ref.uid, cdi_devices, record)
        except OSError as error:
            raise self._spec_failure(ref, error) from error
        return completed
