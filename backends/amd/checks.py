"""What one health pass reads from one physical GPU (blocking: `read_gpu` runs in a worker thread).

The pass's checks, in the order `read_gpu` runs them:

- ``answers``: does the GPU answer at all (its VRAM usage; a lost status means it is gone);
- ``ecc-uncorrectable`` and ``ecc-correctable-rate``: the ECC counts of every enabled RAS block,
  read once (``amdsmi_get_gpu_ecc_count``); their sums are what ``amdsmi_get_gpu_total_ecc_count``
  would return, so telemetry reuses them instead of reading the counters again;
- ``bad-pages``: retired or pending VRAM pages (``amdsmi_get_gpu_bad_page_info``) and the driver's
  threshold (``amdsmi_get_gpu_bad_page_threshold``, where amdsmi has it and the agent may read it);
- ``cper``: new fatal CPER records;
- ``pcie-replay-rate``: the link's replay counter (``amdsmi_get_pcie_info``);
- ``xgmi-errors``: the XGMI error status (``amdsmi_gpu_xgmi_error_status``).

A check the GPU or the installed amdsmi cannot answer (not supported, not permitted, absent) is
reported once in `GpuReading.unavailable` and skipped from then on. A check that fails for another
reason is named in `GpuReading.failed` (the check failed, not the GPU). A lost status from the
probe ends the reading; a lost status from a later check is checked by asking the probe again, so a
feature whose sysfs file is missing (amdsmi answers FILE_ERROR or NOT_FOUND) is not taken for a lost
GPU. `Progress` says which check a hung call is in.
"""

from __future__ import annotations

import calendar
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from agent.core.logs import log_fields
from backends.amd.smi import (
    LOST_STATUSES,
    STATUS_FILE_ERROR,
    STATUS_INVAL,
    STATUS_NOT_SUPPORTED,
    UNAVAILABLE_STATUSES,
    describe,
    error_code,
)

log = logging.getLogger("agent.backends.amd")

T = TypeVar("T")

ANSWERS = "answers"
ECC_UNCORRECTABLE = "ecc-uncorrectable"
ECC_CORRECTABLE_RATE = "ecc-correctable-rate"
BAD_PAGES = "bad-pages"
CPER = "cper"
PCIE_REPLAY_RATE = "pcie-replay-rate"
XGMI_ERRORS = "xgmi-errors"
CHECKS = (ANSWERS, ECC_UNCORRECTABLE, BAD_PAGES, CPER, ECC_CORRECTABLE_RATE, PCIE_REPLAY_RATE, XGMI_ERRORS)
"""The names of the pass's checks (the backend's `health_checks`)."""
BAD_PAGE_THRESHOLD = "bad-page-threshold"
"""The part of ``bad-pages`` a GPU may lack on its own (it needs root; older amdsmi lacks it)."""

# The checks one step of `read_gpu` serves: the correctable rate comes from the ECC step's reads.
STEP_CHECKS: Mapping[str, tuple[str, ...]] = {ECC_UNCORRECTABLE: (ECC_UNCORRECTABLE, ECC_CORRECTABLE_RATE)}

CPER_SEV_FATAL = 1  # amdsmi_cper_sev_t AMDSMI_CPER_SEV_FATAL; the mask has bit (1 << severity)
PAGE_STATUS_PENDING = 1  # amdsmi_memory_page_status_t AMDSMI_MEM_PAGE_STATUS_PENDING


class CheckError(Exception):
    """One check's amdsmi call did not give an answer (internal to a reading)."""


class GpuGoneError(CheckError):
    """The GPU answered with a status that means it is gone."""


class CheckUnavailableError(CheckError):
    """The GPU or the installed amdsmi cannot answer this check (skip it from now on)."""


class CheckFailedError(CheckError):
    """The check's call failed for another reason (the check failed this pass, not the GPU)."""


@dataclass(frozen=True)
class EccTotals:
    """A GPU's ECC error counts since boot, summed over its RAS blocks."""

    corrected: int
    uncorrected: int


