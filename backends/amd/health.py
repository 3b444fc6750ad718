"""Health of AMD GPUs: amdsmi event notifications plus polling of RAS (ECC per block, CPER).

Two tasks run side by side until cancelled:

- events: an `AmdSmiEventReader` read with a short timeout in a worker thread (so cancellation
  waits at most one timeout). GPU pre/post reset -> ``gpu-reset`` (critical), ring hang (where
  the amdsmi version has it) -> ``ring-hang`` (critical), thermal throttle -> ``thermal-throttle``
  (info), VM fault -> ``vm-fault`` (info: usually the application's bug, not the GPU's).
- polling, every ``poll-interval``: uncorrectable ECC count per RAS block -> ``ecc-uncorrectable``
  with the block as value when the count rises (a count that stops rising recovers after the
  taint policy's hold time); fatal CPER records younger than ``cper-max-age`` -> ``cper-fatal``
  (older records, e.g. kept across reboots, gave AMD false positives); a GPU that stops
  answering -> ``gpu-lost`` until it answers again.

When events or RAS are unavailable (a VM guest, an old kernel) the devices get ``unmonitored``
(a warning STATE) with value ``events`` or ``ras``, cleared when monitoring works again.
Resets, RAS and loss are per physical GPU and fan out to all its partitions.

What is set (lost, unmonitored, the ECC baselines) is kept in `HealthMemory`, which outlives one
monitor: the monitor started after a rediscovery clears what its predecessor set (a GPU lost,
left out of discovery, and back). Every amdsmi call is bounded; a cancelled event read is not
waited for, but the readers are stopped only once the read in flight has returned.
"""

from __future__ import annotations

import calendar
import functools
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel

