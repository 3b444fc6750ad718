"""GPU health from NVML events: XIDs, ECC errors, lost GPUs, GPUs that cannot be monitored.

One event set holds the XID-critical, double-bit and single-bit ECC events of every GPU (masked
by what each GPU supports). Each wait runs in a worker thread with a short timeout, so a cancelled
monitor returns within one wait. Conditions (for the taint policy):

- ``xid`` (EVENT, value = the XID): CRITICAL, except application XIDs (13, 31, 43, 45, 68, 109 by
  default, plus ``ignored-xids``, minus ``critical-xids``) which are INFO. Attributed to the MIG
  device through the event's GPU/compute instance IDs, else to every device of the GPU.
- ``ecc-uncorrectable`` (EVENT, CRITICAL; from a DBE event or a rise of the volatile counter seen
  by the pass) and ``ecc-correctable`` (EVENT, INFO).
- ``gpu-lost`` (STATE, CRITICAL, every device of the GPU): NVML says GPU_IS_LOST (or GPU_NOT_FOUND,
  RESET_REQUIRED) to a registration or to the pass, or an event cannot be read and the GPU no
  longer answers. Cleared when the GPU answers again: a lost GPU
  is asked every ``recovery-interval`` through a fresh handle (one taken before a GPU reset may
  be stale) and registered for events again; a monitor started after a rediscovery clears it too.
- the pass's own STATE conditions, raised and cleared on change: ``retired-pages-pending``,
  ``row-remap-failure``, ``row-remap-pending``, ``recovery-action`` and the trends
  (`backends.nvidia.checks`).
- ``unmonitored`` (STATE, WARNING): events cannot be registered; NOT_SUPPORTED on older GPUs
  is a warning (health unknown), never a fault. Cleared when a later registration (a monitor
  started after a rediscovery) succeeds.

Which GPUs carry these two states is kept in `HealthState`, which outlives one monitor, so a
monitor started for a new discovery knows what to clear.

A health pass (`backends.nvidia.checks` reads, `backends.nvidia.healthpass` interprets) runs every
``health_interval`` seconds besides the events, at start too, and after any other call (telemetry,
discovery, a prepare) met GPU_IS_LOST on a GPU (`HealthState.suspect`): it asks every GPU whether
it answers (``gpu-lost`` without any event), reads its ECC counters (``ecc-uncorrectable`` on GPUs
without ECC events), retired pages, row remapping, recovery action and error-rate trends, and tells
the core what it looked at (`report_pass`). Its ECC readings are telemetry's too (`GpuChecks.ecc`):
one read per pass.

Recovery: where the driver reports ``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`` (read by the pass), the
XID/ECC conditions of a GPU whose action went back to NONE are cleared; elsewhere the taint
policy's hold time applies.

Every NVML call is bounded and runs on the monitor's own lane (`Nvml.run_health`), never behind
a telemetry read; a cancelled wait is not waited for, but the event set is freed only once the
wait in flight has returned.
"""

from __future__ import annotations

import ctypes
import logging
import math
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import anyio

from agent.core.backend import (
    DEFAULT_HEALTH_INTERVAL,
    ConditionKind,
    HealthEvent,
    HealthSink,
    report_alive,
    report_pass,
)
from agent.core.clock import Clock
from agent.core.logs import log_fields
from agent.core.model import Severity
from agent.core.vendorcall import STOP_TIMEOUT, VendorCallTimeoutError, acquire_when_free
from backends.nvidia.checks import (
    ANSWERS,
    PASS_CONDITIONS,
    RECOVERY_ACTION_CHECK,
    RECOVERY_NONE,
    TREND_WINDOW,
    EccCounts,
    GpuAsk,
    GpuChecks,
    GpuReading,
    TrendThresholds,
    read_gpu_sync,
)
from backends.nvidia.discovery import INVALID_INSTANCE_ID, GpuInfo, NvDevice
from backends.nvidia.healthpass import ECC_UNCORRECTABLE, PassResults
from backends.nvidia.lostgpu import fresh_handle, lost_answer
from backends.nvidia.nvml import Nvml, text
from backends.nvidia.xids import XidPolicy