@dataclass(frozen=True)
class EccReading:
    """The ECC counts of every RAS block that reports them (block names in lower case)."""

    uncorrectable: Mapping[str, int]
    correctable: Mapping[str, int] = field(default_factory=dict)

    @property
    def totals(self) -> EccTotals:
        return EccTotals(sum(self.correctable.values()), sum(self.uncorrectable.values()))


@dataclass(frozen=True)
class BadPages:
    """The GPU's bad VRAM pages: all records, those pending retirement, and the driver's threshold."""

    total: int
    pending: int
    threshold: int | None = None


@dataclass(frozen=True)
class CperRecord:
    """One fatal CPER record: when, its notify type and record id."""

    at: float
    notify: str
    record: str


@dataclass(frozen=True)
class ReadPlan:
    """What `read_gpu` needs from the monitor: the CPER cursor and the checks to skip."""

    cper_cursor: int = 0
    skip: frozenset[str] = frozenset()


@dataclass(frozen=True)
class GpuReading:
    """One pass over one physical GPU."""

    lost: str = ""
    """Why the GPU is taken as gone (its lost status); the rest is then empty."""
    ecc: EccReading | None = None
    ras_problem: str = ""
    """Why `ecc` is None when the step ran: RAS unavailable (``unmonitored``, value ``ras``)."""
    bad_pages: BadPages | None = None
    cper: tuple[CperRecord, ...] = ()
    cper_cursor: int = 0
    pcie_replays: int | None = None
    xgmi_status: int | None = None
    """amdsmi_xgmi_status_t: 0 no errors, 1 an error, 2 multiple errors."""
    unavailable: Mapping[str, str] = field(default_factory=dict)
    """Checks found unavailable by this reading, with why."""
    failed: Mapping[str, str] = field(default_factory=dict)
    """Steps that failed this pass, with the error."""


class Progress:
    """Which step a `read_gpu` call is in; written by its worker thread, read when the call hangs."""

    def __init__(self) -> None:
        self.started = False
        self.step = ANSWERS
        self.done = False


def _ask(smi: Any, name: str, *args: Any, **kwargs: Any) -> Any:
    """``smi.<name>(*args, **kwargs)``, its failure sorted into the `CheckError` kinds."""
    function = getattr(smi, name, None)
    if function is None:
        raise CheckUnavailableError(f"the installed amdsmi has no {name}")
    try:
        return function(*args, **kwargs)
    except smi.AmdSmiException as error:
        raise _sorted(name, error) from error


def _sorted(name: str, error: BaseException) -> CheckError:
    """The `CheckError` kind of an amdsmi exception from ``smi.<name>``."""
    code = error_code(error)
    if code in LOST_STATUSES:
        return GpuGoneError(f"{name}: {describe(error)}")
    if code in UNAVAILABLE_STATUSES:
        return CheckUnavailableError(f"{name}: {describe(error)}")
    return CheckFailedError(f"{name}: {describe(error)}")


def probe(smi: Any, handle: Any) -> str:
    """Why the GPU is gone, or "" when it answers (any answer but a lost status is an answer).

    The VRAM usage goes through the DRM ioctl: DRM_ERROR when the GPU is gone. INVAL means amdsmi
    no longer holds the handle (re-initialised without this GPU): gone too.
    """
    try:
        _ask(smi, "amdsmi_get_gpu_vram_usage", handle)
    except GpuGoneError as gone:
        return str(gone)
    except CheckError as error:
        if isinstance(error.__cause__, smi.AmdSmiException) and error_code(error.__cause__) == STATUS_INVAL:
            return f"amdsmi no longer lists this GPU ({error})"
    return ""