from agent.core.backend import ConditionKind, HealthEvent, HealthSink, report_alive
from agent.core.clock import Clock
from agent.core.logs import log_fields
from agent.core.model import Severity
from agent.core.vendorcall import STOP_TIMEOUT, VendorCallTimeoutError, acquire_when_free
from backends.amd.discovery import DeviceEntry
from backends.amd.smi import (
    LOST_STATUSES,
    STATUS_NOT_SUPPORTED,
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
ECC_UNCORRECTABLE = "ecc-uncorrectable"
CPER_FATAL = "cper-fatal"
GPU_LOST = "gpu-lost"
UNMONITORED = "unmonitored"

# Event name -> (condition, severity, whole GPU?). Names are AmdSmiEvtNotificationType members.
EVENT_CONDITIONS: Mapping[str, tuple[str, Severity, bool]] = {
    "GPU_PRE_RESET": (GPU_RESET, Severity.CRITICAL, True),
    "GPU_POST_RESET": (GPU_RESET, Severity.CRITICAL, True),
    "RING_HANG": (RING_HANG, Severity.CRITICAL, True),
    "THERMAL_THROTTLE": (THERMAL_THROTTLE, Severity.INFO, True),
    "VMFAULT": (VM_FAULT, Severity.INFO, False),
}
CONDITIONS = (
    GPU_RESET,
    RING_HANG,
    VM_FAULT,
    THERMAL_THROTTLE,
    ECC_UNCORRECTABLE,
    CPER_FATAL,
    GPU_LOST,
    UNMONITORED,
)
"""Every condition this monitor reports (the backend's `health_conditions`)."""
CPER_SEV_FATAL = 1  # amdsmi_cper_sev_t AMDSMI_CPER_SEV_FATAL; the mask has bit (1 << severity)


@dataclass(frozen=True)
class HealthSettings:
    """Knobs of the health monitor (backend settings ``poll-interval``, ``cper-max-age``...)."""

    poll_interval: float = 10.0
    event_timeout_ms: int = 200
    cper_max_age: float = 3600.0


@dataclass(frozen=True)
class RasReading:
    """One poll of one physical GPU."""

    lost: str = ""
    ecc: Mapping[str, int] | None = None
    ras_problem: str = ""
    cper: tuple[tuple[float, str, str], ...] = ()
    """Fatal CPER records: (unix time, notify type, record id)."""
    cper_cursor: int = 0
    cper_supported: bool = True


EccCounts = dict[str, dict[str, int]]
"""Uncorrectable ECC counts by GPU key and RAS block, as last read."""


@dataclass
class _GpuState:
    ecc: dict[str, int] = field(default_factory=dict)
    lost: bool = False
    ras_unmonitored: bool = False
    cper_cursor: int = 0
    cper_supported: bool = True


@dataclass
class HealthMemory:
    """What outlives one `HealthMonitor`: per physical GPU state, and whether events are unavailable."""

    gpus: dict[str, _GpuState] = field(default_factory=dict)
    events_unmonitored: bool = False

    @classmethod
    def with_ecc_counts(cls, counts: EccCounts) -> HealthMemory:
        """Memory holding the ECC counts an earlier agent process of this boot read: errors since
        then are new, not a baseline."""
        return cls(gpus={key: _GpuState(ecc=dict(blocks)) for key, blocks in counts.items()})

    def ecc_counts(self) -> EccCounts:
        """The last ECC count per GPU and block (a copy)."""
        return {key: dict(state.ecc) for key, state in self.gpus.items() if state.ecc}


def _cper_time(text: object) -> float | None:
    """amdsmi formats CPER timestamps as ``YYYY/MM/DD HH:MM:SS`` (UTC)."""
    if not isinstance(text, str):
        return None
    try:
        return float(calendar.timegm(time.strptime(text.strip(), "%Y/%m/%d %H:%M:%S")))
    except ValueError:
        return None


def read_ras(smi: Any, handle: Any, cper_cursor: int, cper_supported: bool) -> RasReading:
    """Poll one GPU's liveness, ECC counts per block and new fatal CPER records (blocking)."""
    try:
        smi.amdsmi_get_gpu_vram_usage(handle)
    except smi.AmdSmiException as error:
        if error_code(error) in LOST_STATUSES:
            return RasReading(lost=describe(error), cper_cursor=cper_cursor, cper_supported=cper_supported)
    ecc: dict[str, int] | None = None
    problem = ""
    try:
        enabled = int(smi.amdsmi_get_gpu_ecc_enabled(handle))
    except smi.AmdSmiException as error:
        enabled, problem = 0, f"ECC state unreadable: {describe(error)}"
    if enabled:
        ecc = {}
        for block in smi.AmdSmiGpuBlock:
            if block.name in ("INVALID", "RESERVED") or not enabled & int(block.value):
                continue
            try:
                counts = smi.amdsmi_get_gpu_ecc_count(handle, block)
            except smi.AmdSmiException as error:
                if error_code(error) != STATUS_NOT_SUPPORTED:
                    log.debug(
                        "ECC count unreadable", extra=log_fields(block=block.name, error=describe(error))
                    )
                continue
            value = counts.get("uncorrectable_count") if isinstance(counts, Mapping) else None
            if isinstance(value, int):
                ecc[block.name.lower()] = value
        if not ecc:
            ecc, problem = None, "no RAS block reports ECC counts"
    elif not problem:
        problem = "ECC is disabled or RAS is not exposed (e.g. on a VM guest)"
    records: list[tuple[float, str, str]] = []
    cursor = cper_cursor
    if cper_supported:
        try:
            mask = 1 << CPER_SEV_FATAL
            entries, cursor, _, _ = smi.amdsmi_get_gpu_cper_entries(handle, mask, cursor=cper_cursor)
        except (smi.AmdSmiException, AttributeError) as error:
            cper_supported = error_code(error) not in (STATUS_NOT_SUPPORTED, None)
            entries = {}
        for entry in entries.values() if isinstance(entries, Mapping) else ():
            if str(entry.get("error_severity", "")).lower() != "fatal":
                continue
            at = _cper_time(entry.get("timestamp"))
            if at is not None:
                records.append((at, str(entry.get("notify_type", "")), str(entry.get("record_id", ""))))
    return RasReading(
        ecc=ecc, ras_problem=problem, cper=tuple(records), cper_cursor=cursor, cper_supported=cper_supported
    )


def _read_ras(handle: Any, cursor: int, supported: bool, smi: Any) -> RasReading:
    return read_ras(smi, handle, cursor, supported)


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


class HealthMonitor:
    """Watches the published devices until cancelled and reports `HealthEvent`s."""

    def __init__(
        self,
        lib: SmiLibrary,
        entries: Sequence[DeviceEntry],
        clock: Clock,
        settings: HealthSettings = HealthSettings(),
        *,
        memory: HealthMemory | None = None,
    ) -> None:
        self._lib = lib
        self._clock = clock
        self._settings = settings
        self._groups: dict[str, list[DeviceEntry]] = {}
        self._by_handle: dict[int, DeviceEntry] = {}
        for entry in entries:
            self._groups.setdefault(entry.gpu_key, []).append(entry)
            self._by_handle[handle_key(entry.handle)] = entry
        self._memory = memory or HealthMemory()
        self._state = {key: self._memory.gpus.setdefault(key, _GpuState()) for key in self._groups}
        # Held by the worker thread that reads events; a read cancelled before its thread ran
        # finds `_closing` set and leaves the readers alone (they may be stopped by then).
        self._read_lock = threading.Lock()
        self._closing = False

    async def run(self, sink: HealthSink) -> None:
        """Report health until cancelled."""
        while not self._groups:  # nothing to watch, but the monitor runs
            report_alive(sink)
            await self._clock.sleep(self._settings.poll_interval)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._watch_events, sink)
            tg.start_soon(self._poll, sink)

    # --- events -------------------------------------------------------------------------

    async def _emit_all(self, sink: HealthSink, names: Sequence[str], **kwargs: Any) -> None:
        for name in names:
            await sink(HealthEvent(device=name, **kwargs))

    def _all_names(self) -> list[str]:
        return [e.name for entries in self._groups.values() for e in entries]

    async def _set_events_unmonitored(self, sink: HealthSink, problem: str | None) -> None:
        if (problem is not None) == self._memory.events_unmonitored:
            return
        self._memory.events_unmonitored = problem is not None
        if problem is not None:
            log.warning("GPU event notification unavailable", extra=log_fields(error=problem))
        await self._emit_all(
            sink,
            self._all_names(),
            condition=UNMONITORED,
            severity=Severity.WARNING,
            value="events",
            message=f"GPU reset/fault events unavailable: {problem}" if problem else "",
            kind=ConditionKind.STATE,
            cleared=problem is None,
        )

    async def _watch_events(self, sink: HealthSink) -> None:
        handles = [e.handle for e in self._by_handle.values()]
        while True:
            try:
                readers = await self._lib.run_health(lambda smi: open_readers(smi, handles), "open_readers")
                break
            except Exception as error:
                # Unsupported (a VM guest) or not permitted: try again later, quietly.
                await self._set_events_unmonitored(sink, describe(error))
                report_alive(sink)
                await self._clock.sleep(self._settings.poll_interval)
        timeout = self._settings.event_timeout_ms
        bound = timeout / 1000 + self._lib.call_timeout
        try:
            while True:
                try:
                    # The notification queue is shared by all GPUs: one reader reads every event.
                    events = await self._lib.run_events(
                        lambda smi: self._read(readers[0], timeout), bound, "read"
                    )
                except Exception as error:
                    if error_code(error) in (STATUS_TIMEOUT, STATUS_RETRY):
                        report_alive(sink)
                        await anyio.lowlevel.checkpoint()
                        continue
                    await self._set_events_unmonitored(sink, describe(error))
                    await self._clock.sleep(self._settings.poll_interval)
                    continue
                report_alive(sink)
                await self._set_events_unmonitored(sink, None)
                for event in events:
                    await self._handle_event(event, sink)
                await anyio.lowlevel.checkpoint()
        finally:
            with anyio.CancelScope(shield=True):
                await self._close(readers, timeout)

    def _read(self, reader: Any, timeout_ms: int) -> Any:
        with self._read_lock:
            return [] if self._closing else reader.read(timeout_ms)

    async def _close(self, readers: Sequence[Any], timeout_ms: int) -> None:
        """Stop the readers once no read uses them (a cancelled read returns within its timeout)."""
        self._closing = True
        if not await acquire_when_free(self._read_lock, timeout_ms / 1000 + 0.25):
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
        await self._emit_all(sink, names, condition=condition, severity=severity, message=message[:200])

    # --- polling ------------------------------------------------------------------------

    async def _poll(self, sink: HealthSink) -> None:
        while True:
            await self.poll_once(sink)
            report_alive(sink)
            await self._clock.sleep(self._settings.poll_interval)

    async def poll_once(self, sink: HealthSink) -> None:
        """Poll every physical GPU once."""
        for key, entries in self._groups.items():
            state = self._state[key]
            primary = entries[0].primary
            cursor, supported = state.cper_cursor, state.cper_supported
            reading = await self._lib.run_health(
                functools.partial(_read_ras, primary, cursor, supported), "read_ras"
            )
            await self._apply(key, entries, reading, sink)

    async def _apply(
        self, key: str, entries: Sequence[DeviceEntry], reading: RasReading, sink: HealthSink
    ) -> None:
        state = self._state[key]
        names = [e.name for e in entries]
        if reading.lost:
            if not state.lost:
                state.lost = True
                log.error("GPU lost", extra=log_fields(gpu=key, error=reading.lost))
                await self._emit_all(
                    sink,
                    names,
                    condition=GPU_LOST,
                    severity=Severity.CRITICAL,
                    message=f"GPU stopped answering: {reading.lost}",
                    kind=ConditionKind.STATE,
                )
            return
        if state.lost:
            state.lost = False
            log.warning("GPU answers again", extra=log_fields(gpu=key))
            await self._emit_all(
                sink,
                names,
                condition=GPU_LOST,
                severity=Severity.CRITICAL,
                kind=ConditionKind.STATE,
                cleared=True,
            )
        state.cper_cursor, state.cper_supported = reading.cper_cursor, reading.cper_supported
        await self._apply_ecc(key, names, state, reading, sink)
        now = self._clock.time()
        for at, notify, record in reading.cper:
            if now - at > self._settings.cper_max_age:
                log.info(
                    "old fatal CPER record ignored", extra=log_fields(gpu=key, record=record, age=now - at)
                )
                continue
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))
            await self._emit_all(
                sink,
                names,
                condition=CPER_FATAL,
                severity=Severity.CRITICAL,
                value=notify.lower()[:63],
                message=f"fatal CPER record {record} at {stamp}",
            )

    async def _apply_ecc(
        self, key: str, names: Sequence[str], state: _GpuState, reading: RasReading, sink: HealthSink
    ) -> None:
        if reading.ecc is None:
            if not state.ras_unmonitored:
                state.ras_unmonitored = True
                log.warning("RAS unavailable", extra=log_fields(gpu=key, error=reading.ras_problem))
                await self._emit_all(
                    sink,
                    names,
                    condition=UNMONITORED,
                    severity=Severity.WARNING,
                    value="ras",
                    message=reading.ras_problem,
                    kind=ConditionKind.STATE,
                )
            return
        if state.ras_unmonitored:
            state.ras_unmonitored = False
            await self._emit_all(
                sink,
                names,
                condition=UNMONITORED,
                severity=Severity.WARNING,
                value="ras",
                kind=ConditionKind.STATE,
                cleared=True,
            )
        for block, count in sorted(reading.ecc.items()):
            previous = state.ecc.get(block)
            state.ecc[block] = count
            if previous is None:
                # The first reading is the baseline: errors from before the agent started were
                # already acted on (or not) and would taint again on every agent restart.
                if count:
                    log.warning("ECC errors since boot", extra=log_fields(gpu=key, block=block, count=count))
                continue
            if count > previous:
                await self._emit_all(
                    sink,
                    names,
                    condition=ECC_UNCORRECTABLE,
                    severity=Severity.CRITICAL,
                    value=block,
                    message=f"{count - previous} new uncorrectable errors in {block} ({count} since boot)",
                )