log = logging.getLogger("agent.backends.nvidia.health")

XID = "xid"
GPU_LOST = "gpu-lost"
UNMONITORED = "unmonitored"
ECC_CORRECTABLE = "ecc-correctable"
CONDITIONS = (XID, GPU_LOST, UNMONITORED, ECC_UNCORRECTABLE, ECC_CORRECTABLE, *PASS_CONDITIONS)
"""Every condition this monitor reports (the backend's `health_conditions`)."""


@dataclass(frozen=True)
class RawEvent:
    """An NVML event, read in the worker thread."""

    gpu_uuid: str
    event_type: int
    data: int
    gpu_instance_id: int
    compute_instance_id: int


@dataclass
class HealthState:
    """What outlives one monitor: the last XID per GPU UUID (for telemetry), the GPUs whose
    ``gpu-lost`` or ``unmonitored`` condition is set and not yet cleared, the GPUs another call
    found lost (the next pass asks them at once), and each GPU's pass state (ECC baselines, what
    the pass raised, unsupported checks)."""

    last_xid: dict[str, int] = field(default_factory=dict)
    lost: set[str] = field(default_factory=set)
    unmonitored: set[str] = field(default_factory=set)
    suspect: set[str] = field(default_factory=set)
    checks: dict[str, GpuChecks] = field(default_factory=dict)

    def ecc(self, gpu_uuid: str) -> EccCounts:
        """The ECC totals the last pass read of `gpu_uuid` (telemetry's source)."""
        checks = self.checks.get(gpu_uuid)
        return checks.ecc if checks is not None else EccCounts()


class _Outcome:
    """Result of one wait: an event, a timeout, an error, or an event whose device then failed."""

    def __init__(self, event: RawEvent | None = None, error: BaseException | None = None) -> None:
        self.event = event
        self.error = error


