"""Device counters through NVML: utilization, memory, temperature, power, ECC totals, last XID.

`read_telemetry_sync` is blocking (run it in a worker thread). A field the GPU, the MIG device
or the driver cannot report is None; the other fields are still read.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from agent.core.backend import DeviceTelemetry
from backends.nvidia.discovery import NvDevice
from backends.nvidia.nvml import Nvml

log = logging.getLogger("agent.backends.nvidia")


def _field(nvml: Nvml, what: str, func: Any, *args: Any) -> Any:
    try:
        return func(*args)
    except Exception as error:
        if not nvml.is_error(error):
            raise
        if not nvml.is_unsupported(error):
            log.debug("telemetry field unreadable", extra={"fields": {"field": what, "error": str(error)}})
        return None


def read_device(nvml: Nvml, device: NvDevice, last_xid: Mapping[str, int], now: float) -> DeviceTelemetry:
    """One device's reading. MIG devices: memory of the MIG device, the rest of the parent GPU."""
    lib = nvml.lib
    gpu_handle = device.gpu.handle
    own_handle = device.mig.handle if device.mig else gpu_handle
    utilization = None
    if device.mig is None:
        # NVML has no per-MIG-device utilization.
        rates = _field(nvml, "utilization", lib.nvmlDeviceGetUtilizationRates, gpu_handle)
        utilization = float(rates.gpu) / 100.0 if rates is not None else None
    memory = _field(nvml, "memory", lib.nvmlDeviceGetMemoryInfo, own_handle)
    sensor = int(getattr(lib, "NVML_TEMPERATURE_GPU", 0))
    temperature = _field(nvml, "temperature", lib.nvmlDeviceGetTemperature, gpu_handle, sensor)
    power_mw = _field(nvml, "power", lib.nvmlDeviceGetPowerUsage, gpu_handle)
    corrected = uncorrected = None
    if device.mig is None:
        volatile = int(getattr(lib, "NVML_VOLATILE_ECC", 0))
        corrected = _field(
            nvml,
            "ecc-corrected",
            lib.nvmlDeviceGetTotalEccErrors,
            gpu_handle,
            int(getattr(lib, "NVML_MEMORY_ERROR_TYPE_CORRECTED", 0)),
            volatile,
        )
        uncorrected = _field(
            nvml,
            "ecc-uncorrected",
            lib.nvmlDeviceGetTotalEccErrors,
            gpu_handle,
            int(getattr(lib, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1)),
            volatile,
        )
    return DeviceTelemetry(
        device=device.name,
        utilization_ratio=utilization,
        memory_used_bytes=int(memory.used) if memory is not None else None,
        memory_total_bytes=int(memory.total) if memory is not None else None,
        temperature_celsius=float(temperature) if temperature is not None else None,
        power_watts=float(power_mw) / 1000.0 if power_mw is not None else None,
        ecc_corrected_total=int(corrected) if corrected is not None else None,
        ecc_uncorrected_total=int(uncorrected) if uncorrected is not None else None,
        last_error_code=last_xid.get(device.gpu.uuid),
        read_at=now,
    )


def read_telemetry_sync(
    nvml: Nvml, devices: Sequence[NvDevice], last_xid: Mapping[str, int], now: float
) -> list[DeviceTelemetry]:
    """Readings of all `devices` (blocking)."""
    return [read_device(nvml, d, last_xid, now) for d in devices]
