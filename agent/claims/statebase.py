"""The claim state of one driver and what every path through it shares.

The construction of `agent.claims.state.DeviceState`, its locks (the cross-process file lock with
the checkpoint reload, one lock per claim and per device), the completed entry and the failures
both prepare paths build, the shares of a device, the recovery report, the step hooks, the metrics
and the prepared-claims listener.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from agent.claims.cdi import CdiDevice, CdiSpecWriter, cdi_device_name, qualified_device_id
from agent.claims.checkpoint import CHECKPOINT_FILE, CheckpointDevice, ClaimEntry, ClaimPhase, entry_json
from agent.claims.checkpointload import BOOT_ID_PATH, read_boot_id
from agent.claims.checkpointpeers import PeerWatch
from agent.claims.checkpointstore import CheckpointStore, CheckpointWriteError
from agent.claims.filelock import FileLock
from agent.claims.preparer import ClaimSource, PreparedDevice, PrepareResult
from agent.claims.reader import claim_key
from agent.claims.statehooks import EventRecorder, PreparedListener, Step, StepHook
from agent.core.backend import Backend, ClaimRef, ContainerEdits, PlansPrepare
from agent.core.clock import Clock, SystemClock
from agent.core.errors import DeviceNotFoundError
from agent.core.logs import log_fields
from agent.core.quantity import Quantity
from agent.core.sharing import DeviceConfigError, DeviceShare, ShareConflictError, SharingBackend
from agent.observe.metrics import Children, Metrics

log = logging.getLogger("agent.claims.state")


class _ClaimFailure(Exception):
    """A per-claim failure: `str()` is the message for the kubelet, `reason` labels the metric."""

    def __init__(self, message: str, reason: str) -> None:
        self.reason = reason
        super().__init__(message)


def _share(ref: ClaimRef, device: CheckpointDevice) -> DeviceShare:
    return DeviceShare(
        device=device.device,
        claim=ref,
        share_id=device.share_id,
        consumed={name: Quantity.parse(value) for name, value in device.consumed},
        config=device.config,
    )


async def _each(run: Callable[[ClaimRef], Coroutine[Any, Any, None]], refs: Sequence[ClaimRef]) -> None:
    """`run` for every claim, concurrently; a single claim (the kubelet's usual call) without a task group."""
    if len(refs) == 1:
        await run(refs[0])  # a task group and its task cost ~35 us, three times per prepare + unprepare
        return
    async with anyio.create_task_group() as tg:
        for ref in refs:
            tg.start_soon(run, ref)


class StateBase:
    """The state of `DeviceState` and the helpers its paths share (not used alone)."""

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

    def _exclusive(self, ref: ClaimRef, device: CheckpointDevice) -> bool:
        if device.share_id is not None or device.config is not None or device.consumed:
            return False
        return all(e.uid == ref.uid for e in self.store.holders(device.device))

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

    def _spec_failure(self, ref: ClaimRef, error: OSError) -> _ClaimFailure:
        return _ClaimFailure(
            f"prepare claim {claim_key(ref)}: cannot write CDI spec {self.cdi.spec_path(ref.uid)}: "
            f"{error.strerror or error}; check free space and permissions of the CDI root",
            "cdi",
        )

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
