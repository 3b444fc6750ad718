"""`DriverState`: the one object holding a driver's claim state (backend, claim source, CDI writer,
checkpoint store, locks, reporter), which the paths receive, and the helpers every path shares."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from agent.claims.cdi import CdiSpecWriter
from agent.claims.checkpoint.format import CheckpointDevice
from agent.claims.checkpoint.store import CheckpointStore, CheckpointWriteError
from agent.claims.filelock import FileLock
from agent.claims.preparer import ClaimSource
from agent.claims.state.report import Reporter
from agent.core.backend import Backend, ClaimRef, PlansPrepare
from agent.core.clock import Clock
from agent.core.logs import log_fields
from agent.core.quantity import Quantity
from agent.core.sharing import DeviceShare, SharingBackend

log = logging.getLogger("agent.claims.state")


class ClaimFailure(Exception):
    """A per-claim failure: `str()` is the message for the kubelet, `reason` labels the metric."""

    def __init__(self, message: str, reason: str) -> None:
        self.reason = reason
        super().__init__(message)


@dataclass(eq=False)
class DriverState:
    """The claim state of one driver on this node, shared by the prepare, unprepare and start-up paths."""

    driver: str
    backend: Backend
    claims: ClaimSource
    node_name: str
    cdi: CdiSpecWriter
    store: CheckpointStore
    state_dir: Path
    clock: Clock
    report: Reporter
    file_lock: FileLock | None = None
    released: set[str] = field(default_factory=set)
    """Claims whose unprepare released the backend but could not drop the entry."""

    def __post_init__(self) -> None:
        # A runtime Protocol check costs ~25 us: once here instead of per device and call.
        self.sharing = self.backend if isinstance(self.backend, SharingBackend) else None
        self.planner = self.backend if isinstance(self.backend, PlansPrepare) else None
        # fast_acquire: an uncontended lock is taken without a trip through the event loop
        # (each such trip was a full loop iteration, several per claim).
        self._hold_lock = anyio.Lock(fast_acquire=True)
        self._holders = 0
        self._claim_locks: dict[str, tuple[anyio.Lock, int]] = {}
        self._device_locks: dict[str, anyio.Lock] = {}
        """Shares of one device are set up and torn down one at a time (first/last user)."""

    @asynccontextmanager
    async def serialized(self, *, reload: bool = True) -> AsyncIterator[None]:
        """The cross-process file lock (rolling updates), when configured.

        Two agent pods share the checkpoint during a rolling update, so whoever takes the lock
        first reloads the entries the other one may have written since (unless the file is still
        the one this process wrote last). The calls of this process share one hold of the lock:
        among themselves they are ordered by the claim locks and the group commit, as without
        the file lock, so a burst takes it once instead of queueing call after call behind it.
        """
        if self.file_lock is None:
            yield
            return
        async with self._hold_lock:  # orders the taking and the reload, not the calls
            if self._holders == 0:
                await self.file_lock.acquire()
                try:
                    if reload:
                        await self._reload_checkpoint()
                except BaseException:
                    self.file_lock.release()
                    raise
            self._holders += 1
        try:
            yield
        finally:
            self._holders -= 1
            if self._holders == 0:
                self.file_lock.release()

    async def _reload_checkpoint(self) -> None:
        if self.store.is_current():
            return  # nobody wrote since we last wrote or read it: memory holds what the file holds
        outcome = await self.store.reload(self.clock.time())
        if outcome.problem is not None:
            # Keep the entries in memory: they are the best record left; the next write restores the file.
            await self.report.recovery(
                outcome.problem.reason, str(outcome.problem), outcome.moved_to, rebuilt="from memory"
            )
            try:
                await self.store.flush()
            except CheckpointWriteError as error:
                log.error("cannot rewrite the checkpoint", extra=log_fields(error=str(error)))

    @asynccontextmanager
    async def claim_lock(self, uid: str) -> AsyncIterator[None]:
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

    @asynccontextmanager
    async def device_lock(self, device: str) -> AsyncIterator[None]:
        lock = self._device_locks.get(device)
        if lock is None:
            lock = self._device_locks[device] = anyio.Lock(fast_acquire=True)
        async with lock:
            yield

    def exclusive(self, ref: ClaimRef, device: CheckpointDevice) -> bool:
        """Whether `device` is `ref`'s alone: no share, no configuration, no other claim on it."""
        if device.share_id is not None or device.config is not None or device.consumed:
            return False
        return all(e.uid == ref.uid for e in self.store.holders(device.device))

    def peers(self, ref: ClaimRef, devices: Sequence[CheckpointDevice], index: int) -> list[DeviceShare]:
        """The other shares of ``devices[index]``'s device: other claims' and this claim's earlier ones.

        Derived from the checkpoint, so reference counting needs no counter of its own and
        survives a restart: a device is set up for its first share and torn down after its last.
        """
        name = devices[index].device
        peers = [
            share(ClaimRef(e.namespace, e.name, e.uid), d)
            for e in self.store.holders(name)
            if e.uid != ref.uid
            for d in e.devices
            if d.device == name
        ]
        return peers + [share(ref, d) for d in devices[:index] if d.device == name]


def share(ref: ClaimRef, device: CheckpointDevice) -> DeviceShare:
    """The share of a sharing backend that `device` of claim `ref` is."""
    return DeviceShare(
        device=device.device,
        claim=ref,
        share_id=device.share_id,
        consumed={name: Quantity.parse(value) for name, value in device.consumed},
        config=device.config,
    )


async def each(run: Callable[[ClaimRef], Coroutine[Any, Any, None]], refs: Sequence[ClaimRef]) -> None:
    """`run` for every claim, concurrently; a single claim (the kubelet's usual call) without a task group."""
    if len(refs) == 1:
        await run(refs[0])  # a task group and its task cost ~35 us, three times per prepare + unprepare
        return
    async with anyio.create_task_group() as tg:
        for ref in refs:
            tg.start_soon(run, ref)
