"""Unprepare: the kubelet's unprepare of a claim, and the undo of a partial prepare (rollback).

Devices are released in reverse order; with a planning backend (`PlansPrepare`) the release runs
in the worker thread of the checkpoint write that drops the entry, and the spec goes once it is durable.
"""

from __future__ import annotations

import logging

import anyio
import anyio.to_thread

from agent.claims.checkpoint.format import CheckpointDevice, ClaimEntry
from agent.claims.checkpoint.store import CheckpointWriteError
from agent.claims.reader import claim_key
from agent.claims.state.driver import ClaimFailure, DriverState, share
from agent.claims.state.hooks import Step
from agent.core.backend import ClaimRef, UnpreparePlan
from agent.core.logs import log_fields

log = logging.getLogger("agent.claims.state")


ROLLBACK_TIMEOUT = 30.0
"""Rollback runs shielded from cancellation, but not forever."""


async def rollback(s: DriverState, ref: ClaimRef, entry: ClaimEntry) -> None:
    """Undo a partial prepare: backend, CDI spec, checkpoint entry (best effort, shielded)."""
    with anyio.CancelScope(shield=True), anyio.move_on_after(ROLLBACK_TIMEOUT):
        await undo(s, ref, entry, reason="rollback")


async def undo(s: DriverState, ref: ClaimRef, entry: ClaimEntry, *, reason: str) -> bool:
    """Unprepare devices, remove spec and entry, logging failures; True when all of it worked."""
    clean = True
    for index in reversed(range(len(entry.devices))):
        device = entry.devices[index]
        try:
            await _backend_unprepare(s, ref, entry, index)
        except Exception as error:
            clean = False
            log.error(
                "backend unprepare failed",
                extra=log_fields(uid=ref.uid, device=device.device, during=reason, error=repr(error)),
            )
    try:
        await anyio.to_thread.run_sync(s.cdi.remove_claim_spec, ref.uid)
    except OSError as error:
        clean = False
        log.error("cannot remove CDI spec", extra=log_fields(uid=ref.uid, during=reason, error=str(error)))
    if clean:
        try:
            await s.store.remove(ref.uid)
        except CheckpointWriteError as error:
            clean = False
            log.error("cannot drop checkpoint entry", extra=log_fields(uid=ref.uid, error=str(error)))
    return clean


async def _backend_unprepare(s: DriverState, ref: ClaimRef, entry: ClaimEntry, index: int) -> None:
    """Unprepare device `index` of `entry` (devices go in reverse order, so earlier ones are peers)."""
    device = entry.devices[index]
    if s.sharing is None:
        await s.backend.unprepare(device.device, ref)
        return
    async with s.device_lock(device.device):
        await s.sharing.unprepare_share(share(ref, device), s.peers(ref, entry.devices, index))


async def unprepare_one(s: DriverState, ref: ClaimRef, results: dict[str, str]) -> None:
    """Unprepare one claim of a call into `results` (UID -> error, ``""`` for success)."""
    started = s.clock.monotonic()
    try:
        await _unprepare_claim(s, ref)
        results[ref.uid] = ""
        s.report.count("unprepare", "success")
    except ClaimFailure as failure:
        results[ref.uid] = str(failure)
        s.report.count("unprepare", "error", failure.reason)
        log.warning(
            "claim unpreparation failed",
            extra=log_fields(driver=s.driver, claim=claim_key(ref), uid=ref.uid, error=str(failure)),
        )
    except Exception as error:
        log.exception("claim unpreparation failed unexpectedly", extra=log_fields(uid=ref.uid))
        results[ref.uid] = f"internal error unpreparing {claim_key(ref)}: {error!r}"
        s.report.count("unprepare", "error", "internal")
    finally:
        s.report.latency("unprepare", started)


async def _unprepare_claim(s: DriverState, ref: ClaimRef) -> None:
    async with s.claim_lock(ref.uid):
        entry = s.store.get(ref.uid)
        if entry is None:
            # Unknown claim: success. A spec without an entry should not exist; remove it anyway.
            try:
                await anyio.to_thread.run_sync(s.cdi.remove_claim_spec, ref.uid)
            except OSError as error:
                raise ClaimFailure(f"unprepare claim {claim_key(ref)}: {error}", "cdi") from error
            return
        owner = ClaimRef(entry.namespace, entry.name, entry.uid)
        s.report.step(Step.UNPREPARE_BEFORE_BACKEND_UNPREPARE, ref.uid)
        plans = _unprepare_plans(s, owner, entry)
        release = None
        if plans is None:
            for index in reversed(range(len(entry.devices))):
                try:
                    await _backend_unprepare(s, owner, entry, index)
                except Exception as error:
                    # Keep the entry: the kubelet retries unprepare and we redo it.
                    raise _unprepare_failure(ref, entry.devices[index], error) from error
            s.report.step(Step.UNPREPARE_AFTER_BACKEND_UNPREPARE, ref.uid)
        else:

            def release() -> None:  # in the checkpoint write's worker thread, before the entry is dropped
                for device, plan in reversed(list(zip(entry.devices, plans, strict=True))):
                    try:
                        plan()
                    except Exception as error:
                        raise _unprepare_failure(ref, device, error) from error
                s.report.step(Step.UNPREPARE_AFTER_BACKEND_UNPREPARE, ref.uid)

        def remove_spec() -> None:  # in the checkpoint write's worker thread, once it is durable
            s.report.step(Step.UNPREPARE_AFTER_CHECKPOINT_REMOVE, ref.uid)
            s.cdi.remove_claim_spec(ref.uid)
            s.report.step(Step.UNPREPARE_AFTER_CDI_REMOVE, ref.uid)

        try:
            await s.store.remove(ref.uid, before=release, after=remove_spec)
        except CheckpointWriteError as error:
            # The entry and its spec stay (the kubelet retries); a prepare meanwhile redoes the backend.
            s.released.add(ref.uid)
            raise ClaimFailure(f"unprepare claim {claim_key(ref)}: {error}", "checkpoint") from error
        except OSError as error:
            # No entry owns the spec now: the kubelet's retry (an unknown claim) removes it.
            s.released.discard(ref.uid)
            raise ClaimFailure(
                f"unprepare claim {claim_key(ref)}: cannot remove CDI spec: {error.strerror or error}",
                "cdi",
            ) from error
        s.released.discard(ref.uid)


def _unprepare_plans(s: DriverState, ref: ClaimRef, entry: ClaimEntry) -> list[UnpreparePlan] | None:
    """The backend's blocking unprepare of every device (`PlansPrepare`), or None: the async path."""
    if s.planner is None or not all(s.exclusive(ref, d) for d in entry.devices):
        return None
    plans = []
    for device in entry.devices:
        plan = s.planner.plan_unprepare(device.device, ref)
        if plan is None:
            return None
        plans.append(plan)
    return plans


def _unprepare_failure(ref: ClaimRef, device: CheckpointDevice, error: Exception) -> ClaimFailure:
    return ClaimFailure(f"unprepare device {device.device!r} of claim {claim_key(ref)}: {error}", "backend")
