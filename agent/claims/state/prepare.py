"""Prepare: GET the claims, check them, then per claim under its lock the planned or the async path.

The async path: checkpoint ``PrepareStarted`` -> backend prepare of each device -> CDI spec and
``PrepareCompleted`` in one worker-thread hop. The planned path, for exclusive devices without
configuration of a backend that plans its work (`agent.core.backend.PlansPrepare`): all of it in
one hop. Any failure rolls back what was done for the claim. A claim answered from the checkpoint
first checks that its spec is still there.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import anyio
import anyio.to_thread

from agent.claims.cdi import CdiDevice, cdi_device_name, qualified_device_id
from agent.claims.checkpoint.format import CheckpointDevice, ClaimEntry, ClaimPhase, entry_json
from agent.claims.checkpoint.store import CheckpointWriteError
from agent.claims.preparer import PreparedDevice, PrepareResult
from agent.claims.reader import ClaimAllocationError, claim_key, parse_allocation, parse_device_configs
from agent.claims.state.driver import ClaimFailure, DriverState, each, share
from agent.claims.state.hooks import Step
from agent.claims.state.unprepare import rollback
from agent.core.backend import ClaimRef, ContainerEdits, PreparePlan
from agent.core.errors import ClaimRequestError, DeviceNotFoundError, KubeApiError
from agent.core.logs import log_fields
from agent.core.sharing import DeviceConfigError, ShareConflictError, select_config

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


async def fetch_claims(s: DriverState, refs: Sequence[ClaimRef]) -> dict[str, Mapping[str, Any]]:
    """The API object of every claim, read concurrently; raises `ClaimRequestError` for the call."""
    objects: dict[str, Mapping[str, Any]] = {}
    errors: dict[str, ClaimRequestError] = {}

    async def fetch(ref: ClaimRef) -> None:
        try:
            objects[ref.uid] = await s.claims.get_resource_claim(ref.namespace, ref.name)
        except (KubeApiError, OSError, TimeoutError) as error:
            errors[ref.uid] = ClaimRequestError(
                f"retrieve claim {claim_key(ref)}: {error}", _api_error_code(error)
            )

    await each(fetch, refs)
    for ref in refs:
        if ref.uid in errors:
            s.report.count("prepare", "error", "api")
            raise errors[ref.uid]
    return objects


async def prepare_one(
    s: DriverState, ref: ClaimRef, claim: Mapping[str, Any], results: dict[str, PrepareResult]
) -> None:
    """Prepare one claim of a call into `results`; its failure is its own, never the call's."""
    started = s.clock.monotonic()
    try:
        results[ref.uid] = await _prepare_claim(s, ref, claim)
        s.report.count("prepare", "success")
    except ClaimFailure as failure:
        results[ref.uid] = PrepareResult(error=str(failure))
        s.report.count("prepare", "error", failure.reason)
        log.warning(
            "claim preparation failed",
            extra=log_fields(driver=s.driver, claim=claim_key(ref), uid=ref.uid, error=str(failure)),
        )
    except Exception as error:  # a bug must not take the other claims of the call with it
        log.exception("claim preparation failed unexpectedly", extra=log_fields(uid=ref.uid))
        results[ref.uid] = PrepareResult(error=f"internal error preparing {claim_key(ref)}: {error!r}")
        s.report.count("prepare", "error", "internal")
    finally:
        s.report.latency("prepare", started)


