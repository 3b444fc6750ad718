"""The stand-in libnvidia-ml's system, identity and static-MIG functions (nvml.h's prototypes)."""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_char_p, c_int, c_uint, c_void_p
from typing import Any

from tests.fakes.libnvml.cabi import (
    CHARS,
    ERROR_ARGUMENT_VERSION_MISMATCH,
    ERROR_GPU_IS_LOST,
    ERROR_INVALID_ARGUMENT,
    ERROR_NOT_FOUND,
    ERROR_NOT_SUPPORTED,
    GI_PROFILE_INFO_V2,
    HANDLE,
    I32,
    OUT_HANDLE,
    U32,
    DeviceAttributes,
    GiInfo,
    GiProfileInfo,
    GiProfileInfoV2,
    Memory,
    NvmlReturn,
    PciInfo,
    c_function,
    put_text,
    store,
)
from tests.fakes.libnvml.core import ERROR_STRINGS, FakeInstance, NvmlCore
from tests.fakes.libnvml.devices import MIB, FakeGpu, GiProfile


class DeviceCalls(NvmlCore):
    """System, device identity and static MIG calls."""

    # -- system (nvml.h:4040-4249) ------------------------------------------------------------

    @c_function("nvmlInitWithFlags", c_uint)
    def init(self, flags: int) -> None:
        if self.init_error is not None:
            raise NvmlReturn(self.init_error)
        self.initialized += 1

    @c_function("nvmlShutdown")
    def shutdown(self) -> None:
        self.initialized -= 1

    @c_function("nvmlErrorString", c_int, restype=c_void_p)
    def error_string(self, code: int) -> int:
        # nvml.h:4078 returns a static string: one buffer per code, kept alive.
        with self._lock:
            if code not in self._strings:
                text = ERROR_STRINGS.get(code, "Unknown Error")
                self._strings[code] = ctypes.create_string_buffer(text.encode())
            return int(ctypes.addressof(self._strings[code]))

    @c_function("nvmlSystemGetDriverVersion", CHARS, c_uint)
    def driver(self, version: int, length: int) -> None:
        put_text(version, length, self.driver_version)

    @c_function("nvmlSystemGetCudaDriverVersion", I32)
    def cuda(self, version: Any) -> None:
        store(version, self.cuda_version)

    @c_function("nvmlDeviceGetCount_v2", U32)
    def device_count(self, count: Any) -> None:
        store(count, len(self.gpus))

    @c_function("nvmlDeviceGetHandleByIndex_v2", c_uint, OUT_HANDLE)
    def by_index(self, index: int, device: Any) -> None:
        # nvml.h:4650-4662: GPU_IS_LOST "if the *target* GPU has fallen off the bus".
        if not 0 <= index < len(self.gpus):
            raise NvmlReturn(ERROR_INVALID_ARGUMENT)
        gpu = self.gpus[index]
        self._check("nvmlDeviceGetHandleByIndex_v2", gpu)
        store(device, self.gpu_token(gpu))

    @c_function("nvmlDeviceGetHandleByUUID", c_char_p, OUT_HANDLE)
    def by_uuid(self, uuid: bytes | None, device: Any) -> None:
        # nvml.h:4714-4721: GPU_IS_LOST "if *any* GPU has fallen off the bus", NOT_FOUND if no match.
        if uuid is None:
            raise NvmlReturn(ERROR_INVALID_ARGUMENT)
        for gpu in self.gpus:
            if gpu.lost and "nvmlDeviceGetHandleByUUID" not in gpu.still_answers:
                raise NvmlReturn(ERROR_GPU_IS_LOST)
        for gpu in self.gpus:
            if gpu.uuid == uuid.decode():
                self._check("nvmlDeviceGetHandleByUUID", gpu)
                store(device, self.gpu_token(gpu))
                return
            for mig in gpu.migs:
                if mig.uuid and mig.uuid == uuid.decode():
                    store(device, self.mig_token(gpu, mig))
                    return
        raise NvmlReturn(ERROR_NOT_FOUND)

    # -- device identity (nvml.h:4805-5492, 6819, 8483) ---------------------------------------

    @c_function("nvmlDeviceGetName", HANDLE, CHARS, c_uint)
    def name(self, handle: int, name: int, length: int) -> None:
        device = self.device("nvmlDeviceGetName", handle)
        if device.mig is not None:
            profile = self.profile(device.gpu, device.mig.profile_id)
            put_text(name, length, f"{device.gpu.name} {profile.name}")
        else:
            put_text(name, length, device.gpu.name)

    @c_function("nvmlDeviceGetUUID", HANDLE, CHARS, c_uint)
    def uuid(self, handle: int, uuid: int, length: int) -> None:
        device = self.device("nvmlDeviceGetUUID", handle)
        put_text(uuid, length, device.mig.uuid if device.mig else device.gpu.uuid)

    @c_function("nvmlDeviceGetMinorNumber", HANDLE, U32)
    def minor(self, handle: int, minor: Any) -> None:
        device = self.device("nvmlDeviceGetMinorNumber", handle)
        if device.mig is not None:
            raise NvmlReturn(ERROR_NOT_SUPPORTED)
        store(minor, device.gpu.minor)

    @c_function("nvmlDeviceGetBrand", HANDLE, I32)
    def brand(self, handle: int, brand: Any) -> None:
        store(brand, self.device("nvmlDeviceGetBrand", handle).gpu.brand)

    @c_function("nvmlDeviceGetArchitecture", HANDLE, U32)
    def architecture(self, handle: int, arch: Any) -> None:
        store(arch, self.device("nvmlDeviceGetArchitecture", handle).gpu.architecture)

    @c_function("nvmlDeviceGetCudaComputeCapability", HANDLE, I32, I32)
    def compute_capability(self, handle: int, major: Any, minor: Any) -> None:
        gpu = self.device("nvmlDeviceGetCudaComputeCapability", handle).gpu
        store(major, gpu.cc[0])
        store(minor, gpu.cc[1])

    @c_function("nvmlDeviceGetPciInfo_v3", HANDLE, POINTER(PciInfo))
    def pci(self, handle: int, info: Any) -> None:
        gpu = self.device("nvmlDeviceGetPciInfo_v3", handle).gpu
        domain, bus, rest = gpu.bus_id.split(":")
        store(
            info,
            PciInfo(
                busIdLegacy=f"{int(domain, 16):04X}:{bus.upper()}:{rest.upper()}".encode(),
                domain=int(domain, 16),
                bus=int(bus, 16),
                device=int(rest.split(".")[0], 16),
                busId=gpu.bus_id.encode(),
            ),
        )

    @c_function("nvmlDeviceGetMemoryInfo", HANDLE, POINTER(Memory))
    def memory(self, handle: int, memory: Any) -> None:
        device = self.device("nvmlDeviceGetMemoryInfo", handle)
        if device.mig is not None:
            total = self.profile(device.gpu, device.mig.profile_id).memory_mib * MIB
            used = device.mig.memory_used
        else:
            total, used = device.gpu.memory_total, device.gpu.memory_used
        store(memory, Memory(total=total, free=total - used, used=used))

    @c_function("nvmlDeviceGetAttributes_v2", HANDLE, POINTER(DeviceAttributes))
    def attributes(self, handle: int, attributes: Any) -> None:
        device = self.device("nvmlDeviceGetAttributes_v2", handle)
        if device.mig is None:
            raise NvmlReturn(ERROR_NOT_SUPPORTED)
        p = self.profile(device.gpu, device.mig.profile_id)
        store(
            attributes,
            DeviceAttributes(
                multiprocessorCount=p.sms,
                sharedCopyEngineCount=p.copy_engines,
                sharedDecoderCount=p.decoders,
                sharedEncoderCount=p.encoders,
                sharedJpegCount=p.jpegs,
                sharedOfaCount=p.ofas,
                gpuInstanceSliceCount=p.slices,
                computeInstanceSliceCount=device.mig.ci_slices or p.slices,
                memorySizeMB=p.memory_mib,
            ),
        )

    # -- static MIG (nvml.h:12827-12882, 13083-13100, 13398-13464) ------------------------------

    @c_function("nvmlDeviceGetMigMode", HANDLE, U32, U32)
    def mig_mode(self, handle: int, current: Any, pending: Any) -> None:
        gpu = self.device("nvmlDeviceGetMigMode", handle).gpu
        if gpu.mig_mode is None:
            raise NvmlReturn(ERROR_NOT_SUPPORTED)
        store(current, gpu.mig_mode[0])
        store(pending, gpu.mig_mode[1])

    def gi_api(self, gpu: FakeGpu) -> None:
        # nvml.h: NOT_SUPPORTED "if the device doesn't have MIG mode enabled" (and the mock).
        if not gpu.gi_api or gpu.mig_mode is None or gpu.mig_mode[0] != 1:
            raise NvmlReturn(ERROR_NOT_SUPPORTED)

    def _profile_at(self, gpu: FakeGpu, index: int) -> GiProfile:
        self.gi_api(gpu)
        for p in gpu.profiles:
            if p.index == index:
                return p
        # nvml.h:12851: INVALID_ARGUMENT for a bad `profile`, NOT_SUPPORTED if the GPU lacks it.
        raise NvmlReturn(ERROR_INVALID_ARGUMENT if index >= 0x12 else ERROR_NOT_SUPPORTED)

    @staticmethod
    def _fill_profile(info: Any, p: GiProfile) -> None:
        info.id, info.isP2pSupported, info.sliceCount = p.id, 0, p.slices
        info.instanceCount, info.multiprocessorCount = p.instances, p.sms
        info.copyEngineCount, info.decoderCount, info.encoderCount = p.copy_engines, p.decoders, p.encoders
        info.jpegCount, info.ofaCount, info.memorySizeMB = p.jpegs, p.ofas, p.memory_mib

    @c_function("nvmlDeviceGetGpuInstanceProfileInfo", HANDLE, c_uint, POINTER(GiProfileInfo))
    def gi_profile_v1(self, handle: int, index: int, info: Any) -> None:
        p = self._profile_at(self.device("nvmlDeviceGetGpuInstanceProfileInfo", handle).gpu, index)
        if not info:
            raise NvmlReturn(ERROR_INVALID_ARGUMENT)
        self._fill_profile(info.contents, p)

    @c_function("nvmlDeviceGetGpuInstanceProfileInfoV", HANDLE, c_uint, POINTER(GiProfileInfoV2))
    def gi_profile_v2(self, handle: int, index: int, info: Any) -> None:
        p = self._profile_at(self.device("nvmlDeviceGetGpuInstanceProfileInfoV", handle).gpu, index)
        if not info:
            raise NvmlReturn(ERROR_INVALID_ARGUMENT)
        # nvml.h:12870-12882: ARGUMENT_VERSION_MISMATCH unless info->version is a known version.
        if info.contents.version != GI_PROFILE_INFO_V2:
            raise NvmlReturn(ERROR_ARGUMENT_VERSION_MISMATCH)
        self._fill_profile(info.contents, p)
        info.contents.name = p.name.encode()

    @c_function("nvmlDeviceGetMaxMigDeviceCount", HANDLE, U32)
    def max_migs(self, handle: int, count: Any) -> None:
        store(count, self.device("nvmlDeviceGetMaxMigDeviceCount", handle).gpu.max_migs)

    @c_function("nvmlDeviceGetMigDeviceHandleByIndex", HANDLE, c_uint, OUT_HANDLE)
    def mig_by_index(self, handle: int, index: int, mig_device: Any) -> None:
        # nvml.h:13464: NOT_FOUND "if no valid MIG device was found at index".
        gpu = self.device("nvmlDeviceGetMigDeviceHandleByIndex", handle).gpu
        migs = [m for m in gpu.migs if m.uuid]
        if index >= len(migs) or not gpu.mig_handles:
            raise NvmlReturn(ERROR_NOT_FOUND)
        store(mig_device, self.mig_token(gpu, migs[index]))

    @c_function("nvmlDeviceGetGpuInstanceId", HANDLE, U32)
    def gi_id(self, handle: int, gi_id: Any) -> None:
        device = self.device("nvmlDeviceGetGpuInstanceId", handle)
        if device.mig is None:
            raise NvmlReturn(ERROR_INVALID_ARGUMENT)  # nvml.h:13398: "not a MIG device"
        store(gi_id, device.mig.gi_id)

    @c_function("nvmlDeviceGetComputeInstanceId", HANDLE, U32)
    def ci_id(self, handle: int, ci_id: Any) -> None:
        device = self.device("nvmlDeviceGetComputeInstanceId", handle)
        if device.mig is None:
            raise NvmlReturn(ERROR_INVALID_ARGUMENT)
        store(ci_id, device.mig.ci_id)

    @c_function("nvmlDeviceGetGpuInstanceById", HANDLE, c_uint, OUT_HANDLE)
    def gi_by_id(self, handle: int, gi_id: int, instance: Any) -> None:
        gpu = self.device("nvmlDeviceGetGpuInstanceById", handle).gpu
        self.gi_api(gpu)
        for mig in gpu.migs:
            if mig.gi_id == gi_id:
                store(instance, self.token(FakeInstance(gpu, mig), "gi", mig))
                return
        raise NvmlReturn(ERROR_NOT_FOUND)

    def instance(self, name: str, handle: int | None) -> FakeInstance:
        found: FakeInstance = self._object(handle, FakeInstance)
        self._check(name, found.gpu)
        if not any(m is found.mig for m in found.gpu.migs):
            raise NvmlReturn(ERROR_INVALID_ARGUMENT)  # destroyed: the handle is no longer valid
        return found

    @c_function("nvmlGpuInstanceGetInfo", HANDLE, POINTER(GiInfo))
    def gi_info(self, handle: int, info: Any) -> None:
        found = self.instance("nvmlGpuInstanceGetInfo", handle)
        result = GiInfo(device=self.gpu_token(found.gpu), id=found.mig.gi_id, profileId=found.mig.profile_id)
        result.placement.start, result.placement.size = found.mig.start, found.mig.size
        store(info, result)
