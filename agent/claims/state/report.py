"""`Reporter`: what the claim paths tell outside them (metrics, Events, crash-test steps, the listener)."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.claims.checkpoint.format import ClaimPhase
from agent.claims.checkpoint.store import CheckpointStore
from agent.claims.state.hooks import EventRecorder, PreparedListener, Step, StepHook
from agent.core.backend import ClaimRef
from agent.core.clock import Clock
from agent.core.logs import log_fields
from agent.observe.metrics import Children, Metrics

log = logging.getLogger("agent.claims.state")


@dataclass(eq=False)
class Reporter:
    """Tells the metrics, Events, step hooks and the prepared-claims listener of one driver's claims."""

    driver: str
    store: CheckpointStore
    clock: Clock
    metrics: Metrics | None = None
    events: EventRecorder | None = None
    hooks: StepHook | None = None
    listener: PreparedListener | None = None

    def __post_init__(self) -> None:
        self._child = Children()
        self._calls = 0
        self._told: dict[str, tuple[ClaimRef, tuple[str, ...]]] = {}
        """The prepared claims as the gauges and the listener were last told (UID -> claim, devices)."""
        self._told_devices = 0

    def step(self, step: Step, uid: str) -> None:
        if self.hooks is not None:
            self.hooks.reached(step, uid)

    def count(self, operation: str, result: str, reason: str = "") -> None:
        if self.metrics is None:
            return
        self._child(self.metrics.claim_operations, self.driver, operation, result).inc()
        if reason:
            self._child(self.metrics.claim_errors, self.driver, operation, reason).inc()

    def latency(self, operation: str, started: float) -> None:
        """The latency of one claim's `operation` begun at `started` (the clock's monotonic time)."""
        if self.metrics is not None:
            self._child(self.metrics.claim_latency, self.driver, operation).observe(
                self.clock.monotonic() - started
            )

    async def event(self, reason: str, message: str) -> None:
        """A Warning Event about the agent; a courtesy, so a failure to record it is only logged."""
        if self.events is None:
            return
        try:
            await self.events.record(reason, message, "Warning")
        except Exception as error:
            log.warning("cannot record event", extra=log_fields(error=repr(error)))

    async def recovery(self, reason: str, problem: str, moved_to: Path | None, *, rebuilt: str) -> None:
        """An unusable checkpoint was recovered: logged, counted and told as an Event."""
        kept = "kept" if moved_to is None else f"moved aside to {moved_to}"
        message = f"checkpoint {self.store.path} was unusable ({problem}); {kept} and rebuilt {rebuilt}"
        log.error("checkpoint recovered", extra=log_fields(driver=self.driver, reason=reason, detail=message))
        if self.metrics is not None:
            self.metrics.checkpoint_recoveries.labels(reason).inc()
        await self.event("CheckpointRecovered", message)

    def claims_read(self, read: Mapping[ClaimRef, Mapping[str, Any]]) -> None:
        """Tell the listener the API objects of the claims a prepare just prepared."""
        if self.listener is None:
            return
        try:
            self.listener.claims_read(read)
        except Exception as error:  # metrics must never fail a prepare
            log.warning("prepared-claims listener failed", extra=log_fields(error=repr(error)))

    @contextmanager
    def counted_call(self) -> Iterator[None]:
        """Gauges and the listener are updated when the last call in flight ends, not per call:
        a burst of 100 concurrent calls tells the listener once, what all of them changed."""
        self._calls += 1
        try:
            yield
        finally:
            self._calls -= 1
            if self._calls == 0:
                self.update_gauges()

    def update_gauges(self) -> None:
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
