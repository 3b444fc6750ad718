"""Telemetry of AMD GPUs and partitions: gfx activity, VRAM, temperature, power, ECC totals.

Each field is read on its own: a call that fails (unsupported on this GPU or partition) leaves
only that field None. Runs in a worker thread (`read_telemetry` is blocking).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from agent.core.backend import DeviceTelemetry
from backends.amd.discovery import MIB, DeviceEntry
from backends.amd.smi import log_degraded

T = TypeVar("T")


def _quiet(device: str, what: str, call: Callable[[], T], smi: Any, warned: set[str]) -> T | None:
    """One call; failures degrade to None and are logged once per device and call."""
    try:
        return call()
    except (smi.AmdSmiException, AttributeError) as error:
        key = f"{device}/{what}"
        if key not in warned:
            warned.add(key)
            log_degraded(device, what, error)
        return None


def _num(value: object) -> float | None:
    """amdsmi reports unavailable readings as the string "N/A"."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def read_one(smi: Any, entry: DeviceEntry, warned: set[str], now: float | None = None) -> DeviceTelemetry:
    """Read one device's counters (blocking)."""
    h, name = entry.handle, entry.name
    activity = _quiet(name, "amdsmi_get_gpu_activity", lambda: smi.amdsmi_get_gpu_activity(h), smi, warned)
    usage = _quiet(name, "amdsmi_get_gpu_vram_usage", lambda: smi.amdsmi_get_gpu_vram_usage(h), smi, warned)
    power = _quiet(name, "amdsmi_get_power_info", lambda: smi.amdsmi_get_power_info(h), smi, warned)
    ecc = _quiet(
        name, "amdsmi_get_gpu_total_ecc_count", lambda: smi.amdsmi_get_gpu_total_ecc_count(h), smi, warned
    )
    temperature: float | None = None
    for sensor in ("HOTSPOT", "EDGE"):  # junction first; JUNCTION is an alias of HOTSPOT
        value = _quiet(
            name,
            f"amdsmi_get_temp_metric({sensor})",
            lambda sensor=sensor: smi.amdsmi_get_temp_metric(  # type: ignore[misc]
                h, smi.AmdSmiTemperatureType[sensor], smi.AmdSmiTemperatureMetric.CURRENT
            ),
            smi,
            warned,
        )
        temperature = _num(value)
        if temperature is not None:
            break
    gfx = _num(activity.get("gfx_activity")) if isinstance(activity, Mapping) else None
    used = _num(usage.get("vram_used")) if isinstance(usage, Mapping) else None
    total = _num(usage.get("vram_total")) if isinstance(usage, Mapping) else None
    watts: float | None = None
    if isinstance(power, Mapping):
        watts = _num(power.get("current_socket_power"))
        if not watts:  # 0 or N/A on GPUs that only report the average
            watts = _num(power.get("average_socket_power")) or watts
    corrected = ecc.get("correctable_count") if isinstance(ecc, Mapping) else None
    uncorrected = ecc.get("uncorrectable_count") if isinstance(ecc, Mapping) else None
    return DeviceTelemetry(
        device=name,
        utilization_ratio=None if gfx is None else gfx / 100.0,
        memory_used_bytes=None if used is None else int(used) * MIB,
        memory_total_bytes=None if total is None else int(total) * MIB,
        temperature_celsius=temperature,
        power_watts=watts,
        ecc_corrected_total=corrected if isinstance(corrected, int) else None,
        ecc_uncorrected_total=uncorrected if isinstance(uncorrected, int) else None,
        read_at=time.time() if now is None else now,
    )


def read_telemetry(smi: Any, entries: Sequence[DeviceEntry], warned: set[str]) -> list[DeviceTelemetry]:
    """Read every device's counters (blocking: run in a worker thread)."""
    return [read_one(smi, e, warned) for e in entries]
