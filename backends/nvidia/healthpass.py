"""What one health pass found, as conditions (`PassResults`, the NVIDIA `HealthMonitor`'s half that
interprets a `GpuReading`; the monitor itself reads events and runs the pass).

- a rise of the volatile uncorrectable ECC counter -> ``ecc-uncorrectable`` (EVENT), the first read
  being the baseline and a drop a new one;
- retired pages pending, row remap failure / pending, a recovery action other than NONE -> STATE
  conditions raised and cleared on change (the first pass after a start raises what holds);
- trends over their thresholds -> informational STATE conditions;
- a check the GPU does not support -> skipped from then on, with one line (row remapping on a
  GPU in MIG mode excepted: nvml.h answers NOT_SUPPORTED while MIG is on, so it is asked again);
  a check that failed -> one warning per episode, never a condition on the GPU.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Iterable

from agent.core.backend import ConditionKind, HealthEvent
from agent.core.clock import Clock
from agent.core.logs import log_fields
from agent.core.model import Severity
from backends.nvidia.checks import (
    ECC_CORRECTABLE_RATE,
    NVLINK_ERRORS,
    PCIE_REPLAY_RATE,
    RECOVERY_ACTION,
    RECOVERY_ACTION_CHECK,
    RECOVERY_ACTIONS,
    RECOVERY_NONE,
    RETIRED_PAGES_PENDING,
    ROW_REMAP,
    ROW_REMAP_FAILURE,
    ROW_REMAP_PENDING,
    EccCounts,
    GpuChecks,
    GpuReading,
    TrendThresholds,
)
from backends.nvidia.discovery import GpuInfo, NvDevice

log = logging.getLogger("agent.backends.nvidia.health")

ECC_UNCORRECTABLE = "ecc-uncorrectable"


class PassResults(abc.ABC):
    """Turns a health pass's readings into `HealthEvent`s; mixed into `HealthMonitor`."""

    _clock: Clock
    _thresholds: TrendThresholds
    _faulted: dict[str, set[tuple[str, str, str]]]
    """GPUs with an active XID/ECC condition whose recovery action is watched."""
    _recovering: set[str]
    """GPUs whose recovery action was seen other than NONE since their fault."""

    @abc.abstractmethod
    def devices_of(self, gpu_uuid: str) -> list[NvDevice]:
        """The published devices of one GPU (the GPU or its MIG devices)."""

    @abc.abstractmethod
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
        """EVENT conditions on `targets`, remembered for the recovery action."""

    def _check_failed(self, uuid: str, checks: GpuChecks, check: str, why: str) -> None:
        if check in checks.failing:
            return
        checks.failing.add(check)
        log.warning(
            "GPU health check failed: the GPU is left out of this pass, not marked",
            extra=log_fields(gpu=uuid, check=check, error=why),
        )

    def _apply(self, gpu: GpuInfo, checks: GpuChecks, reading: GpuReading) -> list[HealthEvent]:
        """Turn one GPU's reading into conditions; remember baselines and what was raised."""
        uuid = gpu.uuid
        for check, why in reading.unsupported.items():
            if check == ROW_REMAP and gpu.mig_enabled:
                # nvml.h:8438-8453: NOT_SUPPORTED "if MIG is enabled": not now, asked again at the
                # next pass (MIG mode may be turned off; dynamic MIG keeps it on).
                continue
            if check not in checks.unsupported:
                checks.unsupported.add(check)
                checks.failing.discard(check)
                log.info(
                    "GPU health check not supported: skipped for this GPU from now on",
                    extra=log_fields(gpu=uuid, check=check, reason=why),
                )
                if check == RECOVERY_ACTION_CHECK:
                    # No recovery reports: the taint policy's hold time ends its faults.
                    self._faulted.pop(uuid, None)
                    self._recovering.discard(uuid)
        for check, why in reading.failed.items():
            self._check_failed(uuid, checks, check, why)
        if reading.links is not None:
            checks.links, checks.links_at = reading.links, self._clock.monotonic()
        elif NVLINK_ERRORS in reading.failed:
            checks.links = None  # a link may have gone: ask the states again
        for check in sorted(checks.failing - reading.failed.keys()):
            checks.failing.discard(check)
            log.info("GPU health check works again", extra=log_fields(gpu=uuid, check=check))
        now = self._clock.time()
        events: list[HealthEvent] = []
        before = checks.ecc
        rose = before.uncorrected is not None and (reading.ecc_uncorrected or 0) > before.uncorrected
        if rose:
            log.error(
                "uncorrectable ECC errors counted",
                extra=log_fields(gpu=uuid, before=before.uncorrected, now=reading.ecc_uncorrected),
            )
            events.extend(
                self._conditions(
                    gpu,
                    self.devices_of(uuid),
                    condition=ECC_UNCORRECTABLE,
                    severity=Severity.CRITICAL,
                    value="",
                    message=(
                        f"uncorrectable ECC errors: volatile count {before.uncorrected} -> "
                        f"{reading.ecc_uncorrected}"
                    ),
                    now=now,
                )
            )
        # A counter that went down was reset (GPU reset): the new reading is the new baseline.
        checks.ecc = EccCounts(
            reading.ecc_corrected if reading.ecc_corrected is not None else before.corrected,
            reading.ecc_uncorrected if reading.ecc_uncorrected is not None else before.uncorrected,
        )
        if reading.retired_pending is not None:
            events.extend(
                self._state(
                    gpu,
                    checks,
                    RETIRED_PAGES_PENDING,
                    Severity.WARNING,
                    reading.retired_pending,
                    message="retired pages pending: reset the GPU or reboot the node to retire them",
                )
            )
        rows = reading.row_remap
        if rows is not None:
            events.extend(
                self._state(
                    gpu,
                    checks,
                    ROW_REMAP_FAILURE,
                    Severity.CRITICAL,
                    rows.failure,
                    message=f"row remapping failed ({rows.uncorrectable} rows remapped for uncorrectable "
                    "errors): the GPU needs service",
                )
            )
            events.extend(
                self._state(
                    gpu,
                    checks,
                    ROW_REMAP_PENDING,
                    Severity.WARNING,
                    rows.pending,
                    message="row remapping pending: reset the GPU to apply it",
                )
            )
        if reading.recovery_action is not None:
            events.extend(self._apply_recovery(gpu, checks, reading.recovery_action))
        mono = self._clock.monotonic()
        for trend, value in (
            (ECC_CORRECTABLE_RATE, reading.ecc_corrected),
            (PCIE_REPLAY_RATE, reading.pcie_replays),
            (NVLINK_ERRORS, reading.nvlink_errors),
        ):
            if value is None:
                continue
            rate = checks.rate(trend, mono, value)
            if rate is None:
                continue
            threshold = self._thresholds.of(trend)
            events.extend(
                self._state(
                    gpu,
                    checks,
                    trend,
                    Severity.INFO,
                    rate > threshold,
                    message=f"{rate:.1f} errors per minute over the last minute (threshold {threshold:g})",
                )
            )
        return events

    def _apply_recovery(self, gpu: GpuInfo, checks: GpuChecks, action: int) -> list[HealthEvent]:
        """The ``recovery-action`` state, and the end of XID/ECC faults when the action is back to NONE."""
        uuid = gpu.uuid
        checks.recovery_action = action
        events = self._state(
            gpu,
            checks,
            RECOVERY_ACTION,
            Severity.CRITICAL,
            action != RECOVERY_NONE,
            value=RECOVERY_ACTIONS.get(action, str(action)),
            message="the driver asks for a recovery action"
            if action != RECOVERY_NONE
            else "recovery action is none",
        )
        keys = self._faulted.get(uuid)
        if keys is None:
            return events
        if action != RECOVERY_NONE:
            self._recovering.add(uuid)
            return events
        del self._faulted[uuid]
        if uuid not in self._recovering:
            # NONE from the start: the driver asks for nothing; the hold time applies.
            return events
        self._recovering.discard(uuid)
        log.info("GPU recovered (recovery action none)", extra=log_fields(gpu=uuid))
        now = self._clock.time()
        events.extend(
            HealthEvent(
                device,
                condition,
                Severity.CRITICAL,
                value,
                "recovery action is none",
                ConditionKind.EVENT,
                cleared=True,
                at=now,
            )
            for device, condition, value in sorted(keys)
        )
        return events

    def _state(
        self,
        gpu: GpuInfo,
        checks: GpuChecks,
        condition: str,
        severity: Severity,
        active: bool,
        *,
        message: str,
        value: str = "",
    ) -> list[HealthEvent]:
        """Raise or clear a STATE condition the pass owns, on every device of `gpu`, on change only."""
        raised = checks.raised.get(condition)
        if active and raised == value:
            return []
        if not active and raised is None:
            return []
        now = self._clock.time()
        names = [d.name for d in self.devices_of(gpu.uuid)]
        events: list[HealthEvent] = []
        if raised is not None:
            # Cleared with the value it was raised with (a new value is a new condition).
            del checks.raised[condition]
            log.info("GPU condition ended", extra=log_fields(gpu=gpu.uuid, condition=condition, value=raised))
            events.extend(
                HealthEvent(
                    n, condition, severity, raised, message, ConditionKind.STATE, cleared=True, at=now
                )
                for n in names
            )
        if active:
            checks.raised[condition] = value
            log.log(
                logging.INFO if severity is Severity.INFO else logging.WARNING,
                "GPU condition",
                extra=log_fields(gpu=gpu.uuid, condition=condition, value=value, detail=message),
            )
            events.extend(
                HealthEvent(n, condition, severity, value, message, ConditionKind.STATE, at=now)
                for n in names
            )
        return events
