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
"""

from __future__ import annotations

import enum
import logging
from collections.abc import AsyncIterator, Callable, Collection, Coroutine, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import anyio
import anyio.to_thread

from agent.claims.cdi import CdiDevice, CdiSpecWriter, cdi_device_name, qualified_device_id
from agent.claims.checkpoint import (
    BOOT_ID_PATH,
    CHECKPOINT_FILE,
    CheckpointDevice,
    CheckpointStore,
    CheckpointWriteError,
    ClaimEntry,
    ClaimPhase,
    PeerWatch,
    entry_json,
    load_checkpoint,
    read_boot_id,
    remove_temp_files,
)
from agent.claims.filelock import FileLock
from agent.claims.preparer import ClaimSource, PreparedDevice, PrepareResult
from agent.claims.reader import (
    ClaimAllocationError,
    check_claim,
    claim_key,
    parse_allocation,
    parse_device_configs,
)
from agent.claims.recovery import rebuild_from_specs
from agent.core.backend import Backend, ClaimRef, ContainerEdits, PlansPrepare, PreparePlan, UnpreparePlan
from agent.core.clock import Clock, SystemClock
from agent.core.errors import ClaimRequestError, DeviceNotFoundError, KubeApiError
from agent.core.logs import log_fields
from agent.core.quantity import Quantity
from agent.core.sharing import (
    DeviceConfigError,
    DeviceShare,
    ShareConflictError,
    SharingBackend,
    select_config,
)
from agent.observe.metrics import Children, Metrics

log = logging.getLogger("agent.claims.state")

ROLLBACK_TIMEOUT = 30.0
"""Rollback runs shielded from cancellation, but not forever."""
RECONCILE_CONCURRENCY = 16
"""Claim GETs in flight at once while reconciling at start (spares the API server)."""


class Step(enum.Enum):
    """Points of prepare/unprepare where a test hook may stop the process (crash tests)."""

    PREPARE_BEFORE_CHECKPOINT_START = "prepare-before-checkpoint-start"
    PREPARE_AFTER_PREPARE_STARTED = "prepare-after-prepare-started"
    PREPARE_AFTER_BACKEND_PREPARE = "prepare-after-backend-prepare"
    PREPARE_AFTER_CDI_WRITE = "prepare-after-cdi-write"
    PREPARE_AFTER_PREPARE_COMPLETED = "prepare-after-prepare-completed"
    UNPREPARE_BEFORE_BACKEND_UNPREPARE = "unprepare-before-backend-unprepare"
    UNPREPARE_AFTER_BACKEND_UNPREPARE = "unprepare-after-backend-unprepare"
    UNPREPARE_AFTER_CHECKPOINT_REMOVE = "unprepare-after-checkpoint-remove"
    UNPREPARE_AFTER_CDI_REMOVE = "unprepare-after-cdi-remove"


class StepHook(Protocol):
    """Test-only: called at every `Step` (a crash test kills the process there)."""

    def reached(self, step: Step, claim_uid: str) -> None: ...


class EventRecorder(Protocol):
    """Records a Kubernetes Event about the agent (reason, message, ``Normal``/``Warning``)."""

    async def record(self, reason: str, message: str, type: str) -> object: ...


class PreparedListener(Protocol):
    """Told which claims changed: after the start-up load (every prepared claim), then when the
    calls in flight end (the claims they prepared or unprepared)."""

    def prepared_changed(
        self,
        driver: str,
        prepared: Mapping[ClaimRef, tuple[str, ...]],
        unprepared: Collection[ClaimRef],
    ) -> None:
        """`prepared`: claims now prepared, new or with other devices (claim -> device names);
        `unprepared`: claims no longer prepared. Claims not named did not change."""
        ...

    def claims_read(self, claims: Mapping[ClaimRef, Mapping[str, Any]]) -> None:
        """The API objects of the claims a prepare just prepared, told right before `prepared_changed`."""
        ...


class _ClaimFailure(Exception):
    """A per-claim failure: `str()` is the message for the kubelet, `reason` labels the metric."""

    def __init__(self, message: str, reason: str) -> None:
        self.reason = reason
        super().__init__(message)


@dataclass(frozen=True)
class _Lookup:
    """What the API server said about a checkpointed claim at start."""

    exists: bool | None
    """True: the same claim exists; False: deleted or replaced; None: unknown (API unreachable)."""


def _share(ref: ClaimRef, device: CheckpointDevice) -> DeviceShare:
    return DeviceShare(
        device=device.device,
        claim=ref,
        share_id=device.share_id,
        consumed={name: Quantity.parse(value) for name, value in device.consumed},
        config=device.config,
    )


def _api_error_code(error: Exception) -> str:
    status = getattr(error, "status", 0)
    if status == 404:
        return "NOT_FOUND"
    if status == 403:
        return "PERMISSION_DENIED"
    if status in (0, 429) or status >= 500:
        return "UNAVAILABLE"
    return "FAILED_PRECONDITION"


async def _each(run: Callable[[ClaimRef], Coroutine[Any, Any, None]], refs: Sequence[ClaimRef]) -> None:
    """`run` for every claim, concurrently; a single claim (the kubelet's usual call) without a task group."""
    if len(refs) == 1:
        await run(refs[0])  # a task group and its task cost ~35 us, three times per prepare + unprepare
        return
    async with anyio.create_task_group() as tg:
        for ref in refs:
            tg.start_soon(run, ref)


class DeviceState:
    """Prepares and unprepares claims of one driver on this node (a `ClaimPreparer`)."""

    def __init__(
        self,
        driver: str,
        backend: Backend,
        claims: ClaimSource,
        *,
        node_name: str,
        cdi_root: Path,
        state_dir: Path,
        metrics: Metrics | None = None,
        events: EventRecorder | None = None,
        lock_path: Path | None = None,
        clock: Clock | None = None,
        boot_id: str | None = None,
        boot_id_path: Path = BOOT_ID_PATH,
        hooks: StepHook | None = None,
        listener: PreparedListener | None = None,
        peers: Callable[[], bool] | None = None,
    ) -> None:
        self.driver = driver
        self.backend = backend
        # A runtime Protocol check costs ~25 us: once here instead of per device and call.
        self._sharing = backend if isinstance(backend, SharingBackend) else None
        self._planner = backend if isinstance(backend, PlansPrepare) else None
        self.claims = claims
        self.node_name = node_name
        self.cdi = CdiSpecWriter(cdi_root, driver)
        self.state_dir = state_dir
        self.metrics = metrics
        self._child = Children()
        self.events = events
        self.clock = clock or SystemClock()
        self.hooks = hooks
        self.listener = listener
        self._boot_id = boot_id if boot_id is not None else read_boot_id(boot_id_path)
        # `peers` (blocking): whether another agent pod serves this driver now (rolling update).
        watch = PeerWatch(peers) if peers is not None else None
        self.store = CheckpointStore(state_dir / CHECKPOINT_FILE, self._boot_id, peers=watch)
        self._file_lock = FileLock(lock_path, clock=self.clock) if lock_path is not None else None
        # fast_acquire: an uncontended lock is taken without a trip through the event loop
        # (each such trip was a full loop iteration, several per claim).
        self._hold_lock = anyio.Lock(fast_acquire=True)
        self._holders = 0
        self._claim_locks: dict[str, tuple[anyio.Lock, int]] = {}
        self._calls = 0
        self._device_locks: dict[str, anyio.Lock] = {}
        """Shares of one device are set up and torn down one at a time (first/last user)."""
        self._released: set[str] = set()
        """Claims whose unprepare released the backend but could not drop the entry."""
        self._told: dict[str, tuple[ClaimRef, tuple[str, ...]]] = {}
        """The prepared claims as the gauges and the listener were last told (UID -> claim, devices)."""
        self._told_devices = 0

    # ----------------------------------------------------------------- public interface

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

    # ----------------------------------------------------------------- prepare

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

    def _exclusive(self, ref: ClaimRef, device: CheckpointDevice) -> bool:
        if device.share_id is not None or device.config is not None or device.consumed:
            return False
        return all(e.uid == ref.uid for e in self.store.holders(device.device))

    def _run_plan(self, ref: ClaimRef, device: CheckpointDevice, plan: PreparePlan) -> ContainerEdits:
        try:
            return plan()
        except Exception as error:
            raise self._backend_failure(ref, device, error) from error

    def _backend_failure(self, ref: ClaimRef, device: CheckpointDevice, error: Exception) -> _ClaimFailure:
        """The claim failure of a backend's prepare of `device` that raised `error`."""
        if isinstance(error, DeviceConfigError | ShareConflictError):
            reason = "config" if isinstance(error, DeviceConfigError) else "share_conflict"
            return _ClaimFailure(str(error), reason)
        if isinstance(error, DeviceNotFoundError):
            return _ClaimFailure(
                f"prepare claim {claim_key(ref)}: unknown device {device.device!r}: {error}", "unknown_device"
            )
        return _ClaimFailure(
            f"prepare device {device.device!r} of claim {claim_key(ref)}: backend failed: {error!r}",
            "backend",
        )

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

    def _completed(
        self, ref: ClaimRef, entry: ClaimEntry, edits: Sequence[ContainerEdits]
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
                replace(d, cdi_device_ids=(qualified_device_id(self.driver, c.name), *e.cdi_device_ids))
                for d, c, e in zip(entry.devices, cdi_devices, edits, strict=True)
            ),
        )
        return completed, cdi_devices, {"uid": ref.uid, **entry_json(completed)}

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

    def _spec_failure(self, ref: ClaimRef, error: OSError) -> _ClaimFailure:
        return _ClaimFailure(
            f"prepare claim {claim_key(ref)}: cannot write CDI spec {self.cdi.spec_path(ref.uid)}: "
            f"{error.strerror or error}; check free space and permissions of the CDI root",
            "cdi",
        )

    async def _rollback(self, ref: ClaimRef, entry: ClaimEntry) -> None:
        """Undo a partial prepare: backend, CDI spec, checkpoint entry (best effort, shielded)."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(ROLLBACK_TIMEOUT):
            await self._undo(ref, entry, reason="rollback")

    async def _undo(self, ref: ClaimRef, entry: ClaimEntry, *, reason: str) -> bool:
        """Unprepare devices, remove spec and entry, logging failures; True when all of it worked."""
        clean = True
        for index in reversed(range(len(entry.devices))):
            device = entry.devices[index]
            try:
                await self._backend_unprepare(ref, entry, index)
            except Exception as error:
                clean = False
                log.error(
                    "backend unprepare failed",
                    extra=log_fields(uid=ref.uid, device=device.device, during=reason, error=repr(error)),
                )
        try:
            await anyio.to_thread.run_sync(self.cdi.remove_claim_spec, ref.uid)
        except OSError as error:
            clean = False
            log.error(
                "cannot remove CDI spec", extra=log_fields(uid=ref.uid, during=reason, error=str(error))
            )
        if clean:
            try:
                await self.store.remove(ref.uid)
            except CheckpointWriteError as error:
                clean = False
                log.error("cannot drop checkpoint entry", extra=log_fields(uid=ref.uid, error=str(error)))
        return clean

    async def _backend_unprepare(self, ref: ClaimRef, entry: ClaimEntry, index: int) -> None:
        """Unprepare device `index` of `entry` (devices go in reverse order, so earlier ones are peers)."""
        device = entry.devices[index]
        if self._sharing is None:
            await self.backend.unprepare(device.device, ref)
            return
        async with self._device_lock(device.device):
            await self._sharing.unprepare_share(_share(ref, device), self._peers(ref, entry.devices, index))

    def _peers(self, ref: ClaimRef, devices: Sequence[CheckpointDevice], index: int) -> list[DeviceShare]:
        """The other shares of ``devices[index]``'s device: other claims' and this claim's earlier ones.

        Derived from the checkpoint, so reference counting needs no counter of its own and
        survives a restart: a device is set up for its first share and torn down after its last.
        """
        name = devices[index].device
        peers = [
            _share(ClaimRef(e.namespace, e.name, e.uid), d)
            for e in self.store.holders(name)
            if e.uid != ref.uid
            for d in e.devices
            if d.device == name
        ]
        return peers + [_share(ref, d) for d in devices[:index] if d.device == name]

    @asynccontextmanager
    async def _device_lock(self, device: str) -> AsyncIterator[None]:
        lock = self._device_locks.get(device)
        if lock is None:
            lock = self._device_locks[device] = anyio.Lock(fast_acquire=True)
        async with lock:
            yield

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

    def _result(self, entry: ClaimEntry) -> PrepareResult:
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

    # ----------------------------------------------------------------- unprepare

    async def _unprepare_one(self, ref: ClaimRef, results: dict[str, str]) -> None:
        started = self.clock.monotonic()
        try:
            await self._unprepare_claim(ref)
            results[ref.uid] = ""
            self._count("unprepare", "success")
        except _ClaimFailure as failure:
            results[ref.uid] = str(failure)
            self._count("unprepare", "error", failure.reason)
            log.warning(
                "claim unpreparation failed",
                extra=log_fields(driver=self.driver, claim=claim_key(ref), uid=ref.uid, error=str(failure)),
            )
        except Exception as error:
            log.exception("claim unpreparation failed unexpectedly", extra=log_fields(uid=ref.uid))
            results[ref.uid] = f"internal error unpreparing {claim_key(ref)}: {error!r}"
            self._count("unprepare", "error", "internal")
        finally:
            if self.metrics is not None:
                self._child(self.metrics.claim_latency, self.driver, "unprepare").observe(
                    self.clock.monotonic() - started
                )

    async def _unprepare_claim(self, ref: ClaimRef) -> None:
        async with self._claim_lock(ref.uid):
            entry = self.store.get(ref.uid)
            if entry is None:
                # Unknown claim: success. A spec without an entry should not exist; remove it anyway.
                try:
                    await anyio.to_thread.run_sync(self.cdi.remove_claim_spec, ref.uid)
                except OSError as error:
                    raise _ClaimFailure(f"unprepare claim {claim_key(ref)}: {error}", "cdi") from error
                return
            owner = ClaimRef(entry.namespace, entry.name, entry.uid)
            self._step(Step.UNPREPARE_BEFORE_BACKEND_UNPREPARE, ref.uid)
            plans = self._unprepare_plans(owner, entry)
            release = None
            if plans is None:
                for index in reversed(range(len(entry.devices))):
                    try:
                        await self._backend_unprepare(owner, entry, index)
                    except Exception as error:
                        # Keep the entry: the kubelet retries unprepare and we redo it.
                        raise self._unprepare_failure(ref, entry.devices[index], error) from error
                self._step(Step.UNPREPARE_AFTER_BACKEND_UNPREPARE, ref.uid)
            else:

                def release() -> None:  # in the checkpoint write's worker thread, before the entry is dropped
                    for device, plan in reversed(list(zip(entry.devices, plans, strict=True))):
                        try:
                            plan()
                        except Exception as error:
                            raise self._unprepare_failure(ref, device, error) from error
                    self._step(Step.UNPREPARE_AFTER_BACKEND_UNPREPARE, ref.uid)

            def remove_spec() -> None:  # in the checkpoint write's worker thread, once it is durable
                self._step(Step.UNPREPARE_AFTER_CHECKPOINT_REMOVE, ref.uid)
                self.cdi.remove_claim_spec(ref.uid)
                self._step(Step.UNPREPARE_AFTER_CDI_REMOVE, ref.uid)

            try:
                await self.store.remove(ref.uid, before=release, after=remove_spec)
            except CheckpointWriteError as error:
                # The entry and its spec stay (the kubelet retries); a prepare meanwhile redoes the backend.
                self._released.add(ref.uid)
                raise _ClaimFailure(f"unprepare claim {claim_key(ref)}: {error}", "checkpoint") from error
            except OSError as error:
                # No entry owns the spec now: the kubelet's retry (an unknown claim) removes it.
                self._released.discard(ref.uid)
                raise _ClaimFailure(
                    f"unprepare claim {claim_key(ref)}: cannot remove CDI spec: {error.strerror or error}",
                    "cdi",
                ) from error
            self._released.discard(ref.uid)

    def _unprepare_plans(self, ref: ClaimRef, entry: ClaimEntry) -> list[UnpreparePlan] | None:
        """The backend's blocking unprepare of every device (`PlansPrepare`), or None: the async path."""
        if self._planner is None or not all(self._exclusive(ref, d) for d in entry.devices):
            return None
        plans = []
        for device in entry.devices:
            plan = self._planner.plan_unprepare(device.device, ref)
            if plan is None:
                return None
            plans.append(plan)
        return plans

    def _unprepare_failure(self, ref: ClaimRef, device: CheckpointDevice, error: Exception) -> _ClaimFailure:
        return _ClaimFailure(
            f"unprepare device {device.device!r} of claim {claim_key(ref)}: {error}", "backend"
        )

    # ----------------------------------------------------------------- start-up reconcile

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

    async def _report_recovery(
        self, reason: str, problem: str, moved_to: Path | None, *, rebuilt: str
    ) -> None:
        kept = "kept" if moved_to is None else f"moved aside to {moved_to}"
        message = f"checkpoint {self.store.path} was unusable ({problem}); {kept} and rebuilt {rebuilt}"
        log.error("checkpoint recovered", extra=log_fields(driver=self.driver, reason=reason, detail=message))
        if self.metrics is not None:
            self.metrics.checkpoint_recoveries.labels(reason).inc()
        if self.events is not None:
            try:
                await self.events.record("CheckpointRecovered", message, "Warning")
            except Exception as error:  # an Event is a courtesy; never fail start over it
                log.warning("cannot record event", extra=log_fields(error=repr(error)))

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

    # ----------------------------------------------------------------- helpers

    @asynccontextmanager
    async def _serialized(self, *, reload: bool = True) -> AsyncIterator[None]:
        """The cross-process file lock (rolling updates), when configured.

        Two agent pods share the checkpoint during a rolling update, so whoever takes the lock
        first reloads the entries the other one may have written since (unless the file is still
        the one this process wrote last). The calls of this process share one hold of the lock:
        among themselves they are ordered by the claim locks and the group commit, as without
        the file lock, so a burst takes it once instead of queueing call after call behind it.
        """
        if self._file_lock is None:
            yield
            return
        async with self._hold_lock:  # orders the taking and the reload, not the calls
            if self._holders == 0:
                await self._file_lock.acquire()
                try:
                    if reload:
                        await self._reload_checkpoint()
                except BaseException:
                    self._file_lock.release()
                    raise
            self._holders += 1
        try:
            yield
        finally:
            self._holders -= 1
            if self._holders == 0:
                self._file_lock.release()

    async def _reload_checkpoint(self) -> None:
        if self.store.is_current():
            return  # nobody wrote since we last wrote or read it: memory holds what the file holds
        outcome = await self.store.reload(self.clock.time())
        if outcome.problem is not None:
            # Keep the entries in memory: they are the best record left; the next write restores the file.
            await self._report_recovery(
                outcome.problem.reason, str(outcome.problem), outcome.moved_to, rebuilt="from memory"
            )
            try:
                await self.store.flush()
            except CheckpointWriteError as error:
                log.error("cannot rewrite the checkpoint", extra=log_fields(error=str(error)))

    @asynccontextmanager
    async def _claim_lock(self, uid: str) -> AsyncIterator[None]:
        """One lock per claim UID, dropped when nobody holds or waits for it."""
        lock, users = self._claim_locks.get(uid) or (anyio.Lock(fast_acquire=True), 0)
        self._claim_locks[uid] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._claim_locks[uid]
            if users == 1:
                del self._claim_locks[uid]
            else:
                self._claim_locks[uid] = (lock, users - 1)

    @contextmanager
    def _counted_call(self) -> Iterator[None]:
        """Gauges and the listener are updated when the last call in flight ends, not per call:
        a burst of 100 concurrent calls tells the listener once, what all of them changed."""
        self._calls += 1
        try:
            yield
        finally:
            self._calls -= 1
            if self._calls == 0:
                self._update_gauges()

    def _step(self, step: Step, uid: str) -> None:
        if self.hooks is not None:
            self.hooks.reached(step, uid)

    def _count(self, operation: str, result: str, reason: str = "") -> None:
        if self.metrics is None:
            return
        self._child(self.metrics.claim_operations, self.driver, operation, result).inc()
        if reason:
            self._child(self.metrics.claim_errors, self.driver, operation, reason).inc()

    def _update_gauges(self) -> None:
        """Tell the gauges and the listener what the entries changed since last time.

        Only the entries changed meanwhile are looked at (`CheckpointStore.take_touched`): the
        cost of a call does not grow with the claims prepared on the node (with 200 of them,
        going over all of them cost a prepare ~2 ms).
        """
        prepared: dict[ClaimRef, tuple[str, ...]] = {}
        unprepared: list[ClaimRef] = []
        for uid in self.store.take_touched():
            entry = self.store.get(uid)
            now = None
            if entry is not None and entry.phase is ClaimPhase.COMPLETED:
                now = (ClaimRef(entry.namespace, entry.name, uid), tuple(d.device for d in entry.devices))
            before = self._told.get(uid)
            if now == before:
                continue  # changed and changed back (a rollback), or a step before completion
            if before is not None:
                del self._told[uid]
                self._told_devices -= len(before[1])
                if now is None or now[0] != before[0]:
                    unprepared.append(before[0])
            if now is not None:
                self._told[uid] = now
                self._told_devices += len(now[1])
                prepared[now[0]] = now[1]
        if self.metrics is not None:
            self._child(self.metrics.prepared_claims, self.driver).set(len(self._told))
            self._child(self.metrics.prepared_devices, self.driver).set(self._told_devices)
        if self.listener is None or not (prepared or unprepared):
            return
        try:
            self.listener.prepared_changed(self.driver, prepared, unprepared)
        except Exception as error:  # metrics must never fail a prepare
            log.warning("prepared-claims listener failed", extra=log_fields(error=repr(error)))
