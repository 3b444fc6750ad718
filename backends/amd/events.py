"""AMD GPU event notifications: the readers, and the task that reads them for the health monitor.

An `AmdSmiEventReader` per processor subscribes its KFD event fd; the queue is shared, so one
reader reads every GPU's events, with a short timeout in a worker thread (cancellation waits at
most one timeout). GPU pre/post reset -> ``gpu-reset`` (critical), ring hang (where the amdsmi
version has it) -> ``ring-hang`` (critical), thermal throttle -> ``thermal-throttle`` (info), VM
fault -> ``vm-fault`` (info: usually the application's bug, not the GPU's).

A read that finds no event raises NO_DATA (rocm_smi.cc rsmi_event_notification_get:
``if (*num_elem == 0) return RSMI_STATUS_NO_DATA``), or TIMEOUT/RETRY: the normal, quiet case.
Its first read may also answer a stale errno (NOT_SUPPORTED, UNKNOWN_ERROR): any other failure is
transient until it repeats `FAILED_READS` times in a row; only then are events ``unmonitored``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.lowlevel

from agent.core.backend import ConditionKind, HealthSink, report_alive
from agent.core.clock import Clock
from agent.core.logs import log_fields
from agent.core.model import Severity
from agent.core.vendorcall import STOP_TIMEOUT, VendorCallTimeoutError, acquire_when_free
from backends.amd.discovery import DeviceEntry
from backends.amd.smi import (
    STATUS_NO_DATA,
    STATUS_RETRY,
    STATUS_TIMEOUT,
    SmiLibrary,
    describe,
    error_code,
    handle_key,
)

log = logging.getLogger("agent.backends.amd")

GPU_RESET = "gpu-reset"
RING_HANG = "ring-hang"
VM_FAULT = "vm-fault"
THERMAL_THROTTLE = "thermal-throttle"
UNMONITORED = "unmonitored"

# Event name -> (condition, severity, whole GPU?). Names are AmdSmiEvtNotificationType members.
EVENT_CONDITIONS: Mapping[str, tuple[str, Severity, bool]] = {
    "GPU_PRE_RESET": (GPU_RESET, Severity.CRITICAL, True),
    "GPU_POST_RESET": (GPU_RESET, Severity.CRITICAL, True),
    "RING_HANG": (RING_HANG, Severity.CRITICAL, True),
    "THERMAL_THROTTLE": (THERMAL_THROTTLE, Severity.INFO, True),
    "VMFAULT": (VM_FAULT, Severity.INFO, False),
}
QUIET_STATUSES = frozenset({STATUS_NO_DATA, STATUS_TIMEOUT, STATUS_RETRY})
"""What a read answers when no event came."""
FAILED_READS = 3
"""Reads failing in a row (with another status) after which events are taken as unavailable."""

Emit = Callable[..., Awaitable[None]]
"""``emit(sink, names, **HealthEvent fields)``: report one condition on several devices."""


@dataclass
class EventState:
    """Whether events are reported unmonitored; outlives one watcher (`HealthMemory.events`)."""

    unmonitored: bool = False


def _event_types(smi: Any) -> list[Any]:
    members = smi.AmdSmiEvtNotificationType.__members__
    return [members[name] for name in EVENT_CONDITIONS if name in members]


def open_readers(smi: Any, handles: Sequence[Any]) -> list[Any]:
    """One event reader per handle (blocking); raises only when none opens.

    A GPU whose reader fails (lost since discovery) must not blind the others; its loss is
    reported by polling.
    """
    types = _event_types(smi)
    readers: list[Any] = []
    first_error: Exception | None = None
    try:
        for handle in handles:
            try:
                readers.append(smi.AmdSmiEventReader(handle, types))
            except smi.AmdSmiException as error:
                first_error = first_error or error
                log.warning(
                    "GPU event notification failed for one GPU",
                    extra=log_fields(handle=handle_key(handle), error=describe(error)),
                )
    except BaseException:
        close_readers(smi, readers)
        raise
    if not readers and first_error is not None:
        raise first_error
    return readers


def close_readers(smi: Any, readers: Sequence[Any]) -> None:
    """Stop event notification (blocking); never raises."""
    for reader in readers:
        try:
            reader.stop()
        except Exception as error:
            log.debug("stopping an event reader failed", extra=log_fields(error=describe(error)))


class EventWatcher:
    """Reads the GPUs' events until cancelled and reports them through `emit`."""

    def __init__(
        self,
        lib: SmiLibrary,
        groups: Mapping[str, Sequence[DeviceEntry]],
        clock: Clock,
        state: EventState,
        emit: Emit,
        *,
        poll_interval: float,
        timeout_ms: int,
    ) -> None:
        self._lib = lib
        self._groups = groups
        self._by_handle = {handle_key(e.handle): e for entries in groups.values() for e in entries}
        self._clock = clock
        self._state = state
        self._emit = emit
        self._poll_interval = poll_interval
        self._timeout_ms = timeout_ms
        # Held by the worker thread that reads events; a read cancelled before its thread ran
        # finds `_closing` set and leaves the readers alone (they may be stopped by then).
        self._read_lock = threading.Lock()
        self._closing = False

    def _all_names(self) -> list[str]:
        return [e.name for entries in self._groups.values() for e in entries]

    async def _set_unmonitored(self, sink: HealthSink, problem: str | None) -> None:
        if (problem is not None) == self._state.unmonitored:
            return
        self._state.unmonitored = problem is not None
        if problem is not None:
            log.warning("GPU event notification unavailable", extra=log_fields(error=problem))
        await self._emit(
            sink,
            self._all_names(),
            condition=UNMONITORED,
            severity=Severity.WARNING,
            value="events",
            message=f"GPU reset/fault events unavailable: {problem}" if problem else "",
            kind=ConditionKind.STATE,
            cleared=problem is None,
        )

    async def run(self, sink: HealthSink) -> None:
        """Open the readers (retrying while they cannot open), then read until cancelled."""
        handles = [e.handle for e in self._by_handle.values() if e.handle is not None]
        while True:
            try:
                # On the events lane: a hung open must not hold up the health pass.
                readers = await self._lib.run_events(
                    lambda smi: open_readers(smi, handles), self._lib.call_timeout, "open_readers"
                )
                break
            except Exception as error:
                # Unsupported (a VM guest) or not permitted: try again later, quietly.
                await self._set_unmonitored(sink, describe(error))
                report_alive(sink)
                await self._clock.sleep(self._poll_interval)
        try:
            await self._read_loop(readers, sink)
        finally:
            with anyio.CancelScope(shield=True):
                await self._close(readers)

    async def _read_loop(self, readers: Sequence[Any], sink: HealthSink) -> None:
        timeout = self._timeout_ms
        bound = timeout / 1000 + self._lib.call_timeout
        failures = 0
        while True:
            try:
                # The notification queue is shared by all GPUs: one reader reads every event.
                events = await self._lib.run_events(
                    lambda smi: self._read(readers[0], timeout), bound, "read"
                )
            except Exception as error:
                if error_code(error) in QUIET_STATUSES:
                    events = []
                else:
                    failures += 1
                    if failures < FAILED_READS:  # e.g. the stale errno of a first read
                        log.debug("GPU event read failed", extra=log_fields(error=describe(error)))
                        await anyio.lowlevel.checkpoint()
                        continue
                    await self._set_unmonitored(sink, describe(error))
                    await self._clock.sleep(self._poll_interval)
                    continue
            failures = 0
            report_alive(sink)
            await self._set_unmonitored(sink, None)
            for event in events:
                await self._handle_event(event, sink)
            await anyio.lowlevel.checkpoint()

    def _read(self, reader: Any, timeout_ms: int) -> Any:
        with self._read_lock:
            return [] if self._closing else reader.read(timeout_ms)

    async def _close(self, readers: Sequence[Any]) -> None:
        """Stop the readers once no read uses them (a cancelled read returns within its timeout)."""
        self._closing = True
        if not await acquire_when_free(self._read_lock, self._timeout_ms / 1000 + 0.25):
            log.warning("GPU event read did not return; leaving its readers", extra=log_fields())
            return
        try:
            await self._lib.run_unlimited(
                lambda smi: close_readers(smi, readers), STOP_TIMEOUT, "close_readers"
            )
        except VendorCallTimeoutError as error:
            log.warning("stopping GPU event readers did not finish", extra=log_fields(error=str(error)))
        finally:
            self._read_lock.release()

    async def _handle_event(self, event: Mapping[str, Any], sink: HealthSink) -> None:
        kind = str(event.get("event", ""))
        mapping = EVENT_CONDITIONS.get(kind)
        entry = self._by_handle.get(handle_key(event.get("processor_handle")))
        if mapping is None or entry is None:
            log.debug("ignoring GPU event", extra=log_fields(event=kind))
            return
        condition, severity, whole_gpu = mapping
        names = [e.name for e in self._groups[entry.gpu_key]] if whole_gpu else [entry.name]
        message = str(event.get("message", "")).strip()
        if kind == "GPU_PRE_RESET":
            message = f"GPU reset started{': ' + message if message else ''}"
        elif kind == "GPU_POST_RESET":
            message = f"GPU reset completed{': ' + message if message else ''}"
        log.log(
            logging.WARNING if severity >= Severity.WARNING else logging.INFO,
            "GPU event",
            extra=log_fields(device=entry.name, event=kind, condition=condition),
        )
        await self._emit(sink, names, condition=condition, severity=severity, message=message[:200])
