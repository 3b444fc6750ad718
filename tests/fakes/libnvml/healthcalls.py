"""The stand-in libnvidia-ml's telemetry, health-check and event functions (nvml.h's prototypes)."""

from __future__ import annotations

import queue
from ctypes import POINTER, c_int, c_uint, c_ulonglong
from typing import Any

from tests.fakes.libnvml.cabi import (
    ERROR_ARGUMENT_VERSION_MISMATCH,
    ERROR_INVALID_ARGUMENT,
    ERROR_NOT_SUPPORTED,
    ERROR_TIMEOUT,
    HANDLE,
    I32,
    OUT_HANDLE,
    SUCCESS,
    TEMPERATURE_V1,
    U32,
    U64,
    EventData,
    FieldValue,
    NvmlReturn,
    Temperature,
    Utilization,
    c_function,
    store,
)
from tests.fakes.libnvml.core import (
    NVLINK_ERROR_COUNT,
    RECOVERY_ACTION_FIELD,
    FakeEventSet,
    NvmlCore,
)
from tests.fakes.libnvml.devices import FakeGpu


class HealthCalls(NvmlCore):
    """Telemetry, health checks and events."""

    # -- telemetry (nvml.h:5979-7109) ---------------------------------------------------------

    @c_function("nvmlDeviceGetUtilizationRates", HANDLE, POINTER(Utilization))
    def utilization(self, handle: int, utilization: Any) -> None:
        device = self.device("nvmlDeviceGetUtilizationRates", handle)
        if device.mig is not None:
            raise NvmlReturn(ERROR_NOT_SUPPORTED)
        store(utilization, Utilization(gpu=device.gpu.utilization, memory=0))

    @c_function("nvmlDeviceGetTemperature", HANDLE, c_int, U32)
    def temperature(self, handle: int, sensor: int, temperature: Any) -> None:
        # nvml.h:5979: DEPRECATED(13.0), "use nvmlDeviceGetTemperatureV".
        store(temperature, self.device("nvmlDeviceGetTemperature", handle).gpu.temperature)

    @c_function("nvmlDeviceGetTemperatureV", HANDLE, POINTER(Temperature))
    def temperature_v(self, handle: int, temperature: Any) -> None:
        gpu = self.device("nvmlDeviceGetTemperatureV", handle).gpu
        if not temperature:
            raise NvmlReturn(ERROR_INVALID_ARGUMENT)
        if temperature.contents.version != TEMPERATURE_V1:  # nvml.h:6036
            raise NvmlReturn(ERROR_ARGUMENT_VERSION_MISMATCH)
        temperature.contents.temperature = gpu.temperature

    @c_function("nvmlDeviceGetPowerUsage", HANDLE, U32)
    def power(self, handle: int, power: Any) -> None:
        store(power, self.device("nvmlDeviceGetPowerUsage", handle).gpu.power_mw)

    # -- health (nvml.h:5629, 7007, 8428-8455, 9527-9606, 10251) --------------------------------

    @c_function("nvmlDeviceGetTotalEccErrors", HANDLE, c_int, c_int, U64)
    def ecc_total(self, handle: int, error_type: int, counter_type: int, count: Any) -> None:
        device = self.device("nvmlDeviceGetTotalEccErrors", handle)
        if not device.gpu.ecc or device.mig is not None:
            raise NvmlReturn(ERROR_NOT_SUPPORTED)
        if error_type not in (0, 1) or counter_type not in (0, 1):
            raise NvmlReturn(ERROR_INVALID_ARGUMENT)
        store(count, device.gpu.ecc_corrected if error_type == 0 else device.gpu.ecc_uncorrected)

    @c_function("nvmlDeviceGetFieldValues", HANDLE, c_int, POINTER(FieldValue))
    def field_values(self, handle: int, count: int, values: Any) -> None:
        # nvml.h:10246-10251: per-field status in each value's nvmlReturn.
        gpu = self.device("nvmlDeviceGetFieldValues", handle).gpu
        if count <= 0 or not values:
            raise NvmlReturn(ERROR_INVALID_ARGUMENT)
        for i in range(count):
            value = values[i]
            if value.fieldId == RECOVERY_ACTION_FIELD and gpu.recovery_action is not None:
                value.nvmlReturn, value.valueType = SUCCESS, 1  # NVML_VALUE_TYPE_UNSIGNED_INT
                value.value.uiVal = gpu.recovery_action
            else:
                value.nvmlReturn = ERROR_NOT_SUPPORTED

    @c_function("nvmlDeviceGetRetiredPagesPendingStatus", HANDLE, I32)
    def retired_pending(self, handle: int, pending: Any) -> None:
        device = self.device("nvmlDeviceGetRetiredPagesPendingStatus", handle)
        if device.gpu.retired_pages is None or device.mig is not None:
            raise NvmlReturn(ERROR_NOT_SUPPORTED)
        store(pending, 1 if device.gpu.retired_pending else 0)

    @c_function("nvmlDeviceGetRemappedRows", HANDLE, U32, U32, U32, U32)
    def remapped_rows(self, handle: int, corr: Any, unc: Any, pending: Any, failure: Any) -> None:
        device = self.device("nvmlDeviceGetRemappedRows", handle)
        gpu = device.gpu
        # nvml.h:8438-8453: NOT_SUPPORTED "if MIG is enabled or if the device doesn't support this".
        mig_on = gpu.mig_mode is not None and gpu.mig_mode[0] == 1
        if gpu.remapped_rows is None or device.mig is not None or mig_on:
            raise NvmlReturn(ERROR_NOT_SUPPORTED)
        for pointer, value in zip((corr, unc, pending, failure), gpu.remapped_rows, strict=True):
            store(pointer, value)

    @c_function("nvmlDeviceGetPcieReplayCounter", HANDLE, U32)
    def pcie_replays(self, handle: int, value: Any) -> None:
        device = self.device("nvmlDeviceGetPcieReplayCounter", handle)
        if device.gpu.pcie_replays is None or device.mig is not None:
            raise NvmlReturn(ERROR_NOT_SUPPORTED)
        store(value, device.gpu.pcie_replays)

    def _link(self, name: str, handle: int, link: int) -> FakeGpu:
        device = self.device(name, handle)
        if not device.gpu.nvlinks or device.mig is not None:
            raise NvmlReturn(ERROR_NOT_SUPPORTED)
        if not 0 <= link < len(device.gpu.nvlinks):
            raise NvmlReturn(ERROR_INVALID_ARGUMENT)  # nvml.h:9527: "link is invalid"
        return device.gpu

    @c_function("nvmlDeviceGetNvLinkState", HANDLE, c_uint, I32)
    def nvlink_state(self, handle: int, link: int, active: Any) -> None:
        gpu = self._link("nvmlDeviceGetNvLinkState", handle, link)
        store(active, 1 if gpu.nvlinks[link] else 0)

    @c_function("nvmlDeviceGetNvLinkErrorCounter", HANDLE, c_uint, c_int, U64)
    def nvlink_errors(self, handle: int, link: int, counter: int, value: Any) -> None:
        gpu = self._link("nvmlDeviceGetNvLinkErrorCounter", handle, link)
        if not 0 <= counter < NVLINK_ERROR_COUNT:
            raise NvmlReturn(ERROR_INVALID_ARGUMENT)
        store(value, gpu.nvlink_errors.get((link, counter), 0))

    # -- events (nvml.h:9903-10016) -----------------------------------------------------------

    def _event_set(self, handle: int | None) -> FakeEventSet:
        found: FakeEventSet = self._object(handle, FakeEventSet)
        if found.freed:
            raise NvmlReturn(ERROR_INVALID_ARGUMENT)
        return found

    @c_function("nvmlEventSetCreate", OUT_HANDLE)
    def event_set_create(self, out: Any) -> None:
        event_set = FakeEventSet()
        self.event_sets.append(event_set)
        store(out, self.token(event_set, "set", event_set))

    @c_function("nvmlDeviceGetSupportedEventTypes", HANDLE, U64)
    def supported_events(self, handle: int, types_: Any) -> None:
        store(types_, self.device("nvmlDeviceGetSupportedEventTypes", handle).gpu.supported_events)

    @c_function("nvmlDeviceRegisterEvents", HANDLE, c_ulonglong, HANDLE)
    def register_events(self, handle: int, event_types: int, set_handle: int) -> None:
        gpu = self.device("nvmlDeviceRegisterEvents", handle).gpu
        event_set = self._event_set(set_handle)
        # nvml.h:9920-9939: NOT_SUPPORTED "if the platform does not support this feature or some
        # of the requested event types".
        if event_types & ~gpu.supported_events:
            raise NvmlReturn(ERROR_NOT_SUPPORTED)
        event_set.registered[gpu.uuid] = event_set.registered.get(gpu.uuid, 0) | event_types

    @c_function("nvmlEventSetWait_v2", HANDLE, POINTER(EventData), c_uint)
    def event_wait(self, set_handle: int, data: Any, timeout_ms: int) -> None:
        event_set = self._event_set(set_handle)
        event_set.waits += 1
        try:
            item = event_set.queue.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise NvmlReturn(ERROR_TIMEOUT) from None  # nvml.h:10000: no event within timeoutms
        if isinstance(item, int):
            raise NvmlReturn(item)
        event = EventData(
            device=self.gpu_token(item.gpu),
            eventType=item.event_type,
            eventData=item.data,
            gpuInstanceId=item.gpu_instance_id,
            computeInstanceId=item.compute_instance_id,
        )
        store(data, event)

    @c_function("nvmlEventSetFree", HANDLE)
    def event_set_free(self, set_handle: int) -> None:
        self._event_set(set_handle).freed = True
