"""Device counters through NVML: utilization, memory, temperature, power, ECC totals, last XID.

`read_telemetry_sync` is blocking (run it in a worker thread). A field the GPU, the MIG device
or the driver cannot report is None; the other fields are still read. The ECC totals are not read
here: they are the health pass's readings (`HealthState.ecc`), so a counter is read once per pass.
A GPU that answers GPU_IS_LOST is not asked further in this read; the caller learns it
(`TelemetryRead.lost`) so the health pass asks that GPU at once; its devices read as unknown.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.core.backend import DeviceTelemetry
from backends.nvidia.checks import EccCounts
from backends.nvidia.discovery import NvDevice
from backends.nvidia.nvml import Nvml

log = logging.getLogger("agent.backends.nvidia")


class _GpuLost(Exception):
    """The GPU answered GPU_IS_LOST: stop reading it."""


@dataclass(frozen=True)
class TelemetryRead:
    """The readings of one telemetry read, and the GPUs found lost (UUID -> the error)."""

    readings: list[DeviceTelemetry] = field(default_factory=list)
    lost: Mapping[str, str] = field(default_factory=dict)


def _field(nvml: Nvml, what: str, func: Any, *args: Any) -> Any:
    try:
        return func(*args)
    except Exception as error:
        if not nvml.is_error(error):
            raise
        if nvml.is_gpu_lost(error):
            raise _GpuLost(str(error)) from error
        if not nvml.is_unsupported(error):
            log.debug("telemetry field unreadable", extra={"fields": {"field": what, "error": str(error)}})
        return None


def _temperature(nvml: Nvml, handle: Any) -> int:
    """The GPU's temperature: nvmlDeviceGetTemperatureV where the binding and driver have it
    (nvml.h:5979 deprecates nvmlDeviceGetTemperature in 13.0), else the older call."""
    lib = nvml.lib
    sensor = int(getattr(lib, "NVML_TEMPERATURE_GPU", 0))
    by_version = getattr(lib, "nvmlDeviceGetTemperatureV", None)
    if by_version is not None:
        try:
            return int(by_version(handle, sensor))
        except Exception as error:
            if not isinstance(error, nvml.error_class("NVMLError_FunctionNotFound")):
                raise
    return int(lib.nvmlDeviceGetTemperature(handle, sensor))


def read_device(
    nvml: Nvml, device: NvDevice, last_xid: Mapping[str, int], now: float, ecc: EccCounts | None = None
) -> DeviceTelemetry:
    """One device's reading. MIG devices: memory of the MIG device, the rest of the parent GPU.

    Raises `_GpuLost` when the GPU answers GPU_IS_LOST."""
    lib = nvml.lib
    gpu_handle = device.gpu.handle
    own_handle = device.mig.handle if device.mig else gpu_handle
    utilization = None
    if device.mig is None:
        # NVML has no per-MIG-device utilization.
        rates = _field(nvml, "utilization", lib.nvmlDeviceGetUtilizationRates, gpu_handle)
        utilization = float(rates.gpu) / 100.0 if rates is not None else None
    memory = _field(nvml, "memory", lib.nvmlDeviceGetMemoryInfo, own_handle)
    temperature = _field(nvml, "temperature", _temperature, nvml, gpu_handle)
    power_mw = _field(nvml, "power", lib.nvmlDeviceGetPowerUsage, gpu_handle)
    # ECC totals are the GPU's: reported on the whole GPU only.
    counts = ecc if ecc is not None and device.mig is None else EccCounts()
    return DeviceTelemetry(
        device=device.name,
        utilization_ratio=utilization,
        memory_used_bytes=int(memory.used) if memory is not None else None,
        memory_total_bytes=int(memory.total) if memory is not None else None,
        temperature_celsius=float(temperature) if temperature is not None else None,
        power_watts=float(power_mw) / 1000.0 if power_mw is not None else None,
        ecc_corrected_total=counts.corrected,
        ecc_uncorrected_total=counts.uncorrected,
        last_error_code=last_xid.get(device.gpu.uuid, 0),
        read_at=now,
    )


def read_telemetry_sync(
    nvml: Nvml,
    devices: Sequence[NvDevice],
    last_xid: Mapping[str, int],
    now: float,
    ecc: Mapping[str, EccCounts] | None = None,
) -> TelemetryRead:
    """Readings of all `devices` (blocking); a lost GPU's devices read as unknown but their last XID."""
    readings: list[DeviceTelemetry] = []
    lost: dict[str, str] = {}
    for device in devices:
        uuid = device.gpu.uuid
        if uuid not in lost:
            try:
                readings.append(read_device(nvml, device, last_xid, now, (ecc or {}).get(uuid)))
                continue
            except _GpuLost as error:
                lost[uuid] = str(error)
        readings.append(DeviceTelemetry(device.name, last_error_code=last_xid.get(uuid), read_at=now))
    return TelemetryRead(readings, lost)