async def _prepare_claim(s: DriverState, ref: ClaimRef, claim: Mapping[str, Any]) -> PrepareResult:
    try:
        allocated = parse_allocation(ref, claim, driver=s.driver, pool=s.node_name)
        configs = parse_device_configs(ref, claim, driver=s.driver)
    except ClaimAllocationError as error:
        raise ClaimFailure(str(error), error.reason) from error
    if not allocated.devices:
        return PrepareResult()
    async with s.claim_lock(ref.uid):
        existing = s.store.get(ref.uid)
        if existing is not None and existing.phase is ClaimPhase.COMPLETED:
            # Never answer CDI IDs that do not resolve: the spec may be gone (a CDI root cleaned
            # behind our back) or the backend released (an unprepare that could not drop the entry).
            if ref.uid in s.released or not await anyio.to_thread.run_sync(s.cdi.has_claim_spec, ref.uid):
                log.warning(
                    "prepared claim lost its CDI spec or backend state; preparing it again",
                    extra=log_fields(driver=s.driver, claim=claim_key(ref), uid=ref.uid),
                )
                existing = await refresh(s, ref, existing)
            return _result(existing)
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
        plans = _plans(s, ref, entry.devices)
        s.report.step(Step.PREPARE_BEFORE_CHECKPOINT_START, ref.uid)
        if plans is not None:
            return _result(await _prepare_planned(s, ref, entry, plans))
        try:
            # Not fsynced: it guards the CDI tmpfs and device state, which a power loss resets.
            await s.store.put(entry, durable=False)
        except CheckpointWriteError as error:
            raise ClaimFailure(f"prepare claim {claim_key(ref)}: {error}", "checkpoint") from error
        except BaseException:
            await rollback(s, ref, entry)  # cancelled mid-write: the entry may be on disk
            raise
        s.report.step(Step.PREPARE_AFTER_PREPARE_STARTED, ref.uid)
        try:
            completed = await _prepare_devices(s, ref, entry)
        except BaseException:
            await rollback(s, ref, entry)
            raise
        s.report.step(Step.PREPARE_AFTER_PREPARE_COMPLETED, ref.uid)
        return _result(completed)


async def _prepare_devices(s: DriverState, ref: ClaimRef, entry: ClaimEntry) -> ClaimEntry:
    """Backend prepare, CDI spec, checkpoint completed; raises `ClaimFailure` (caller rolls back)."""
    edits = await _backend_prepare(s, ref, entry.devices)
    s.report.step(Step.PREPARE_AFTER_BACKEND_PREPARE, ref.uid)
    completed, cdi_devices, record = _completed(s.driver, ref, entry, edits)

    def write_spec() -> None:  # in the checkpoint write's worker thread, before that write
        s.cdi.write_claim_spec(ref.uid, cdi_devices, record)
        s.report.step(Step.PREPARE_AFTER_CDI_WRITE, ref.uid)

    try:
        await s.store.put(completed, before=write_spec)
    except OSError as error:
        raise _spec_failure(s, ref, error) from error
    except CheckpointWriteError as error:
        raise ClaimFailure(f"prepare claim {claim_key(ref)}: {error}", "checkpoint") from error
    return completed


async def _prepare_planned(
    s: DriverState, ref: ClaimRef, entry: ClaimEntry, plans: Sequence[PreparePlan]
) -> ClaimEntry:
    """PrepareStarted, backend, CDI spec and PrepareCompleted of `_prepare_claim` in one thread hop."""

    def complete() -> ClaimEntry:  # in the checkpoint write's worker thread, PrepareStarted written
        s.report.step(Step.PREPARE_AFTER_PREPARE_STARTED, ref.uid)
        edits = [_run_plan(ref, device, plan) for device, plan in zip(entry.devices, plans, strict=True)]
        s.report.step(Step.PREPARE_AFTER_BACKEND_PREPARE, ref.uid)
        completed = _write_spec(s, ref, entry, edits)
        s.report.step(Step.PREPARE_AFTER_CDI_WRITE, ref.uid)
        return completed

    try:
        completed = await s.store.put_staged(entry, complete)
    except CheckpointWriteError as error:
        await rollback(s, ref, entry)
        raise ClaimFailure(f"prepare claim {claim_key(ref)}: {error}", "checkpoint") from error
    except BaseException:
        await rollback(s, ref, entry)
        raise
    s.report.step(Step.PREPARE_AFTER_PREPARE_COMPLETED, ref.uid)
    return completed


def _plans(s: DriverState, ref: ClaimRef, devices: Sequence[CheckpointDevice]) -> list[PreparePlan] | None:
    """The backend's blocking prepare of every device (`PlansPrepare`), or None: the async path.

    Only exclusive devices without configuration and without another claim on them: shares
    and their set-up go through the backend's own calls, and their conflict checks with it.
    """
    if s.planner is None or not all(s.exclusive(ref, d) for d in devices):
        return None
    plans = []
    for device in devices:
        try:
            plan = s.planner.plan_prepare(device.device, ref)
        except Exception as error:
            raise _backend_failure(ref, device, error) from error
        if plan is None:
            return None
        plans.append(plan)
    return plans


