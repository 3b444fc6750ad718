"""The NVIDIA health pass: what NVML's counters and states say, read on an interval.

Events alone miss faults: a GPU can be lost with no XID (every getter answers GPU_IS_LOST while
event waits keep timing out), and many GPUs report no ECC events at all (supported event types
XID only), so their uncorrectable errors show only in the counters. Every ``--health-interval``
seconds the monitor (`backends.nvidia.health`) reads, for each physical GPU, in its own vendor
lane (one bounded call per GPU):

========================= ===================================================================
check                     reads -> condition (on the GPU and all its MIG devices)
========================= ===================================================================
``answers``               a cheap getter (``nvmlDeviceGetUUID``; a suspect GPU also by UUID):
                          GPU_IS_LOST / GPU_NOT_FOUND / RESET_REQUIRED -> ``gpu-lost``
``ecc-uncorrectable``     volatile uncorrected ECC total: a rise -> ``ecc-uncorrectable``
``retired-pages``         retired pages pending -> ``retired-pages-pending``
``row-remap``             remapped rows: failure -> ``row-remap-failure``, pending ->
                          ``row-remap-pending``
``recovery-action``       ``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`` not NONE -> ``recovery-action``
``ecc-correctable-rate``  volatile corrected ECC total per minute -> ``ecc-correctable-rate``
``pcie-replay-rate``      PCIe replay counter per minute -> ``pcie-replay-rate``
``nvlink-errors``         DL replay + recovery + CRC-flit errors of active links per minute ->
                          ``nvlink-errors``
========================= ===================================================================

A check the GPU cannot do (NOT_SUPPORTED, FUNCTION_NOT_FOUND) is skipped for that GPU from then
on, with one info line. A check whose call fails otherwise, or hangs past the call bound, failed
(`report_pass`'s ``failed_checks``, a warning once per episode): never a condition on the GPU.

This module holds the blocking reads (`read_gpu_sync`, worker thread) and the state that outlives
one monitor (`GpuChecks`); the monitor turns readings into `HealthEvent`s.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from agent.core.errors import ConfigError
from backends.nvidia.lostgpu import fresh_handle
from backends.nvidia.nvml import Nvml, text

# Check names (`PollsHealth.health_checks`).
ANSWERS = "answers"
ECC_UNCORRECTABLE_CHECK = "ecc-uncorrectable"
RETIRED_PAGES = "retired-pages"
ROW_REMAP = "row-remap"
RECOVERY_ACTION_CHECK = "recovery-action"
ECC_CORRECTABLE_RATE = "ecc-correctable-rate"
PCIE_REPLAY_RATE = "pcie-replay-rate"
NVLINK_ERRORS = "nvlink-errors"
CHECKS = (
    ANSWERS,
    ECC_UNCORRECTABLE_CHECK,
    RETIRED_PAGES,
    ROW_REMAP,
    RECOVERY_ACTION_CHECK,
    ECC_CORRECTABLE_RATE,
    PCIE_REPLAY_RATE,
    NVLINK_ERRORS,
)

# Conditions the pass adds to those of the event monitor.
RETIRED_PAGES_PENDING = "retired-pages-pending"
ROW_REMAP_FAILURE = "row-remap-failure"
ROW_REMAP_PENDING = "row-remap-pending"
RECOVERY_ACTION = "recovery-action"
TRENDS = (ECC_CORRECTABLE_RATE, PCIE_REPLAY_RATE, NVLINK_ERRORS)
"""Trend conditions (`ReportsTrends`): informational, raised while a rate is over its threshold."""
PASS_CONDITIONS = (RETIRED_PAGES_PENDING, ROW_REMAP_FAILURE, ROW_REMAP_PENDING, RECOVERY_ACTION, *TRENDS)

TREND_WINDOW = 60.0
"""Seconds a trend's rate is counted over: errors in the last minute, never extrapolated from a
shorter time (one error in a 5 s pass is not 12 per minute)."""

# NVML_GPU_RECOVERY_ACTION_* -> the condition's value.
RECOVERY_ACTIONS = {
    1: "gpu-reset",
    2: "node-reboot",
    3: "drain-p2p",
    4: "drain-and-reset",
    5: "recover-imex-domain",
    6: "bus-reset",
    7: "system-reboot",
}
RECOVERY_NONE = 0

# Settings (``--backend nvidia:...``) and defaults, in errors per minute.
RATE_SETTINGS = {
    "ecc-correctable-rate": 10.0,
    "pcie-replay-rate": 100.0,
    "nvlink-error-rate": 10.0,
}


def _rate(settings: Mapping[str, str], key: str) -> float:
    raw = settings.get(key)
    if raw is None or raw.strip() == "":
        return RATE_SETTINGS[key]
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ConfigError(
            f"nvidia setting {key}",
            raw,
            f"a finite number of errors per minute >= 0, such as {RATE_SETTINGS[key]:g}",
        )
    return value


@dataclass(frozen=True)
class TrendThresholds:
    """Errors per minute above which a trend condition is raised (cleared once at or below)."""

    ecc_correctable: float = RATE_SETTINGS["ecc-correctable-rate"]
    pcie_replay: float = RATE_SETTINGS["pcie-replay-rate"]
    nvlink: float = RATE_SETTINGS["nvlink-error-rate"]

    @classmethod
    def from_settings(cls, settings: Mapping[str, str]) -> TrendThresholds:
        """Read and validate the settings; `ConfigError` names the bad one and what is accepted."""
        return cls(
            _rate(settings, "ecc-correctable-rate"),
            _rate(settings, "pcie-replay-rate"),
            _rate(settings, "nvlink-error-rate"),
        )

    def of(self, trend: str) -> float:
        return {
            ECC_CORRECTABLE_RATE: self.ecc_correctable,
            PCIE_REPLAY_RATE: self.pcie_replay,
            NVLINK_ERRORS: self.nvlink,
        }[trend]


@dataclass(frozen=True)
class EccCounts:
    """The volatile ECC totals of one GPU as the last pass read them (None: not readable)."""

    corrected: int | None = None
    uncorrected: int | None = None


@dataclass(frozen=True)
class RowRemap:
    """``nvmlDeviceGetRemappedRows``: (corrRows, uncRows, isPending, failureOccurred)."""

    correctable: int
    uncorrectable: int
    pending: bool
    failure: bool


@dataclass
class GpuReading:
    """What one pass read of one GPU (filled in the worker thread)."""

    lost: str = ""
    """Why the GPU is lost ("" when it answers)."""
    handle: Any = None
    """A fresh handle, when the GPU was looked up by UUID (a suspect GPU)."""
    ecc_uncorrected: int | None = None
    ecc_corrected: int | None = None
    retired_pending: bool | None = None
    row_remap: RowRemap | None = None
    recovery_action: int | None = None
    pcie_replays: int | None = None
    nvlink_errors: int | None = None
    links: tuple[int, ...] | None = None
    """The active NVLinks, when this pass asked their states."""
    unsupported: dict[str, str] = field(default_factory=dict)
    """Check -> the NVML error that says the GPU cannot do it."""
    failed: dict[str, str] = field(default_factory=dict)
    """Check -> the NVML error it failed with."""
    current: str = ""
    """The check in progress: the one to blame when the call hangs past its bound."""

    def done(self, check: str) -> bool:
        return check not in self.unsupported and check not in self.failed


@dataclass
class GpuChecks:
    """One GPU's pass state; it outlives a monitor (kept in `HealthState`), so baselines and what a
    pass raised survive a rediscovery that restarts the monitor."""

    unsupported: set[str] = field(default_factory=set)
    failing: set[str] = field(default_factory=set)
    """Checks in a failure episode (warned once)."""
    ecc: EccCounts = EccCounts()
    raised: dict[str, str] = field(default_factory=dict)
    """STATE conditions the pass raised and has not cleared -> their value."""
    samples: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    """Trend -> (monotonic time, counter) readings over the last `TREND_WINDOW`."""
    recovery_action: int | None = None
    links: tuple[int, ...] | None = None
    links_at: float = 0.0
    """When `links` were read (monotonic): they are read again after `TREND_WINDOW`."""

    def rate(self, trend: str, now: float, value: int) -> float | None:
        """Errors per minute of `trend` over the last minute; None until two readings exist."""
        samples = self.samples.setdefault(trend, [])
        if samples and value < samples[-1][1]:
            samples.clear()  # the counter was reset (GPU reset, driver reload): a new baseline
        samples.append((now, value))
        # Keep the newest reading at or before the window's start as its base.
        while len(samples) >= 2 and samples[1][0] <= now - TREND_WINDOW:
            samples.pop(0)
        if len(samples) < 2:
            return None
        start, base = samples[0]
        return (value - base) * 60.0 / max(now - start, TREND_WINDOW)


@dataclass(frozen=True)
class GpuAsk:
    """What to read of one GPU in one pass."""

    uuid: str
    handle: Any = field(compare=False, repr=False)
    skip: frozenset[str] = frozenset()
    """Checks this GPU does not support."""
    suspect: bool = False
    """Another call met GPU_IS_LOST on it: look it up afresh by UUID."""
    links: tuple[int, ...] | None = None
    """The active NVLinks as a recent pass found them; None: ask each link's state."""
    index: int = -1
    """The GPU's NVML index (a suspect is asked by it when the UUID lookup answers for another GPU)."""