def read_ecc(smi: Any, handle: Any) -> tuple[EccReading | None, str]:
    """The ECC counts per enabled RAS block, or None and why RAS is unavailable."""
    try:
        enabled = int(_ask(smi, "amdsmi_get_gpu_ecc_enabled", handle))
    except GpuGoneError as gone:
        if probe(smi, handle):
            raise
        return None, f"ECC state unreadable: {gone}"  # RAS stays checked: unmonitored, not skipped
    except (CheckUnavailableError, CheckFailedError) as error:
        return None, f"ECC state unreadable: {error}"
    if not enabled:
        return None, "ECC is disabled or RAS is not exposed (e.g. on a VM guest)"
    uncorrectable: dict[str, int] = {}
    correctable: dict[str, int] = {}
    for block in smi.AmdSmiGpuBlock:
        if block.name in ("INVALID", "RESERVED") or not enabled & int(block.value):
            continue
        try:
            counts = smi.amdsmi_get_gpu_ecc_count(handle, block)
        except smi.AmdSmiException as error:
            # A block without counters answers NOT_SUPPORTED or NOT_FOUND: skip that block.
            if error_code(error) != STATUS_NOT_SUPPORTED:
                log.debug("ECC count unreadable", extra=log_fields(block=block.name, error=describe(error)))
            continue
        if not isinstance(counts, Mapping):
            continue
        name = block.name.lower()
        for key, into in (("uncorrectable_count", uncorrectable), ("correctable_count", correctable)):
            value = counts.get(key)
            if isinstance(value, int) and value >= 0:
                into[name] = value
            elif value is not None:
                log.warning(
                    "ECC count is not a count; skipping it",
                    extra=log_fields(block=block.name, count=key, value=repr(value)),
                )
    if not uncorrectable:
        return None, "no RAS block reports ECC counts"
    return EccReading(uncorrectable, correctable), ""


def _page_pending(smi: Any, status: object) -> bool:
    if isinstance(status, str):  # some amdsmi versions name the status
        return status.upper().endswith("PENDING")
    pending = int(getattr(getattr(smi, "AmdSmiMemoryPageStatus", None), "PENDING", PAGE_STATUS_PENDING))
    return isinstance(status, int) and int(status) == pending  # an int, or an IntEnum member


def read_bad_pages(smi: Any, handle: Any, skip: frozenset[str], unavailable: dict[str, str]) -> BadPages:
    """The bad-page records and, where it can be read, the driver's threshold."""
    pages = _ask(smi, "amdsmi_get_gpu_bad_page_info", handle)
    if not isinstance(pages, list):  # the binding answers a list (empty when none)
        raise CheckFailedError(f"amdsmi_get_gpu_bad_page_info answered {pages!r}")
    pending = sum(1 for page in pages if isinstance(page, Mapping) and _page_pending(smi, page.get("status")))
    threshold: int | None = None
    if BAD_PAGE_THRESHOLD not in skip:
        try:
            value = _ask(smi, "amdsmi_get_gpu_bad_page_threshold", handle)
        except CheckUnavailableError as error:
            unavailable[BAD_PAGE_THRESHOLD] = str(error)
        else:
            # An int; without root the call raises NOT_SUPPORTED (debugfs), handled above.
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                threshold = value
            else:
                unavailable[BAD_PAGE_THRESHOLD] = f"amdsmi_get_gpu_bad_page_threshold answered {value!r}"
    return BadPages(total=len(pages), pending=pending, threshold=threshold)


def _cper_time(text: object) -> float | None:
    """amdsmi formats CPER timestamps as ``YYYY/MM/DD HH:MM:SS`` (UTC)."""
    if not isinstance(text, str):
        return None
    try:
        return float(calendar.timegm(time.strptime(text.strip(), "%Y/%m/%d %H:%M:%S")))
    except ValueError:
        return None


def _text(value: object) -> str:
    """CPER ids are ``c_char`` arrays: the binding gives bytes."""
    if isinstance(value, bytes):
        return value.rstrip(b"\0").decode("ascii", "replace")
    return str(value)


