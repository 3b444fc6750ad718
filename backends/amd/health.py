"""Health of AMD GPUs: amdsmi event notifications plus a health pass on an interval.

Two tasks run side by side until cancelled:

- events (`backends.amd.events`): GPU resets, ring hangs, thermal throttling, VM faults;
- the health pass, every ``poll-interval`` (default: the agent's ``--health-interval``), over
  every physical GPU (`backends.amd.checks` reads it; `agent.core.backend.PollsHealth`):

  - ``answers``: a GPU whose calls to the device fail with a lost status (DRM_ERROR from the
    ioctl behind its VRAM usage) -> ``gpu-lost`` (critical STATE) until it answers again; so
    does a lost status that telemetry or rediscovery met (the GPU is then
    "suspect"), so that no loss goes unreported;
  - ``ecc-uncorrectable``: the uncorrectable count per RAS block rising -> ``ecc-uncorrectable``
    (critical EVENT, the block as value; it recovers after the hold time); RAS unavailable ->
    ``unmonitored`` with value ``ras``;
  - ``bad-pages``: VRAM pages pending retirement -> ``bad-pages`` (warning STATE); as many bad
    pages as the driver's threshold -> ``bad-pages`` (critical); cleared when no longer so;
  - ``cper``: fatal CPER records younger than ``cper-max-age`` -> ``cper-fatal`` (older records,
    e.g. kept across reboots, gave AMD false positives);
  - trends (informational STATE conditions, cleared when back under the threshold):
    ``ecc-correctable-rate`` and ``pcie-replay-rate`` (per minute over ``trend-window``, above the
    settings of the same names), ``xgmi-errors`` (the XGMI error status says errors).

  A check the GPU does not support is skipped with one log line; a check whose call hangs or fails
  is reported to the core as a failed check (`report_pass`), never as the GPU failing, and the
  GPU is left out of the devices the pass looked at.

When events or RAS are unavailable (a VM guest, an old kernel) the devices get ``unmonitored``
(a warning STATE) with value ``events`` or ``ras``, cleared when monitoring works again.
Resets, RAS and loss are per physical GPU and fan out to all its partitions.

What is set (lost, unmonitored, bad pages, trends, the ECC baselines) is kept in `HealthMemory`,
which outlives one monitor: the monitor started after a rediscovery clears what its predecessor
set. Every amdsmi call is bounded; a cancelled event read is not waited for, but the readers are
stopped only once the read in flight has returned.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from agent.core.backend import (
    DEFAULT_HEALTH_INTERVAL,
    GPU_LOST,
    ConditionKind,
    HealthEvent,
    HealthSink,
    report_alive,
    report_pass,
)
from agent.core.clock import Clock
from agent.core.logs import log_fields
from agent.core.model import Severity
from agent.core.vendorcall import VendorCallTimeoutError
from backends.amd.checks import (
    ANSWERS,
    BAD_PAGES,
    ECC_CORRECTABLE_RATE,
    ECC_UNCORRECTABLE,
    PCIE_REPLAY_RATE,
    STEP_CHECKS,
    XGMI_ERRORS,
    EccTotals,
    GpuReading,
    Progress,
    ReadPlan,
    read_gpu,
)
from backends.amd.discovery import DeviceEntry
from backends.amd.events import (
    EVENT_CONDITIONS,
    GPU_RESET,
    RING_HANG,
    THERMAL_THROTTLE,
    UNMONITORED,
    VM_FAULT,
    EventState,
    EventWatcher,
)
from backends.amd.smi import SmiLibrary
from backends.amd.trends import RateWindow

log = logging.getLogger("agent.backends.amd")

CPER_FATAL = "cper-fatal"
__all__ = ["EVENT_CONDITIONS", "HealthMemory", "HealthMonitor", "HealthSettings"]
TRENDS = (ECC_CORRECTABLE_RATE, PCIE_REPLAY_RATE, XGMI_ERRORS)
"""Conditions that precede failures (the backend's `trend_conditions`): informational."""
CONDITIONS = (
    GPU_RESET,
    RING_HANG,
    VM_FAULT,
    THERMAL_THROTTLE,
    ECC_UNCORRECTABLE,
    CPER_FATAL,
    GPU_LOST,
    UNMONITORED,
    BAD_PAGES,
    *TRENDS,
)
"""Every condition this monitor reports (the backend's `health_conditions`)."""
XGMI_STATUS = {1: "an error", 2: "multiple errors"}  # amdsmi_xgmi_status_t


@dataclass(frozen=True)
class HealthSettings:
    """Knobs of the health monitor (backend settings ``poll-interval``, ``cper-max-age``...)."""

    poll_interval: float = DEFAULT_HEALTH_INTERVAL
    event_timeout_ms: int = 200
    cper_max_age: float = 3600.0
    trend_window: float = 60.0
    """Seconds over which the trend rates are measured."""
    ecc_correctable_rate: float = 1.0
    """Correctable ECC errors per minute above which ``ecc-correctable-rate`` is raised."""
    pcie_replay_rate: float = 8.0
    """PCIe replays per minute above which ``pcie-replay-rate`` is raised."""


EccCounts = dict[str, dict[str, int]]
"""Uncorrectable ECC counts by GPU key and RAS block, as last read."""


@dataclass
class _GpuState:
    ecc: dict[str, int] = field(default_factory=dict)
    lost: bool = False
    ras_unmonitored: bool = False
    cper_cursor: int = 0
    unavailable: set[str] = field(default_factory=set)
    """Checks this GPU cannot answer (logged once, skipped since)."""
    ecc_totals: EccTotals | None = None
    """The last pass's ECC sums, which telemetry reports instead of reading them again."""
    bad_pages: Severity | None = None
    trends: set[str] = field(default_factory=set)
    """The trend conditions raised on this GPU."""
    rates: dict[str, RateWindow] = field(default_factory=dict)


@dataclass
class HealthMemory:
    """What outlives one `HealthMonitor`: per physical GPU state, and whether events are unavailable."""

    gpus: dict[str, _GpuState] = field(default_factory=dict)
    events: EventState = field(default_factory=EventState)
    suspects: dict[str, str] = field(default_factory=dict)
    """GPUs another call (telemetry, rediscovery) found gone, with why: the next pass reports them."""

    @classmethod
    def with_ecc_counts(cls, counts: EccCounts) -> HealthMemory:
        """Memory holding the ECC counts an earlier agent process of this boot read: errors since
        then are new, not a baseline."""
        return cls(gpus={key: _GpuState(ecc=dict(blocks)) for key, blocks in counts.items()})

    def ecc_counts(self) -> EccCounts:
        """The last ECC count per GPU and block (a copy)."""
        return {key: dict(state.ecc) for key, state in self.gpus.items() if state.ecc}

    def ecc_totals(self) -> dict[str, EccTotals]:
        """The ECC sums the last pass read, by GPU key (GPUs without a reading left out)."""
        return {key: state.ecc_totals for key, state in self.gpus.items() if state.ecc_totals is not None}

    def suspect(self, gpu_key: str, why: str) -> None:
        """Another call met a lost status on this GPU: the next pass reports it lost."""
        if gpu_key not in self.suspects:
            log.warning("GPU answered with a lost status", extra=log_fields(gpu=gpu_key, error=why))
        self.suspects[gpu_key] = why


@dataclass(frozen=True)
class _Outcome:
    """What one GPU's part of a pass came to."""

    looked: bool
    failed: tuple[str, ...] = ()
    hung: bool = False


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
        for entry in entries:
            self._groups.setdefault(entry.gpu_key, []).append(entry)
        self._memory = memory or HealthMemory()
        self._generation = lib.generation
        self._state = {key: self._memory.gpus.setdefault(key, _GpuState()) for key in self._groups}
        self._events = EventWatcher(
            lib,
            self._groups,
            clock,
            self._memory.events,
            self._emit_all,
            poll_interval=settings.poll_interval,
            timeout_ms=settings.event_timeout_ms,
        )
        # The pass's call that hung (its worker thread still holds the health lane).
        self._stuck: Progress | None = None
        self._rate_limits = {
            ECC_CORRECTABLE_RATE: (settings.ecc_correctable_rate, "correctable ECC errors"),
            PCIE_REPLAY_RATE: (settings.pcie_replay_rate, "PCIe replays"),
        }

    async def run(self, sink: HealthSink) -> None:
        """Report health until cancelled."""
        while not self._groups:  # nothing to watch, but the monitor runs (and its passes are done)
            report_pass(sink, ())
            report_alive(sink)
            await self._clock.sleep(self._settings.poll_interval)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._events.run, sink)
            tg.start_soon(self._poll, sink)

    async def _emit_all(self, sink: HealthSink, names: Sequence[str], **kwargs: Any) -> None:
        for name in names:
            await sink(HealthEvent(device=name, **kwargs))

    # --- the health pass ---------------------------------------------------------------

    async def _poll(self, sink: HealthSink) -> None:
        while True:
            started = self._clock.monotonic()
            await self.poll_once(sink)
            report_alive(sink)
            # Passes start every interval, however long one took (a slow call eats into the wait).
            took = self._clock.monotonic() - started
            await self._clock.sleep(max(0.0, self._settings.poll_interval - took))

    async def poll_once(self, sink: HealthSink) -> None:
        """One health pass over every physical GPU, then `report_pass` with what it looked at."""
        looked: list[str] = []
        failed: set[str] = set()
        for key, entries in self._groups.items():
            outcome = await self._check_gpu(key, entries, sink)
            failed.update(outcome.failed)
            if outcome.looked:
                looked.extend(e.name for e in entries)
            if outcome.hung:
                # The hung call keeps the lane: the other GPUs' calls would only wait for it.
                break
        report_pass(sink, looked, failed_checks=sorted(failed))

    async def _check_gpu(self, key: str, entries: Sequence[DeviceEntry], sink: HealthSink) -> _Outcome:
        state = self._state[key]
        names = [e.name for e in entries]
        suspect = self._memory.suspects.pop(key, "")
        plan = ReadPlan(cper_cursor=state.cper_cursor, skip=frozenset(state.unavailable))
        progress = Progress()
        try:
            reading = await self._lib.run_health(
                self._reader(entries[0].primary, plan, progress), "health_pass"
            )
        except VendorCallTimeoutError as error:
            if suspect:
                self._memory.suspects.setdefault(key, suspect)
            return _Outcome(looked=False, failed=self._hung_checks(key, progress, error), hung=True)
        if reading is None:
            if suspect:
                self._memory.suspects.setdefault(key, suspect)
            return _Outcome(looked=False)
        if suspect and not reading.lost:
            # Telemetry or rediscovery met a lost status since the last pass: not a silent loss.
            reading = GpuReading(lost=suspect, cper_cursor=reading.cper_cursor)
        if reading.lost:
            await self._set_lost(key, names, state, reading.lost, sink)
            return _Outcome(looked=True)
        await self._set_lost(key, names, state, "", sink)
        for check, why in sorted(reading.unavailable.items()):
            state.unavailable.add(check)
            log.info(
                "health check not supported on this GPU; skipping it",
                extra=log_fields(gpu=key, check=check, reason=why),
            )
        failed = tuple(c for step in sorted(reading.failed) for c in STEP_CHECKS.get(step, (step,)))
        for step, why in sorted(reading.failed.items()):
            log.debug("health check failed", extra=log_fields(gpu=key, check=step, error=why))
        state.cper_cursor = reading.cper_cursor
        if ECC_UNCORRECTABLE not in reading.failed:
            await self._apply_ecc(key, names, state, reading, sink)
            if reading.ecc is not None:
                corrected = reading.ecc.totals.corrected
                await self._apply_rate(names, state, ECC_CORRECTABLE_RATE, corrected, sink)
        await self._apply_bad_pages(key, names, state, reading, sink)
        await self._apply_cper(key, names, reading, sink)
        if reading.pcie_replays is not None:
            await self._apply_rate(names, state, PCIE_REPLAY_RATE, reading.pcie_replays, sink)
        if reading.xgmi_status is not None:
            status = XGMI_STATUS.get(reading.xgmi_status, "errors") if reading.xgmi_status else ""
            await self._set_trend(
                names, state, XGMI_ERRORS, f"the XGMI link reports {status}" if status else "", sink
            )
        return _Outcome(looked=not failed, failed=failed)

    def _reader(self, handle: Any, plan: ReadPlan, progress: Progress) -> Callable[[Any], GpuReading | None]:
        """The pass's blocking read of one GPU; it answers None when amdsmi was re-initialised since
        this monitor started (its handles are no longer amdsmi's: the monitor is being replaced)."""
        lib, generation = self._lib, self._generation

        def read(smi: Any) -> GpuReading | None:
            if lib.generation != generation:
                return None
            return read_gpu(smi, handle, plan, progress)

        return read

    def _hung_checks(self, key: str, progress: Progress, error: VendorCallTimeoutError) -> tuple[str, ...]:
        """The checks to report failed for a pass call that did not return (or could not start)."""
        stuck = self._stuck
        if progress.started:
            step = progress.step
            self._stuck = progress
            log.warning(
                "a health check did not return; the GPU is not counted as checked",
                extra=log_fields(gpu=key, check=step, error=str(error)),
            )
        elif stuck is not None and not stuck.done:
            step = stuck.step  # the lane is still held by the call that hung before
        else:
            step = ANSWERS
        return STEP_CHECKS.get(step, (step,))

    async def _set_lost(
        self, key: str, names: Sequence[str], state: _GpuState, why: str, sink: HealthSink
    ) -> None:
        if bool(why) == state.lost:
            return
        state.lost = bool(why)
        if why:
            log.error("GPU lost", extra=log_fields(gpu=key, error=why))
            # Its counters may restart when it comes back: the rates start over, telemetry has none.
            for window in state.rates.values():
                window.reset()
            state.ecc_totals = None
        else:
            log.warning("GPU answers again", extra=log_fields(gpu=key))
        await self._emit_all(
            sink,
            names,
            condition=GPU_LOST,
            severity=Severity.CRITICAL,
            message=f"GPU stopped answering: {why}" if why else "",
            kind=ConditionKind.STATE,
            cleared=not why,
        )

    async def _apply_ecc(
        self, key: str, names: Sequence[str], state: _GpuState, reading: GpuReading, sink: HealthSink
    ) -> None:
        if reading.ecc is None:
            if not reading.ras_problem:  # the step did not run
                return
            state.ecc_totals = None
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
        state.ecc_totals = reading.ecc.totals
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
        for block, count in sorted(reading.ecc.uncorrectable.items()):
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

    async def _apply_bad_pages(
        self, key: str, names: Sequence[str], state: _GpuState, reading: GpuReading, sink: HealthSink
    ) -> None:
        pages = reading.bad_pages
        if pages is None:  # skipped, unavailable or failed: the last verdict stands
            return
        severity: Severity | None = None
        message = ""
        if pages.threshold is not None and pages.total >= pages.threshold:
            severity = Severity.CRITICAL
            message = (
                f"{pages.total} bad VRAM pages reach the driver's threshold of {pages.threshold}: "
                "the GPU needs replacing"
            )
        elif pages.pending:
            severity = Severity.WARNING
            message = f"{pages.pending} bad VRAM pages pending retirement (a GPU reset retires them)"
        if severity == state.bad_pages:
            return
        previous, state.bad_pages = state.bad_pages, severity
        log.log(
            logging.INFO if severity is None else logging.WARNING,
            "bad VRAM pages" if severity else "bad VRAM pages no longer pending",
            extra=log_fields(gpu=key, total=pages.total, pending=pages.pending, threshold=pages.threshold),
        )
        await self._emit_all(
            sink,
            names,
            condition=BAD_PAGES,
            severity=severity or previous or Severity.WARNING,
            message=message,
            kind=ConditionKind.STATE,
            cleared=severity is None,
        )

    async def _apply_cper(
        self, key: str, names: Sequence[str], reading: GpuReading, sink: HealthSink
    ) -> None:
        now = self._clock.time()
        for record in reading.cper:
            if now - record.at > self._settings.cper_max_age:
                log.info(
                    "old fatal CPER record ignored",
                    extra=log_fields(gpu=key, record=record.record, age=now - record.at),
                )
                continue
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(record.at))
            await self._emit_all(
                sink,
                names,
                condition=CPER_FATAL,
                severity=Severity.CRITICAL,
                value=record.notify.lower()[:63],
                message=f"fatal CPER record {record.record} at {stamp}",
            )

    async def _apply_rate(
        self, names: Sequence[str], state: _GpuState, condition: str, count: int, sink: HealthSink
    ) -> None:
        window = state.rates.setdefault(condition, RateWindow(self._settings.trend_window))
        rate = window.add(self._clock.monotonic(), count)
        if rate is None:  # not a whole window yet: no verdict
            return
        threshold, what = self._rate_limits[condition]
        message = ""
        if rate > threshold:
            span = self._settings.trend_window
            message = f"{rate:.1f} {what} per minute over the last {span:g} s (threshold {threshold:g})"
        await self._set_trend(names, state, condition, message, sink)

    async def _set_trend(
        self, names: Sequence[str], state: _GpuState, condition: str, message: str, sink: HealthSink
    ) -> None:
        """Raise `condition` (a trend: informational STATE) with `message`, or clear it when ""."""
        if bool(message) == (condition in state.trends):
            return
        if message:
            state.trends.add(condition)
            log.info(
                "GPU trend", extra=log_fields(devices=",".join(names), condition=condition, detail=message)
            )
        else:
            state.trends.discard(condition)
        await self._emit_all(
            sink,
            names,
            condition=condition,
            severity=Severity.INFO,
            message=message,
            kind=ConditionKind.STATE,
            cleared=not message,
        )