class _Lost(Exception):
    """The GPU is gone: stop reading it."""


def read_gpu_sync(nvml: Nvml, ask: GpuAsk, reading: GpuReading) -> GpuReading:
    """Read every check of one GPU not in `ask.skip` into `reading` (blocking; worker thread).

    `reading` is the caller's, so that a call that hangs past its bound leaves in
    `reading.current` the check to blame.
    """
    with contextlib.suppress(_Lost):
        _read(nvml, ask, reading)
    reading.current = ""
    return reading


def _call(nvml: Nvml, reading: GpuReading, check: str, func: Any, *args: Any) -> Any:
    """`func(*args)` for `check`; None (noted in `reading`) when unsupported or failed."""
    try:
        return func(*args)
    except Exception as error:
        if not nvml.is_error(error):
            raise
        if nvml.is_gpu_lost(error):
            reading.lost = f"{check}: {error}"
            raise _Lost from error
        if nvml.is_unsupported(error):
            reading.unsupported.setdefault(check, str(error))
        else:
            reading.failed.setdefault(check, str(error))
        return None


def _read(nvml: Nvml, ask: GpuAsk, reading: GpuReading) -> None:
    lib = nvml.lib
    uuid, handle, skip = ask.uuid, ask.handle, ask.skip
    reading.current = ANSWERS
    if ask.suspect:
        # Another call met GPU_IS_LOST: ask NVML afresh (a stale handle may still answer).
        try:
            handle = reading.handle = fresh_handle(nvml, uuid, ask.index, handle)
        except Exception as error:
            if nvml.is_error(error) and nvml.is_not_found(error):
                reading.lost = f"{ANSWERS}: no GPU with this UUID any more: {error}"
                raise _Lost from error
            _call(nvml, reading, ANSWERS, _raise, error)
    found = _call(nvml, reading, ANSWERS, lib.nvmlDeviceGetUUID, handle)
    if found is not None and text(found) != uuid:
        reading.failed[ANSWERS] = f"the handle answers for {text(found)}, not {uuid}"
    volatile = int(getattr(lib, "NVML_VOLATILE_ECC", 0))  # nvml.h nvmlEccCounterType_t: VOLATILE = 0
    if ECC_UNCORRECTABLE_CHECK not in skip:
        reading.current = ECC_UNCORRECTABLE_CHECK
        uncorrected = int(getattr(lib, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1))
        value = _call(
            nvml,
            reading,
            ECC_UNCORRECTABLE_CHECK,
            lib.nvmlDeviceGetTotalEccErrors,
            handle,
            uncorrected,
            volatile,
        )
        reading.ecc_uncorrected = int(value) if value is not None else None
    if ECC_CORRECTABLE_RATE not in skip:
        reading.current = ECC_CORRECTABLE_RATE
        corrected = int(getattr(lib, "NVML_MEMORY_ERROR_TYPE_CORRECTED", 0))
        value = _call(
            nvml, reading, ECC_CORRECTABLE_RATE, lib.nvmlDeviceGetTotalEccErrors, handle, corrected, volatile
        )
        reading.ecc_corrected = int(value) if value is not None else None
    if RETIRED_PAGES not in skip:
        reading.current = RETIRED_PAGES
        value = _call(nvml, reading, RETIRED_PAGES, lib.nvmlDeviceGetRetiredPagesPendingStatus, handle)
        reading.retired_pending = int(value) != 0 if value is not None else None
    if ROW_REMAP not in skip:
        reading.current = ROW_REMAP
        rows = _call(nvml, reading, ROW_REMAP, lib.nvmlDeviceGetRemappedRows, handle)
        if rows is not None:
            corr, unc, pending, failure = rows
            reading.row_remap = RowRemap(int(corr), int(unc), bool(pending), bool(failure))
    if RECOVERY_ACTION_CHECK not in skip:
        reading.current = RECOVERY_ACTION_CHECK
        reading.recovery_action = _recovery_action(nvml, reading, handle)
    if PCIE_REPLAY_RATE not in skip:
        reading.current = PCIE_REPLAY_RATE
        value = _call(nvml, reading, PCIE_REPLAY_RATE, lib.nvmlDeviceGetPcieReplayCounter, handle)
        reading.pcie_replays = int(value) if value is not None else None
    if NVLINK_ERRORS not in skip:
        reading.current = NVLINK_ERRORS
        reading.nvlink_errors = _nvlink_errors(nvml, reading, handle, ask.links)