def _run_plan(ref: ClaimRef, device: CheckpointDevice, plan: PreparePlan) -> ContainerEdits:
    try:
        return plan()
    except Exception as error:
        raise _backend_failure(ref, device, error) from error


async def refresh(s: DriverState, ref: ClaimRef, entry: ClaimEntry) -> ClaimEntry:
    """Redo a completed claim's backend prepare (idempotent) and spec; raises `ClaimFailure`."""
    edits = await _backend_prepare(s, ref, entry.devices)
    completed = await anyio.to_thread.run_sync(_write_spec, s, ref, entry, edits)
    if completed != entry:
        try:
            await s.store.put(completed)
        except CheckpointWriteError as error:
            raise ClaimFailure(f"prepare claim {claim_key(ref)}: {error}", "checkpoint") from error
    s.released.discard(ref.uid)
    return completed


async def _backend_prepare(
    s: DriverState, ref: ClaimRef, devices: Sequence[CheckpointDevice]
) -> list[ContainerEdits]:
    edits: list[ContainerEdits] = []
    for index, device in enumerate(devices):
        try:
            if s.sharing is not None:
                async with s.device_lock(device.device):
                    edits.append(
                        await s.sharing.prepare_share(share(ref, device), s.peers(ref, devices, index))
                    )
            else:
                edits.append(await s.backend.prepare(device.device, ref))
        except Exception as error:
            raise _backend_failure(ref, device, error) from error
    return edits


def _completed(
    driver: str, ref: ClaimRef, entry: ClaimEntry, edits: Sequence[ContainerEdits]
) -> tuple[ClaimEntry, list[CdiDevice], dict[str, Any]]:
    """The completed entry (with CDI IDs), the devices of its CDI spec and the record the spec carries."""
    cdi_devices = [
        CdiDevice(cdi_device_name(ref.uid, d.device, d.share_id), e)
        for d, e in zip(entry.devices, edits, strict=True)
    ]
    completed = replace(
        entry,
        phase=ClaimPhase.COMPLETED,
        devices=tuple(
            replace(d, cdi_device_ids=(qualified_device_id(driver, c.name), *e.cdi_device_ids))
            for d, c, e in zip(entry.devices, cdi_devices, edits, strict=True)
        ),
    )
    return completed, cdi_devices, {"uid": ref.uid, **entry_json(completed)}


def _backend_failure(ref: ClaimRef, device: CheckpointDevice, error: Exception) -> ClaimFailure:
    """The claim failure of a backend's prepare of `device` that raised `error`."""
    if isinstance(error, DeviceConfigError | ShareConflictError):
        reason = "config" if isinstance(error, DeviceConfigError) else "share_conflict"
        return ClaimFailure(str(error), reason)
    if isinstance(error, DeviceNotFoundError):
        return ClaimFailure(
            f"prepare claim {claim_key(ref)}: unknown device {device.device!r}: {error}", "unknown_device"
        )
    return ClaimFailure(
        f"prepare device {device.device!r} of claim {claim_key(ref)}: backend failed: {error!r}", "backend"
    )


def _write_spec(
    s: DriverState, ref: ClaimRef, entry: ClaimEntry, edits: Sequence[ContainerEdits]
) -> ClaimEntry:
    """Write the claim's CDI spec (blocking), recording in it the completed entry returned."""
    completed, cdi_devices, record = _completed(s.driver, ref, entry, edits)
    try:
        s.cdi.write_claim_spec(ref.uid, cdi_devices, record)
    except OSError as error:
        raise _spec_failure(s, ref, error) from error
    return completed


def _spec_failure(s: DriverState, ref: ClaimRef, error: OSError) -> ClaimFailure:
    return ClaimFailure(
        f"prepare claim {claim_key(ref)}: cannot write CDI spec {s.cdi.spec_path(ref.uid)}: "
        f"{error.strerror or error}; check free space and permissions of the CDI root",
        "cdi",
    )


def _result(entry: ClaimEntry) -> PrepareResult:
    return PrepareResult(
        devices=tuple(
            PreparedDevice(
                requests=d.requests,
                pool=d.pool,
                device=d.device,
                cdi_device_ids=d.cdi_device_ids,
                share_id=d.share_id,
            )
            for d in entry.devices
        )
    )