def read_cper(smi: Any, handle: Any, cursor: int) -> tuple[tuple[CperRecord, ...], int]:
    """New fatal CPER records since `cursor`, and the new cursor.

    amdsmi 7.0.x answers FILE_ERROR for an empty CPER ring (amd_smi_utils.cc
    amdsmi_read_cper_file; fixed in AMD SMI 26.5.0): no records, not a failure.
    """
    name = "amdsmi_get_gpu_cper_entries"
    if not hasattr(smi, name):
        raise CheckUnavailableError(f"the installed amdsmi has no {name}")
    try:
        entries, new_cursor, _, _ = smi.amdsmi_get_gpu_cper_entries(
            handle, 1 << CPER_SEV_FATAL, cursor=cursor
        )
    except smi.AmdSmiException as error:
        if error_code(error) == STATUS_FILE_ERROR:
            return (), cursor
        raise _sorted(name, error) from error
    records: list[CperRecord] = []
    for entry in entries.values() if isinstance(entries, Mapping) else ():
        if str(entry.get("error_severity", "")).lower() != "fatal":
            continue
        at = _cper_time(entry.get("timestamp"))
        if at is not None:
            records.append(
                CperRecord(at, _text(entry.get("notify_type", "")), _text(entry.get("record_id", "")))
            )
    return tuple(records), new_cursor


def read_pcie_replays(smi: Any, handle: Any) -> int:
    """The PCIe replay count since boot."""
    info = _ask(smi, "amdsmi_get_pcie_info", handle)
    metric = info.get("pcie_metric") if isinstance(info, Mapping) else None
    count = metric.get("pcie_replay_count") if isinstance(metric, Mapping) else None
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:  # "N/A" (UINT64_MAX)
        raise CheckUnavailableError(f"amdsmi_get_pcie_info has no pcie_replay_count ({count!r})")
    return count


def read_xgmi_status(smi: Any, handle: Any) -> int:
    """The XGMI error status (0 none, 1 an error, 2 multiple errors)."""
    status = _ask(smi, "amdsmi_gpu_xgmi_error_status", handle)
    try:
        return int(status)
    except (TypeError, ValueError) as error:
        raise CheckUnavailableError(f"amdsmi_gpu_xgmi_error_status answered {status!r}") from error


def read_gpu(smi: Any, handle: Any, plan: ReadPlan, progress: Progress) -> GpuReading:
    """Run the pass's checks on one physical GPU (blocking)."""
    progress.started = True
    unavailable: dict[str, str] = {}
    failed: dict[str, str] = {}

    def step(check: str, read: Callable[[], T]) -> T | None:
        if check in plan.skip:
            return None
        progress.step = check
        try:
            return read()
        except GpuGoneError as gone:
            # Gone since the probe, or a feature amdsmi reaches through a file this GPU lacks.
            again = probe(smi, handle)
            if again:
                raise GpuGoneError(again) from gone
            unavailable[check] = str(gone)
        except CheckUnavailableError as error:
            unavailable[check] = str(error)
        except CheckFailedError as error:
            failed[check] = str(error)
        return None

    try:
        lost = probe(smi, handle)
        if lost:
            return GpuReading(lost=lost, cper_cursor=plan.cper_cursor)
        ecc_step = step(ECC_UNCORRECTABLE, lambda: read_ecc(smi, handle))
        ecc, problem = ecc_step if ecc_step is not None else (None, "")
        bad_pages = step(BAD_PAGES, lambda: read_bad_pages(smi, handle, plan.skip, unavailable))
        cper = step(CPER, lambda: read_cper(smi, handle, plan.cper_cursor))
        records, cursor = cper if cper is not None else ((), plan.cper_cursor)
        return GpuReading(
            ecc=ecc,
            ras_problem=problem,
            bad_pages=bad_pages,
            cper=records,
            cper_cursor=cursor,
            pcie_replays=step(PCIE_REPLAY_RATE, lambda: read_pcie_replays(smi, handle)),
            xgmi_status=step(XGMI_ERRORS, lambda: read_xgmi_status(smi, handle)),
            unavailable=unavailable,
            failed=failed,
        )
    except GpuGoneError as gone:
        return GpuReading(lost=str(gone), cper_cursor=plan.cper_cursor)
    finally:
        progress.done = True