class HealthMonitor(PassResults):
    """Watch NVML events for `devices` and report `HealthEvent`s to a sink until cancelled."""

    def __init__(
        self,
        nvml: Nvml,
        devices: Sequence[NvDevice],
        clock: Clock,
        *,
        policy: XidPolicy | None = None,
        state: HealthState | None = None,
        wait_ms: int = 500,
        recovery_interval: float = 5.0,
        health_interval: float = DEFAULT_HEALTH_INTERVAL,
        thresholds: TrendThresholds | None = None,
    ) -> None:
        self._nvml = nvml
        self._lib: Any = nvml.lib
        self._devices = tuple(devices)
        self._gpus: dict[str, GpuInfo] = {}
        for d in self._devices:
            self._gpus.setdefault(d.gpu.uuid, d.gpu)
        # The handle each GPU is watched through; a lost GPU's is replaced when it answers again.
        self._handles: dict[str, Any] = {uuid: gpu.handle for uuid, gpu in self._gpus.items()}
        self._clock = clock
        self._policy = policy or XidPolicy()
        self.state = state or HealthState()
        self._wait_ms = wait_ms
        self._recovery_interval = recovery_interval
        self._event_set: Any = None
        # Held by the worker thread that uses the event set; a call cancelled before its thread
        # ran finds `_closing` set and leaves the set alone (it may be freed by then).
        self._set_lock = threading.Lock()
        self._closing = False
        # GPUs with an active XID/ECC condition whose recovery action the pass watches.
        self._faulted: dict[str, set[tuple[str, str, str]]] = {}
        # GPUs whose recovery action was seen other than NONE since their fault.
        self._recovering: set[str] = set()
        self._next_poll = 0.0
        self._health_interval = health_interval
        self._thresholds = thresholds or TrendThresholds()
        self._next_pass = 0.0
        self._wanted = (
            int(getattr(self._lib, "nvmlEventTypeXidCriticalError", 0x8))
            | int(getattr(self._lib, "nvmlEventTypeDoubleBitEccError", 0x2))
            | int(getattr(self._lib, "nvmlEventTypeSingleBitEccError", 0x1))
        )

    def devices_of(self, gpu_uuid: str) -> list[NvDevice]:
        return [d for d in self._devices if d.gpu.uuid == gpu_uuid]

    def _lost_here(self) -> list[GpuInfo]:
        return [gpu for uuid, gpu in self._gpus.items() if uuid in self.state.lost]

    async def run(self, sink: HealthSink) -> None:
        """Register events and report until cancelled; frees the event set on the way out.

        Each wait that returns (an event or its timeout) reports the monitor alive to `sink`.
        """
        try:
            for event in await self._nvml.run_health(self._register_sync):
                await sink(event)
            report_alive(sink)
            # The first pass at once: the core learns what the GPUs say before any interval.
            await self.run_pass(sink)
            while True:
                if self._event_set is None:
                    idle = max(self._recovery_interval, self._wait_ms / 1000)
                    await self._clock.sleep(max(0.0, min(idle, self._next_pass - self._clock.monotonic())))
                else:
                    outcome = await self._wait()
                    for event in await self._handle(outcome):
                        await sink(event)
                report_alive(sink)
                if self._pass_due():
                    await self.run_pass(sink)
                if self._revive_due():
                    self._next_poll = self._clock.monotonic() + self._recovery_interval
                    for event in await self._nvml.run_health(self._poll_sync):
                        await sink(event)
        finally:
            with anyio.CancelScope(shield=True):
                await self._release()

    async def _wait(self) -> _Outcome:
        return await self._nvml.run_health(
            self._wait_sync, bound=self._wait_ms / 1000 + self._nvml.call_timeout
        )

    async def _release(self) -> None:
        """Free the event set once no worker thread uses it (a cancelled wait returns within its timeout)."""
        self._closing = True
        # Freeing the set under a wait in flight would be a use after free: wait for it, bounded.
        if not await acquire_when_free(self._set_lock, self._wait_ms / 1000 + 0.25):
            log.warning("NVML event wait did not return; leaving its event set", extra=log_fields())
            return
        try:
            await self._nvml.run_unlimited(self._free_sync, bound=STOP_TIMEOUT)
        except VendorCallTimeoutError as error:
            log.warning("nvmlEventSetFree did not return", extra=log_fields(error=str(error)))
        finally:
            self._set_lock.release()

    # -- worker-thread parts ------------------------------------------------------------------

    def _register_sync(self) -> list[HealthEvent]:
        with self._set_lock:
            return [] if self._closing else self._register_all()

    def _register_all(self) -> list[HealthEvent]:
        lib = self._lib
        events: list[HealthEvent] = []
        try:
            self._event_set = lib.nvmlEventSetCreate()
        except Exception as error:
            if not self._nvml.is_error(error):
                raise
            log.warning("cannot create an NVML event set", extra=log_fields(error=str(error)))
            for gpu in self._gpus.values():
                events.extend(self._unmonitored(gpu, f"cannot create an NVML event set: {error}"))
            return events
        for gpu in self._gpus.values():
            events.extend(self._register_gpu(gpu))
        return events

    def _register_gpu(self, gpu: GpuInfo) -> list[HealthEvent]:
        """Register `gpu` for events; clear its ``gpu-lost`` once it answers, ``unmonitored`` once watched."""
        lib = self._lib
        handle = self._handles[gpu.uuid]
        try:
            try:
                supported = int(lib.nvmlDeviceGetSupportedEventTypes(handle))
            except Exception as error:
                if not self._nvml.is_unsupported(error):
                    raise
                supported = 0
            mask = self._wanted & supported
            xid_type = int(getattr(lib, "nvmlEventTypeXidCriticalError", 0x8))
            if not mask & xid_type:
                problem = "this GPU or driver does not report XID events (NOT_SUPPORTED)"
            else:
                lib.nvmlDeviceRegisterEvents(handle, mask, self._event_set)
                problem = ""
        except Exception as error:
            if not self._nvml.is_error(error):
                raise
            if self._nvml.is_gpu_lost(error):
                return self._lost_events(gpu, f"GPU is lost: {error}")
            unsupported = self._nvml.is_unsupported(error)
            problem = (
                f"event registration not supported: {error}"
                if unsupported
                else f"cannot register events: {error}"
            )
        events = self._cleared(gpu, GPU_LOST, Severity.CRITICAL, "GPU answers again")
        if problem:
            return events + self._unmonitored(gpu, problem)
        log.info("watching GPU events", extra=log_fields(gpu=gpu.uuid, mask=hex(mask)))
        return events + self._cleared(gpu, UNMONITORED, Severity.WARNING, "GPU events watched again")

    def _wait_sync(self) -> _Outcome:
        with self._set_lock:
            return _Outcome() if self._closing else self._wait_once()

    def _wait_timeout_ms(self) -> int:
        # A wait ends by the next pass, so that a pass is at most its interval late, not a wait later.
        until_pass = (self._next_pass - self._clock.monotonic()) * 1000
        return max(1, min(self._wait_ms, math.ceil(until_pass)))

    def _wait_once(self) -> _Outcome:
        try:
            data = self._lib.nvmlEventSetWait_v2(self._event_set, self._wait_timeout_ms())
        except Exception as error:
            if self._nvml.is_timeout(error):
                return _Outcome()
            if not self._nvml.is_error(error):
                raise
            return _Outcome(error=error)
        try:
            uuid = text(self._lib.nvmlDeviceGetUUID(data.device))
        except Exception as error:
            if not self._nvml.is_error(error):
                raise
            # NVIDIA's mock (fallen_off_bus): XID 79 comes with a device that already answers
            # GPU_IS_LOST. The handle is the one we registered: it names the GPU without asking it.
            watched = self._watched(data.device)
            return _Outcome(None if watched is None else self._raw(watched, data), error)
        return _Outcome(self._raw(uuid, data))

    def _watched(self, handle: Any) -> str | None:
        """The UUID of the GPU we watch through `handle` (NVML handles are stable per process)."""
        address = ctypes.cast(handle, ctypes.c_void_p).value
        return next(
            (u for u, h in self._handles.items() if ctypes.cast(h, ctypes.c_void_p).value == address), None
        )

    @staticmethod
    def _raw(uuid: str, data: Any) -> RawEvent:
        return RawEvent(
            uuid,
            int(data.eventType),
            int(data.eventData),
            int(data.gpuInstanceId),
            int(data.computeInstanceId),
        )

    def _probe_lost_sync(self) -> list[GpuInfo]:
        """GPUs that answer lost to any of several getters (after an error from the event set)."""
        return [
            gpu
            for uuid, gpu in self._gpus.items()
            if uuid not in self.state.lost and lost_answer(self._nvml, self._handles[uuid]) is not None
        ]

    def _rebuild_sync(self) -> list[HealthEvent]:
        """Recreate the event set without the lost GPUs, so waits stop failing on them."""
        with self._set_lock:
            return [] if self._closing else self._rebuild()

    def _rebuild(self) -> list[HealthEvent]:
        self._free_sync()
        self._event_set = self._lib.nvmlEventSetCreate()
        events: list[HealthEvent] = []
        for gpu in self._gpus.values():
            if gpu.uuid not in self.state.lost:
                events.extend(self._register_gpu(gpu))
        return events

    def _poll_sync(self) -> list[HealthEvent]:
        with self._set_lock:
            return [] if self._closing else self._revive()

    def _revive(self) -> list[HealthEvent]:
        """Ask each lost GPU again, through a fresh handle; one that answers is watched again."""
        events: list[HealthEvent] = []
        for gpu in self._lost_here():
            self.state.suspect.discard(gpu.uuid)
            try:
                handle = fresh_handle(self._nvml, gpu.uuid, gpu.index, self._handles[gpu.uuid])
                self._lib.nvmlDeviceGetUUID(handle)
            except Exception as error:
                if not self._nvml.is_error(error):
                    raise
                continue
            self._handles[gpu.uuid] = handle
            if self._event_set is not None:
                events.extend(self._register_gpu(gpu))
            else:
                events.extend(self._cleared(gpu, GPU_LOST, Severity.CRITICAL, "GPU answers again"))
        return events

    def _free_sync(self) -> None:
        if self._event_set is None:
            return
        event_set, self._event_set = self._event_set, None
        try:
            self._lib.nvmlEventSetFree(event_set)
        except Exception as error:
            log.debug("nvmlEventSetFree failed", extra=log_fields(error=str(error)))

    # -- the health pass ----------------------------------------------------------------------

    def _revive_due(self) -> bool:
        lost = {gpu.uuid for gpu in self._lost_here()}
        # A rediscovery that reads a lost GPU again (a suspect) has it asked at once.
        return bool(lost) and (self._clock.monotonic() >= self._next_poll or bool(lost & self.state.suspect))

    def _pass_due(self) -> bool:
        if self._clock.monotonic() >= self._next_pass:
            return True
        # Another call met GPU_IS_LOST on one of our GPUs: ask it now, not an interval later.
        return bool((self.state.suspect & self._gpus.keys()) - self.state.lost)

    async def run_pass(self, sink: HealthSink) -> None:
        """One health pass over every GPU; its events go to `sink`, then `report_pass`."""
        self._next_pass = self._clock.monotonic() + self._health_interval
        events: list[HealthEvent] = []
        looked: list[str] = []
        failed: set[str] = set()
        newly_lost = False
        for uuid, gpu in self._gpus.items():
            names = [d.name for d in self.devices_of(uuid)]
            if uuid in self.state.lost:
                # Known lost: asked again every recovery-interval (`_revive`); its state is current.
                looked.extend(names)
                continue
            checks = self.state.checks.setdefault(uuid, GpuChecks())
            reading = GpuReading()
            fresh = self._clock.monotonic() - checks.links_at < TREND_WINDOW
            ask = GpuAsk(
                uuid,
                self._handles[uuid],
                frozenset(checks.unsupported),
                uuid in self.state.suspect,
                checks.links if fresh else None,
                gpu.index,
            )
            try:
                await self._nvml.run_health(read_gpu_sync, self._nvml, ask, reading)
            except VendorCallTimeoutError as error:
                # A hung call is the check failing, not the GPU: the GPU is left out of this pass,
                # and so are the GPUs after it (the hung call holds the lane until it returns).
                check = reading.current or ANSWERS
                failed.add(check)
                self._check_failed(uuid, checks, check, str(error))
                break
            self.state.suspect.discard(uuid)
            if reading.lost:
                events.extend(self._lost_events(gpu, f"GPU does not answer: {reading.lost}"))
                newly_lost = True
                looked.extend(names)
                continue
            if reading.handle is not None:
                self._handles[uuid] = reading.handle
            events.extend(self._apply(gpu, checks, reading))
            failed.update(reading.failed)
            if not reading.failed:
                looked.extend(names)
        if newly_lost and self._event_set is not None:
            # Stop waiting on what a lost GPU registered (a real driver may fail waits for it).
            events.extend(await self._nvml.run_health(self._rebuild_sync))
        for event in events:
            await sink(event)
        report_pass(sink, looked, failed_checks=sorted(failed))

    # -- event handling -------------------------------------------------------------------------

    async def _handle(self, outcome: _Outcome) -> list[HealthEvent]:
        events = self._map_event(outcome.event) if outcome.event is not None else []
        if outcome.error is not None:
            lost = await self._nvml.run_health(self._probe_lost_sync)
            if not lost:
                log.warning("NVML event wait failed", extra=log_fields(error=str(outcome.error)))
                # Do not spin on a persistent error.
                await anyio.sleep(self._wait_ms / 1000)
                return events
            for gpu in lost:
                events.extend(self._lost_events(gpu, f"GPU is lost: {outcome.error}"))
            events.extend(await self._nvml.run_health(self._rebuild_sync))
        return events

    def _map_event(self, raw: RawEvent) -> list[HealthEvent]:
        lib = self._lib
        gpu = self._gpus.get(raw.gpu_uuid)
        if gpu is None:
            return []
        targets = self._targets(gpu, raw)
        now = self._clock.time()
        if raw.event_type & int(getattr(lib, "nvmlEventTypeXidCriticalError", 0x8)):
            xid = raw.data
            self.state.last_xid[gpu.uuid] = xid
            severity = self._policy.severity(xid)
            message = "application error (informational)" if severity is Severity.INFO else "GPU error"
            log.log(
                logging.INFO if severity is Severity.INFO else logging.ERROR,
                "XID event",
                extra=log_fields(gpu=gpu.uuid, xid=xid, devices=",".join(d.name for d in targets)),
            )
            return self._conditions(
                gpu, targets, condition=XID, severity=severity, value=str(xid), message=message, now=now
            )
        if raw.event_type & int(getattr(lib, "nvmlEventTypeDoubleBitEccError", 0x2)):
            log.error("uncorrectable ECC error", extra=log_fields(gpu=gpu.uuid))
            return self._conditions(
                gpu,
                targets,
                condition=ECC_UNCORRECTABLE,
                severity=Severity.CRITICAL,
                value="",
                message="double-bit ECC error",
                now=now,
            )
        if raw.event_type & int(getattr(lib, "nvmlEventTypeSingleBitEccError", 0x1)):
            return self._conditions(
                gpu,
                targets,
                condition=ECC_CORRECTABLE,
                severity=Severity.INFO,
                value="",
                message="single-bit ECC error (corrected)",
                now=now,
            )
        return []

    def _targets(self, gpu: GpuInfo, raw: RawEvent) -> list[NvDevice]:
        devices = self.devices_of(gpu.uuid)
        if not gpu.mig_enabled or raw.gpu_instance_id == INVALID_INSTANCE_ID:
            return devices
        matched = [
            d
            for d in devices
            if d.mig is not None
            and d.mig.gpu_instance_id == raw.gpu_instance_id
            and raw.compute_instance_id in (INVALID_INSTANCE_ID, d.mig.compute_instance_id)
        ]
        # An event for an instance we do not publish still concerns the GPU.
        return matched or devices

    def _conditions(
        self,
        gpu: GpuInfo,
        targets: Iterable[NvDevice],
        *,
        condition: str,
        severity: Severity,
        value: str,
        message: str,
        now: float,
    ) -> list[HealthEvent]:
        events = [
            HealthEvent(d.name, condition, severity, value, message, ConditionKind.EVENT, at=now)
            for d in targets
        ]
        checks = self.state.checks.get(gpu.uuid)
        if severity is Severity.CRITICAL and (
            checks is None or RECOVERY_ACTION_CHECK not in checks.unsupported
        ):
            keys = self._faulted.setdefault(gpu.uuid, set())
            keys.update((e.device, e.condition, e.value) for e in events)
            if checks is not None and checks.recovery_action not in (None, RECOVERY_NONE):
                # The driver already asks for an action: its return to NONE ends this fault too.
                self._recovering.add(gpu.uuid)
        return events

    def _lost_events(self, gpu: GpuInfo, message: str) -> list[HealthEvent]:
        if gpu.uuid not in self.state.lost:
            self.state.lost.add(gpu.uuid)
            log.error("GPU lost", extra=log_fields(gpu=gpu.uuid, hint="reset the GPU or reboot the node"))
        return self._state_events(gpu, GPU_LOST, Severity.CRITICAL, message)

    def _unmonitored(self, gpu: GpuInfo, message: str) -> list[HealthEvent]:
        if gpu.uuid not in self.state.unmonitored:
            self.state.unmonitored.add(gpu.uuid)
            log.warning("GPU health is not monitored", extra=log_fields(gpu=gpu.uuid, reason=message))
        return self._state_events(gpu, UNMONITORED, Severity.WARNING, message)

    def _cleared(self, gpu: GpuInfo, condition: str, severity: Severity, message: str) -> list[HealthEvent]:
        """Clear `condition` (``gpu-lost`` or ``unmonitored``) of `gpu` when it is set."""
        states = self.state.lost if condition == GPU_LOST else self.state.unmonitored
        if gpu.uuid not in states:
            return []
        states.discard(gpu.uuid)
        log.info(message, extra=log_fields(gpu=gpu.uuid, condition=condition))
        return [replace(e, cleared=True) for e in self._state_events(gpu, condition, severity, message)]

    def _state_events(
        self, gpu: GpuInfo, condition: str, severity: Severity, message: str
    ) -> list[HealthEvent]:
        now = self._clock.time()
        return [
            HealthEvent(d.name, condition, severity, "", message, ConditionKind.STATE, at=now)
            for d in self.devices_of(gpu.uuid)
        ]