def _raise(error: BaseException) -> None:
    raise error


def _recovery_action(nvml: Nvml, reading: GpuReading, handle: Any) -> int | None:
    lib = nvml.lib
    field_id = getattr(lib, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
    if field_id is None:
        reading.unsupported[RECOVERY_ACTION_CHECK] = "this pynvml has no NVML_FI_DEV_GET_GPU_RECOVERY_ACTION"
        return None
    values = _call(nvml, reading, RECOVERY_ACTION_CHECK, lib.nvmlDeviceGetFieldValues, handle, [field_id])
    if values is None:
        return None
    value = values[0]
    code = int(value.nvmlReturn)
    if code != int(getattr(lib, "NVML_SUCCESS", 0)):
        # A per-field error (older drivers, NVIDIA's mock: NOT_SUPPORTED) is classified as a call's.
        _call(nvml, reading, RECOVERY_ACTION_CHECK, _raise, lib.NVMLError(code))
        return None
    return int(value.value.uiVal)


def _nvlink_errors(nvml: Nvml, reading: GpuReading, handle: Any, links: tuple[int, ...] | None) -> int | None:
    """DL replay + recovery + CRC-flit errors summed over the active links; None without NVLink.

    `links` (the active links a recent pass found) spares a state call per link and pass.
    """
    lib = nvml.lib
    counters = [
        int(getattr(lib, name, default))
        for name, default in (
            ("NVML_NVLINK_ERROR_DL_REPLAY", 0),
            ("NVML_NVLINK_ERROR_DL_RECOVERY", 1),
            ("NVML_NVLINK_ERROR_DL_CRC_FLIT", 2),
        )
    ]
    if links is None:
        links = reading.links = _active_links(nvml, reading, handle)
        if links is None:
            return None
    total = 0
    for link in links:
        for counter in counters:
            value = _call(
                nvml, reading, NVLINK_ERRORS, lib.nvmlDeviceGetNvLinkErrorCounter, handle, link, counter
            )
            if value is None:
                return None
            total += int(value)
    return total


def _active_links(nvml: Nvml, reading: GpuReading, handle: Any) -> tuple[int, ...] | None:
    lib = nvml.lib
    enabled = int(getattr(lib, "NVML_FEATURE_ENABLED", 1))
    invalid = nvml.error_class("NVMLError_InvalidArgument")
    active: list[int] = []
    for link in range(int(getattr(lib, "NVML_NVLINK_MAX_LINKS", 18))):
        try:
            state = lib.nvmlDeviceGetNvLinkState(handle, link)
        except Exception as error:
            if isinstance(error, invalid) or (link > 0 and nvml.is_unsupported(error)):
                break  # past the GPU's last link
            _call(nvml, reading, NVLINK_ERRORS, _raise, error)
            return None
        if int(state) == enabled:
            active.append(link)
    return tuple(active)
