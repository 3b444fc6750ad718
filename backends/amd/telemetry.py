"""Telemetry of AMD GPUs and partitions: gfx activity, VRAM, temperature, power, ECC totals.

Each field is read on its own: a call that fails (unsupported on this GPU or partition) leaves
only that field None. Runs in a worker thread (`read_telemetry` is blocking).

The ECC totals are not read here: the health pass reads every RAS block's counts, whose sums they
are (``amdsmi_get_gpu_total_ecc_count`` sums the same per-block reads), and the backend passes its
last reading in. A device none of whose calls answered, with a lost status among the answers, is
reported in `TelemetryReading.lost` so that the next health pass reports the GPU lost.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from agent.core.backend import DeviceTelemetry
from backends.amd.checks import EccTotals
from backends.amd.discovery import MIB, DeviceEntry
from backends.amd.smi import describe, is_lost, log_degraded

T = TypeVar("T")


@dataclass(frozen=True)
class TelemetryReading:
    """One read of every device, and the devices that answered only with a lost status (and why)."""

    devices: tuple[DeviceTelemetry, ...]
    lost: Mapping[str, str] = field(default_factory=dict)


class _Calls:
    """One device's telemetry calls: failures degrade to None, logged once per device and call."""

    def __init__(self, smi: Any, device: str, warned: set[str]) -> None:
        self._smi = smi
        self._device = device
        self._warned = warned
        self.answered = False
        self.lost = ""

    def __call__(self, what: str, call: Callable[[], T]) -> T | None:
        try:
            value = call()
        except (self._smi.AmdSmiException, AttributeError) as error:
            if is_lost(error) and not self.lost:
                self.lost = f"{what}: {describe(error)}"
            key = f"{self._device}/{what}"
            if key not in self._warned:
                self._warned.add(key)
                log_degraded(self._device, what, error)
            return None
        self.answered = True
        return value


def _num(value: object) -> float | None:
    """amdsmi reports unavailable readings as the string "N/A"."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def read_one(
    smi: Any,
    entry: DeviceEntry,
    warned: set[str],
    now: float | None = None,
    *,
    ecc: EccTotals | None = None,
    calls: _Calls | None = None,
) -> DeviceTelemetry:
    """Read one device's counters (blocking); `ecc` is its GPU's last reading by the health pass."""
    h, name = entry.handle, entry.name
    call = calls or _Calls(smi, name, warned)
    activity = call("amdsmi_get_gpu_activity", lambda: smi.amdsmi_get_gpu_activity(h))
    usage = call("amdsmi_get_gpu_vram_usage", lambda: smi.amdsmi_get_gpu_vram_usage(h))
    power = call("amdsmi_get_power_info", lambda: smi.amdsmi_get_power_info(h))
    temperature: float | None = None
    for sensor in ("HOTSPOT", "EDGE"):  # junction first; JUNCTION is an alias of HOTSPOT
        value = call(
            f"amdsmi_get_temp_metric({sensor})",
            lambda sensor=sensor: smi.amdsmi_get_temp_metric(  # type: ignore[misc]
                h, smi.AmdSmiTemperatureType[sensor], smi.AmdSmiTemperatureMetric.CURRENT
            ),
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
    return DeviceTelemetry(
        device=name,
        utilization_ratio=None if gfx is None else gfx / 100.0,
        memory_used_bytes=None if used is None else int(used) * MIB,
        memory_total_bytes=None if total is None else int(total) * MIB,
        temperature_celsius=temperature,
        power_watts=watts,
        ecc_corrected_total=None if ecc is None else ecc.corrected,
        ecc_uncorrected_total=None if ecc is None else ecc.uncorrected,
        read_at=time.time() if now is None else now,
    )


def read_telemetry(
    smi: Any, entries: Sequence[DeviceEntry], warned: set[str], ecc: Mapping[str, EccTotals] | None = None
) -> TelemetryReading:
    """Read every device's counters (blocking: run in a worker thread); `ecc` by GPU key.

    The ECC totals are the GPU's (per physical GPU, like RAS): every partition reports them.
    """
    readings: list[DeviceTelemetry] = []
    lost: dict[str, str] = {}
    for entry in entries:
        calls = _Calls(smi, entry.name, warned)
        readings.append(read_one(smi, entry, warned, ecc=(ecc or {}).get(entry.gpu_key), calls=calls))
        if calls.lost and not calls.answered:  # one failing sensor is not a lost GPU
            lost[entry.name] = calls.lost
    return TelemetryReading(tuple(readings), lost)
