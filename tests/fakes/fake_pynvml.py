"""A fake `pynvml` module for tests, faithful at the library boundary.

`FakeNvml(gpus).module` is a module object with the real function names, return types and
constants. It reuses the real `pynvml`'s exception classes (``NVMLError(code)`` builds the
subclass for the code, e.g. ``NVMLError_NotSupported``), constants and ctypes structures (memory
info, PCI info, utilization, GPU instance profile/instance info, device attributes, field values)
so it cannot drift from nvidia-ml-py. Handles are plain Python objects (the real ones are ctypes
pointers that nothing outside NVML looks into); event data is a small object with the real field
names because a ctypes structure cannot hold a Python handle.

Tests feed events with `FakeNvml.emit` / `emit_error`, make calls fail with `fail`, lose a GPU
with `lose`, make a function block like a wedged driver with `hang` (until `release`), and set
`recovery_action`. Fixtures: `a100_mig` (A100-SXM4-80GB with MIG devices),
`a100_full_mig` (one 7g.80gb), `h100` (H100 80GB HBM3, MIG off), `l4` (no MIG), `t4` (retired
pages, no row remapping), `l40s` (neither).

NVIDIA's own mock NVML (k8s-test-infra ``mocknvml``) behaves differently in places (see
/work/shared/reference/nvml-mock-vs-fake.md); `as_mock` makes a GPU answer as the mock does
(XID-only events, no recovery-action field, no GPU-instance API, no MIG handles), `lose(...,
event=False)` loses a GPU as its ``lost`` mode does (getters GPU_IS_LOST, waits time out),
`fall_off_bus` as its ``fallen_off_bus`` mode (XID 79 whose device can no longer be read) and
`raise_ecc` makes the ECC counters rise with no event.
"""

from __future__ import annotations

import queue
import threading
import types
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pynvml as real

XID_CRITICAL = int(real.nvmlEventTypeXidCriticalError)
DOUBLE_BIT_ECC = int(real.nvmlEventTypeDoubleBitEccError)
SINGLE_BIT_ECC = int(real.nvmlEventTypeSingleBitEccError)
ALL_HEALTH_EVENTS = XID_CRITICAL | DOUBLE_BIT_ECC | SINGLE_BIT_ECC
ANY_ID = 0xFFFFFFFF
MIB = 1024 * 1024


def error(code: int) -> Exception:
    """The real pynvml exception for `code` (an ``NVMLError_*`` subclass instance)."""
    exc: Exception = real.NVMLError(code)
    return exc


@dataclass
class GiProfile:
    """One GPU instance profile (what ``nvmlDeviceGetGpuInstanceProfileInfo`` returns)."""

    index: int
    id: int
    slices: int
    instances: int
    sms: int
    copy_engines: int
    decoders: int
    encoders: int
    jpegs: int
    ofas: int
    memory_mib: int
    name: str


@dataclass
class FakeMig:
    """One existing MIG device (GPU instance + compute instance)."""

    uuid: str
    gi_id: int
    ci_id: int
    profile_id: int
    start: int
    size: int
    ci_slices: int | None = None
    memory_used: int = 0


@dataclass
class FakeGpu:
    """One GPU's state, as NVML would report it."""

    name: str
    uuid: str
    minor: int
    bus_id: str
    architecture: int
    cc: tuple[int, int]
    memory_total: int
    brand: int = int(real.NVML_BRAND_NVIDIA)
    memory_used: int = 0
    mig_mode: tuple[int, int] | None = (0, 0)
    profiles: list[GiProfile] = field(default_factory=list)
    migs: list[FakeMig] = field(default_factory=list)
    max_migs: int = 7
    supported_events: int = ALL_HEALTH_EVENTS | int(real.nvmlEventTypePState)
    utilization: int = 0
    temperature: int = 35
    power_mw: int = 60_000
    ecc_corrected: int = 0
    ecc_uncorrected: int = 0
    recovery_action: int | None = int(real.NVML_GPU_RECOVERY_ACTION_NONE)
    """None: the field answers NOT_SUPPORTED (older drivers, NVIDIA's mock)."""
    ecc: bool = True
    """False: the ECC counters answer NOT_SUPPORTED (ECC off, consumer GPUs)."""
    retired_pages: list[int] | None = None
    """Retired page addresses; None: no page retirement on this GPU (Ampere and later: NOT_SUPPORTED)."""
    retired_pending: bool = False
    remapped_rows: tuple[int, int, int, int] | None = (0, 0, 0, 0)
    """(correctable rows, uncorrectable rows, pending, failure occurred); None: no row remapping."""
    pcie_replays: int | None = 0
    nvlinks: list[bool] = field(default_factory=list)
    """NVLink state per link (True: active); empty: no NVLink (the link calls answer NOT_SUPPORTED)."""
    nvlink_errors: dict[tuple[int, int], int] = field(default_factory=dict)
    """(link, NVML_NVLINK_ERROR_DL_*) -> count."""
    gi_api: bool = True
    """False: the GPU-instance calls answer NOT_SUPPORTED (NVIDIA's mock; nvml.h: MIG not enabled)."""
    mig_handles: bool = True
    """False: nvmlDeviceGetMigDeviceHandleByIndex answers NOT_FOUND for every slot (NVIDIA's mock)."""
    lost: bool = False
    failures: dict[str, int] = field(default_factory=dict)
    """NVML function name -> error code it raises for this GPU."""


@dataclass(frozen=True)
class FakeHandle:
    """A device handle: a GPU, or a MIG device of it."""

    gpu: FakeGpu = field(compare=False)
    mig: FakeMig | None = field(default=None, compare=False)
    key: str = ""


@dataclass(frozen=True)
class FakeGpuInstance:
    gpu: FakeGpu = field(compare=False)
    mig: FakeMig = field(compare=False)


@dataclass(frozen=True)
class FakeEventData:
    """``c_nvmlEventData_t`` with a Python handle in ``device``."""

    device: FakeHandle
    eventType: int
    eventData: int
    gpuInstanceId: int = ANY_ID
    computeInstanceId: int = ANY_ID


class FakeEventSet:
    """An event set: registrations plus a queue tests feed."""

    def __init__(self) -> None:
        self.registered: dict[str, int] = {}
        self.queue: queue.Queue[FakeEventData | Exception] = queue.Queue()
        self.freed = False
        self.waits = 0


A100_PROFILES = [
    GiProfile(0, 19, 1, 7, 14, 1, 0, 0, 0, 0, 9728, "MIG 1g.10gb"),
    GiProfile(1, 14, 2, 3, 28, 2, 1, 0, 0, 0, 19968, "MIG 2g.20gb"),
    GiProfile(2, 9, 3, 2, 42, 3, 2, 0, 0, 0, 40192, "MIG 3g.40gb"),
    GiProfile(3, 5, 4, 1, 56, 4, 2, 0, 0, 0, 40192, "MIG 4g.40gb"),
    GiProfile(4, 0, 7, 1, 98, 7, 5, 0, 1, 1, 80896, "MIG 7g.80gb"),
    GiProfile(7, 20, 1, 1, 14, 1, 1, 0, 1, 1, 9728, "MIG 1g.10gb+me"),
    GiProfile(9, 15, 1, 4, 14, 1, 1, 0, 0, 0, 19968, "MIG 1g.20gb"),
]


def a100_mig(minor: int = 0, bus: str = "00000000:07:00.0") -> FakeGpu:
    """A100-SXM4-80GB in MIG mode with 3g.40gb, 2g.20gb and two 1g.10gb devices."""
    return FakeGpu(
        name="NVIDIA A100-SXM4-80GB",
        uuid=f"GPU-a100{minor:04d}-0000-0000-0000-000000000000",
        minor=minor,
        bus_id=bus,
        architecture=int(real.NVML_DEVICE_ARCH_AMPERE),
        cc=(8, 0),
        memory_total=81920 * MIB,
        mig_mode=(1, 1),
        profiles=list(A100_PROFILES),
        nvlinks=[True] * 12,
        migs=[
            FakeMig(f"MIG-a100{minor:04d}-0001-0000-0000-000000000000", 2, 0, 9, 4, 4),
            FakeMig(f"MIG-a100{minor:04d}-0002-0000-0000-000000000000", 3, 0, 14, 0, 2),
            FakeMig(f"MIG-a100{minor:04d}-0003-0000-0000-000000000000", 9, 0, 19, 2, 1),
            FakeMig(f"MIG-a100{minor:04d}-0004-0000-0000-000000000000", 10, 0, 19, 3, 1),
        ],
    )


def a100_full_mig(minor: int = 1, bus: str = "00000000:0f:00.0") -> FakeGpu:
    """A100-SXM4-80GB in MIG mode with one 7g.80gb device."""
    gpu = a100_mig(minor, bus)
    gpu.migs = [FakeMig(f"MIG-a100{minor:04d}-0007-0000-0000-000000000000", 0, 0, 0, 0, 8)]
    return gpu


def h100(minor: int = 2, bus: str = "00000000:18:00.0") -> FakeGpu:
    """H100 80GB HBM3, MIG capable but off."""
    return FakeGpu(
        name="NVIDIA H100 80GB HBM3",
        uuid=f"GPU-h100{minor:04d}-0000-0000-0000-000000000000",
        minor=minor,
        bus_id=bus,
        architecture=int(real.NVML_DEVICE_ARCH_HOPPER),
        cc=(9, 0),
        memory_total=81559 * MIB,
        mig_mode=(0, 0),
        nvlinks=[True] * 18,
    )


def l4(minor: int = 3, bus: str = "00000000:3B:00.0") -> FakeGpu:
    """L4: no MIG (GetMigMode is NOT_SUPPORTED)."""
    return FakeGpu(
        name="NVIDIA L4",
        uuid=f"GPU-0l40{minor:04d}-0000-0000-0000-000000000000",
        minor=minor,
        bus_id=bus,
        architecture=int(real.NVML_DEVICE_ARCH_ADA),
        cc=(8, 9),
        memory_total=23034 * MIB,
        mig_mode=None,
        max_migs=0,
        remapped_rows=None,
    )


def t4(minor: int = 4, bus: str = "00000000:5E:00.0") -> FakeGpu:
    """T4 (Turing): page retirement, no row remapping, no NVLink, no MIG."""
    return FakeGpu(
        name="Tesla T4",
        uuid=f"GPU-00t4{minor:04d}-0000-0000-0000-000000000000",
        minor=minor,
        bus_id=bus,
        architecture=int(real.NVML_DEVICE_ARCH_TURING),
        cc=(7, 5),
        memory_total=15360 * MIB,
        brand=int(real.NVML_BRAND_TESLA),
        mig_mode=None,
        max_migs=0,
        retired_pages=[],
        remapped_rows=None,
    )


def l40s(minor: int = 5, bus: str = "00000000:86:00.0") -> FakeGpu:
    """L40S (Ada): neither page retirement nor row remapping, no NVLink, no MIG."""
    return FakeGpu(
        name="NVIDIA L40S",
        uuid=f"GPU-l40s{minor:04d}-0000-0000-0000-000000000000",
        minor=minor,
        bus_id=bus,
        architecture=int(real.NVML_DEVICE_ARCH_ADA),
        cc=(8, 9),
        memory_total=46068 * MIB,
        mig_mode=None,
        max_migs=0,
        remapped_rows=None,
    )


def as_mock(gpu: FakeGpu) -> FakeGpu:
    """`gpu` answering as NVIDIA's mock NVML does: XID events only, no recovery-action field, no
    GPU-instance API and no MIG device handles (the mock implements neither)."""
    gpu.supported_events = XID_CRITICAL
    gpu.recovery_action = None
    gpu.gi_api = False
    gpu.mig_handles = False
    return gpu


class FakeNvml:
    """The state behind the fake module; `module` is what the backend gets as `pynvml`."""

    def __init__(
        self,
        gpus: Sequence[FakeGpu] = (),
        *,
        driver_version: str = "550.54.15",
        cuda_version: int = 12040,
        init_error: int | None = None,
        missing: Iterable[str] = (),
    ) -> None:
        self.gpus = list(gpus)
        self.driver_version = driver_version
        self.cuda_version = cuda_version
        self.init_error = init_error
        self.missing = set(missing)
        """Function names the 'driver' is too old for (they raise FunctionNotFound)."""
        self.initialized = 0
        self.event_sets: list[FakeEventSet] = []
        self.calls: list[str] = []
        self.hung: set[str] = set()
        """NVML function names whose calls block until `release` (a wedged driver)."""
        self._released = threading.Event()
        self._lock = threading.Lock()
        self.module = self._build_module()

    # -- test controls ------------------------------------------------------------------------

    def gpu(self, uuid: str) -> FakeGpu:
        return next(g for g in self.gpus if g.uuid == uuid)

    def emit(self, gpu_uuid: str, event_type: int, data: int = 0, gi: int = ANY_ID, ci: int = ANY_ID) -> None:
        """Deliver an event to every event set where the GPU registered that type."""
        gpu = self.gpu(gpu_uuid)
        event = FakeEventData(FakeHandle(gpu, key=gpu.uuid), event_type, data, gi, ci)
        for event_set in self.event_sets:
            if not event_set.freed and event_set.registered.get(gpu_uuid, 0) & event_type:
                event_set.queue.put(event)

    def emit_error(self, code: int) -> None:
        """Make the next wait of every live event set raise NVMLError(code)."""
        for event_set in self.event_sets:
            if not event_set.freed:
                event_set.queue.put(error(code))

    def lose(self, gpu_uuid: str, *, event: bool = True) -> None:
        """The GPU falls off the bus: its calls raise GPU_IS_LOST and waits report it.

        ``event=False`` is the mock's ``lost`` mode: the getters (handle lookups too) answer
        GPU_IS_LOST but no wait reports anything; waits keep timing out.
        """
        self.gpu(gpu_uuid).lost = True
        if event:
            self.emit_error(int(real.NVML_ERROR_GPU_IS_LOST))

    def fall_off_bus(self, gpu_uuid: str, xid: int = 79) -> None:
        """The mock's ``fallen_off_bus`` mode: XID 79 is delivered, but reading the event's device
        (its UUID) already answers GPU_IS_LOST, as does every getter of the GPU."""
        self.emit(gpu_uuid, XID_CRITICAL, xid)
        self.gpu(gpu_uuid).lost = True

    def raise_ecc(self, gpu_uuid: str, uncorrected: int = 0, corrected: int = 0) -> None:
        """The volatile ECC counters rise with no event (the mock's ``ecc_uncorrectable`` mode)."""
        gpu = self.gpu(gpu_uuid)
        gpu.ecc_uncorrected += uncorrected
        gpu.ecc_corrected += corrected

    def count(self, name: str) -> int:
        """How many calls of NVML function `name` were made so far."""
        with self._lock:
            return self.calls.count(name)

    def fail(self, gpu_uuid: str, function: str, code: int) -> None:
        self.gpu(gpu_uuid).failures[function] = code

    def hang(self, function: str) -> None:
        """Calls of `function` block (in their thread) until `release`."""
        self.hung.add(function)

    def release(self) -> None:
        """Let every hung call return (as it would have)."""
        self.hung.clear()
        self._released.set()

    # -- helpers ------------------------------------------------------------------------------

    def _enter(self, name: str, handle: FakeHandle | None = None) -> None:
        with self._lock:
            self.calls.append(name)
        if name in self.hung:
            self._released.wait()
        if name in self.missing:
            raise error(int(real.NVML_ERROR_FUNCTION_NOT_FOUND))
        if name not in ("nvmlInit", "nvmlInitWithFlags") and not self.initialized:
            raise error(int(real.NVML_ERROR_UNINITIALIZED))
        if handle is not None:
            if handle.gpu.lost:
                raise error(int(real.NVML_ERROR_GPU_IS_LOST))
            code = handle.gpu.failures.get(name)
            if code is not None:
                raise error(code)

    def _gpu_handle(self, gpu: FakeGpu) -> FakeHandle:
        return FakeHandle(gpu, key=gpu.uuid)

    def _profile(self, gpu: FakeGpu, profile_id: int) -> GiProfile:
        for p in gpu.profiles:
            if p.id == profile_id:
                return p
        raise error(int(real.NVML_ERROR_NOT_FOUND))

    def _build_module(self) -> types.ModuleType:
        module = types.ModuleType("pynvml")
        # Constants, exception classes and structures of the real module.
        for name in dir(real):
            if name.startswith(("NVML", "nvmlEventType", "c_nvml", "nvmlPciInfo", "NVMLError")):
                setattr(module, name, getattr(real, name))
        for name in dir(self):
            if name.startswith("nvml"):
                setattr(module, name, getattr(self, name))
        module.__dict__["fake"] = self
        return module

    # -- system -------------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self._enter("nvmlInit")
        if self.init_error is not None:
            raise error(self.init_error)
        self.initialized += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self.initialized -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return self.driver_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._enter("nvmlSystemGetCudaDriverVersion")
        return self.cuda_version

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise error(int(real.NVML_ERROR_INVALID_ARGUMENT))
        gpu = self.gpus[index]
        if gpu.lost:
            raise error(int(real.NVML_ERROR_GPU_IS_LOST))
        return self._gpu_handle(gpu)

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> FakeHandle:
        self._enter("nvmlDeviceGetHandleByUUID")
        wanted = uuid.decode() if isinstance(uuid, bytes) else uuid
        for gpu in self.gpus:
            if gpu.uuid == wanted:
                if gpu.lost:
                    raise error(int(real.NVML_ERROR_GPU_IS_LOST))
                return self._gpu_handle(gpu)
        raise error(int(real.NVML_ERROR_NOT_FOUND))

    # -- device properties --------------------------------------------------------------------

    def nvmlDeviceGetName(self, handle: FakeHandle) -> str:
        self._enter("nvmlDeviceGetName", handle)
        if handle.mig is not None:
            profile = self._profile(handle.gpu, handle.mig.profile_id)
            return f"{handle.gpu.name} {profile.name}"
        return handle.gpu.name

    def nvmlDeviceGetUUID(self, handle: FakeHandle) -> str:
        self._enter("nvmlDeviceGetUUID", handle)
        return handle.mig.uuid if handle.mig else handle.gpu.uuid

    def nvmlDeviceGetMinorNumber(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetMinorNumber", handle)
        if handle.mig is not None:
            raise error(int(real.NVML_ERROR_NOT_SUPPORTED))
        return handle.gpu.minor

    def nvmlDeviceGetBrand(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetBrand", handle)
        return handle.gpu.brand

    def nvmlDeviceGetArchitecture(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetArchitecture", handle)
        return handle.gpu.architecture

    def nvmlDeviceGetCudaComputeCapability(self, handle: FakeHandle) -> tuple[int, int]:
        self._enter("nvmlDeviceGetCudaComputeCapability", handle)
        return handle.gpu.cc

    def nvmlDeviceGetPciInfo(self, handle: FakeHandle) -> Any:
        self._enter("nvmlDeviceGetPciInfo", handle)
        info = real.nvmlPciInfo_t()
        info.busId = handle.gpu.bus_id.encode()
        info.busIdLegacy = handle.gpu.bus_id.encode()
        domain, bus, rest = handle.gpu.bus_id.split(":")
        info.domain, info.bus, info.device = int(domain, 16), int(bus, 16), int(rest.split(".")[0], 16)
        return info

    def nvmlDeviceGetMemoryInfo(self, handle: FakeHandle, version: int | None = None) -> Any:
        self._enter("nvmlDeviceGetMemoryInfo", handle)
        if handle.mig is not None:
            total = self._profile(handle.gpu, handle.mig.profile_id).memory_mib * MIB
            used = handle.mig.memory_used
        else:
            total, used = handle.gpu.memory_total, handle.gpu.memory_used
        return real.c_nvmlMemory_t(total=total, free=total - used, used=used)

    def nvmlDeviceGetMigMode(self, handle: FakeHandle) -> list[int]:
        self._enter("nvmlDeviceGetMigMode", handle)
        if handle.gpu.mig_mode is None:
            raise error(int(real.NVML_ERROR_NOT_SUPPORTED))
        return list(handle.gpu.mig_mode)

    def _gi_api(self, handle: FakeHandle) -> None:
        # nvml.h: NOT_SUPPORTED "if the device doesn't have MIG mode enabled" (and the mock).
        if not handle.gpu.gi_api:
            raise error(int(real.NVML_ERROR_NOT_SUPPORTED))

    def nvmlDeviceGetGpuInstanceProfileInfo(self, handle: FakeHandle, profile: int, version: int = 2) -> Any:
        self._enter("nvmlDeviceGetGpuInstanceProfileInfo", handle)
        self._gi_api(handle)
        if version == 2 and "nvmlDeviceGetGpuInstanceProfileInfoV" in self.missing:
            raise error(int(real.NVML_ERROR_FUNCTION_NOT_FOUND))
        for p in handle.gpu.profiles:
            if p.index == profile:
                info = real.c_nvmlGpuInstanceProfileInfo_v2_t()
                info.id, info.isP2pSupported, info.sliceCount = p.id, 0, p.slices
                info.instanceCount, info.multiprocessorCount = p.instances, p.sms
                info.copyEngineCount, info.decoderCount, info.encoderCount = (
                    p.copy_engines,
                    p.decoders,
                    p.encoders,
                )
                info.jpegCount, info.ofaCount, info.memorySizeMB = p.jpegs, p.ofas, p.memory_mib
                if version == 1:
                    v1 = real.c_nvmlGpuInstanceProfileInfo_t()
                    for name, _ in v1._fields_:
                        setattr(v1, name, getattr(info, name))
                    return v1
                info.name = p.name.encode()
                return info
        raise error(int(real.NVML_ERROR_NOT_SUPPORTED))

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetMaxMigDeviceCount", handle)
        return handle.gpu.max_migs

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: FakeHandle, index: int) -> FakeHandle:
        self._enter("nvmlDeviceGetMigDeviceHandleByIndex", handle)
        if index >= len(handle.gpu.migs) or not handle.gpu.mig_handles:
            raise error(int(real.NVML_ERROR_NOT_FOUND))
        mig = handle.gpu.migs[index]
        return FakeHandle(handle.gpu, mig, key=mig.uuid)

    def nvmlDeviceGetGpuInstanceId(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetGpuInstanceId", handle)
        if handle.mig is None:
            raise error(int(real.NVML_ERROR_INVALID_ARGUMENT))
        return handle.mig.gi_id

    def nvmlDeviceGetComputeInstanceId(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetComputeInstanceId", handle)
        if handle.mig is None:
            raise error(int(real.NVML_ERROR_INVALID_ARGUMENT))
        return handle.mig.ci_id

    def nvmlDeviceGetGpuInstanceById(self, handle: FakeHandle, gi_id: int) -> FakeGpuInstance:
        self._enter("nvmlDeviceGetGpuInstanceById", handle)
        self._gi_api(handle)
        for mig in handle.gpu.migs:
            if mig.gi_id == gi_id:
                return FakeGpuInstance(handle.gpu, mig)
        raise error(int(real.NVML_ERROR_NOT_FOUND))

    def nvmlGpuInstanceGetInfo(self, instance: FakeGpuInstance) -> Any:
        self._enter("nvmlGpuInstanceGetInfo", FakeHandle(instance.gpu))
        info = real.c_nvmlGpuInstanceInfo_t()
        info.id, info.profileId = instance.mig.gi_id, instance.mig.profile_id
        info.placement.start, info.placement.size = instance.mig.start, instance.mig.size
        return info

    def nvmlDeviceGetAttributes(self, handle: FakeHandle) -> Any:
        self._enter("nvmlDeviceGetAttributes", handle)
        if handle.mig is None:
            raise error(int(real.NVML_ERROR_NOT_SUPPORTED))
        p = self._profile(handle.gpu, handle.mig.profile_id)
        attrs = real.c_nvmlDeviceAttributes()
        attrs.multiprocessorCount, attrs.sharedCopyEngineCount = p.sms, p.copy_engines
        attrs.sharedDecoderCount, attrs.sharedEncoderCount = p.decoders, p.encoders
        attrs.sharedJpegCount, attrs.sharedOfaCount = p.jpegs, p.ofas
        attrs.gpuInstanceSliceCount = p.slices
        attrs.computeInstanceSliceCount = handle.mig.ci_slices or p.slices
        attrs.memorySizeMB = p.memory_mib
        return attrs

    # -- telemetry ----------------------------------------------------------------------------

    def nvmlDeviceGetUtilizationRates(self, handle: FakeHandle) -> Any:
        self._enter("nvmlDeviceGetUtilizationRates", handle)
        if handle.mig is not None:
            raise error(int(real.NVML_ERROR_NOT_SUPPORTED))
        return real.c_nvmlUtilization_t(gpu=handle.gpu.utilization, memory=0)

    def nvmlDeviceGetTemperature(self, handle: FakeHandle, sensor: int) -> int:
        self._enter("nvmlDeviceGetTemperature", handle)
        return handle.gpu.temperature

    def nvmlDeviceGetPowerUsage(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetPowerUsage", handle)
        return handle.gpu.power_mw

    def nvmlDeviceGetTotalEccErrors(self, handle: FakeHandle, error_type: int, counter_type: int) -> int:
        self._enter("nvmlDeviceGetTotalEccErrors", handle)
        if not handle.gpu.ecc or handle.mig is not None:
            raise error(int(real.NVML_ERROR_NOT_SUPPORTED))
        corrected = int(real.NVML_MEMORY_ERROR_TYPE_CORRECTED)
        return handle.gpu.ecc_corrected if error_type == corrected else handle.gpu.ecc_uncorrected

    def nvmlDeviceGetFieldValues(self, handle: FakeHandle, field_ids: Sequence[int]) -> Any:
        self._enter("nvmlDeviceGetFieldValues", handle)
        values = (real.c_nvmlFieldValue_t * len(field_ids))()
        for i, field_id in enumerate(field_ids):
            values[i].fieldId = field_id
            action = handle.gpu.recovery_action
            if field_id == real.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION and action is not None:
                values[i].nvmlReturn = real.NVML_SUCCESS
                values[i].valueType = real.NVML_VALUE_TYPE_UNSIGNED_INT
                values[i].value.uiVal = action
            else:
                values[i].nvmlReturn = real.NVML_ERROR_NOT_SUPPORTED
        return values

    def nvmlDeviceGetRetiredPages(self, handle: FakeHandle, sourceFilter: int) -> list[int]:
        self._enter("nvmlDeviceGetRetiredPages", handle)
        if handle.gpu.retired_pages is None or handle.mig is not None:
            raise error(int(real.NVML_ERROR_NOT_SUPPORTED))
        return list(handle.gpu.retired_pages)

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetRetiredPagesPendingStatus", handle)
        if handle.gpu.retired_pages is None or handle.mig is not None:
            raise error(int(real.NVML_ERROR_NOT_SUPPORTED))
        return int(real.NVML_FEATURE_ENABLED if handle.gpu.retired_pending else real.NVML_FEATURE_DISABLED)

    def nvmlDeviceGetRemappedRows(self, handle: FakeHandle) -> tuple[int, int, int, int]:
        self._enter("nvmlDeviceGetRemappedRows", handle)
        if handle.gpu.remapped_rows is None or handle.mig is not None:
            raise error(int(real.NVML_ERROR_NOT_SUPPORTED))
        return handle.gpu.remapped_rows

    def nvmlDeviceGetPcieReplayCounter(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetPcieReplayCounter", handle)
        if handle.gpu.pcie_replays is None or handle.mig is not None:
            raise error(int(real.NVML_ERROR_NOT_SUPPORTED))
        return handle.gpu.pcie_replays

    def _link(self, handle: FakeHandle, link: int) -> None:
        if not handle.gpu.nvlinks or handle.mig is not None:
            raise error(int(real.NVML_ERROR_NOT_SUPPORTED))
        if not 0 <= link < len(handle.gpu.nvlinks):
            raise error(int(real.NVML_ERROR_INVALID_ARGUMENT))

    def nvmlDeviceGetNvLinkState(self, device: FakeHandle, link: int) -> int:
        self._enter("nvmlDeviceGetNvLinkState", device)
        self._link(device, link)
        return int(real.NVML_FEATURE_ENABLED if device.gpu.nvlinks[link] else real.NVML_FEATURE_DISABLED)

    def nvmlDeviceGetNvLinkErrorCounter(self, device: FakeHandle, link: int, counter: int) -> int:
        self._enter("nvmlDeviceGetNvLinkErrorCounter", device)
        self._link(device, link)
        if not 0 <= counter < int(real.NVML_NVLINK_ERROR_COUNT):
            raise error(int(real.NVML_ERROR_INVALID_ARGUMENT))
        return device.gpu.nvlink_errors.get((link, counter), 0)

    # -- events -------------------------------------------------------------------------------

    def nvmlEventSetCreate(self) -> FakeEventSet:
        self._enter("nvmlEventSetCreate")
        event_set = FakeEventSet()
        self.event_sets.append(event_set)
        return event_set

    def nvmlDeviceGetSupportedEventTypes(self, handle: FakeHandle) -> int:
        self._enter("nvmlDeviceGetSupportedEventTypes", handle)
        return handle.gpu.supported_events

    def nvmlDeviceRegisterEvents(self, handle: FakeHandle, event_types: int, event_set: FakeEventSet) -> None:
        self._enter("nvmlDeviceRegisterEvents", handle)
        if event_types & ~handle.gpu.supported_events:
            raise error(int(real.NVML_ERROR_NOT_SUPPORTED))
        event_set.registered[handle.gpu.uuid] = event_set.registered.get(handle.gpu.uuid, 0) | event_types

    def nvmlEventSetWait_v2(self, event_set: FakeEventSet, timeout_ms: int) -> FakeEventData:
        self._enter("nvmlEventSetWait_v2")
        event_set.waits += 1
        try:
            item = event_set.queue.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise error(int(real.NVML_ERROR_TIMEOUT)) from None
        if isinstance(item, Exception):
            raise item
        return item

    def nvmlEventSetWait(self, event_set: FakeEventSet, timeout_ms: int) -> FakeEventData:
        return self.nvmlEventSetWait_v2(event_set, timeout_ms)

    def nvmlEventSetFree(self, event_set: FakeEventSet) -> None:
        self._enter("nvmlEventSetFree")
        event_set.freed = True


def install(monkeypatch: Any, fake: FakeNvml) -> types.ModuleType:
    """Install `fake` as ``sys.modules['pynvml']`` (for code that imports pynvml itself)."""
    monkeypatch.setitem(__import__("sys").modules, "pynvml", fake.module)
    return fake.module


# -- dynamic MIG: GPU-instance and compute-instance creation and destruction ------------------
#
# Kept apart from `FakeNvml` (other tests change that class): `MigNvml` adds the calls the
# dynamic-MIG backend makes, with pynvml's names, signatures, return types and error classes.
# Profiles and placements come from `backends.fake.migtables` (NVIDIA's MIG user guide tables).

NO_CI = -1
"""`FakeMig.ci_id` of a GPU instance without a compute instance (no MIG device handle yet)."""
# NVML_COMPUTE_INSTANCE_PROFILE_* index -> compute slices.
CI_PROFILE_SLICES = {0: 1, 1: 2, 2: 3, 3: 4, 4: 7, 5: 8, 6: 6}


@dataclass(frozen=True)
class FakeComputeInstance:
    gpu: FakeGpu = field(compare=False)
    mig: FakeMig = field(compare=False)


def dynamic_gpu(product: str, minor: int, bus: str | None = None) -> FakeGpu:
    """A GPU of `product` (a `migtables.BY_PRODUCT` key) in MIG mode with no MIG device."""
    from backends.fake import migtables

    table = migtables.BY_PRODUCT[product]
    h100 = "H100" in product
    profiles = [
        GiProfile(
            index, p.profile_id, p.slices, len(p.placements), p.multiprocessors, p.copy_engines,
            p.decoders, p.encoders, p.jpegs, p.ofas, p.memory_mib, f"MIG {p.name}",
        )
        for index, p in table.items()
    ]  # fmt: skip
    memory = {"NVIDIA A100-SXM4-80GB": 81920, "NVIDIA A100-SXM4-40GB": 40960}.get(product, 81559)
    return FakeGpu(
        name=product,
        uuid=f"GPU-d{minor:03d}{'h100' if h100 else 'a100'}-0000-0000-0000-000000000000",
        minor=minor,
        bus_id=bus or f"00000000:{0x10 + minor:02x}:00.0",
        architecture=int(real.NVML_DEVICE_ARCH_HOPPER if h100 else real.NVML_DEVICE_ARCH_AMPERE),
        cc=(9, 0) if h100 else (8, 0),
        memory_total=memory * MIB,
        mig_mode=(1, 1),
        profiles=profiles,
    )


class MigNvml(FakeNvml):
    """`FakeNvml` plus GPU-instance profiles, placements, creation and destruction.

    `mig_hook(phase, call)` runs "before" and "after" each create/destroy (the crash tests kill
    the process there and persist `FakeGpu.migs` as the driver would keep them). With `proc_root`
    and `dev_root`, creating an instance also makes its MIG capability file
    (``driver/nvidia/capabilities/gpu<N>/mig/gi<G>[/ci<C>]/access``) and device node
    (``nvidia-caps/nvidia-cap<minor>``), as ``nvidia-modprobe`` would on a host that runs it;
    with ``make_nodes=False`` only the file, as the driver alone does. Destroying removes the file.
    """

    def __init__(
        self,
        gpus: Sequence[FakeGpu] = (),
        *,
        proc_root: Path | None = None,
        dev_root: Path | None = None,
        make_nodes: bool = True,
        **kwargs: Any,
    ) -> None:
        self.proc_root, self.dev_root = proc_root, dev_root
        self.make_nodes = make_nodes
        self.mig_hook: Any = None
        self.once: dict[str, int] = {}
        """NVML function name -> error code it raises at its next call only (a transient failure)."""
        self._next_uuid = 0
        super().__init__(gpus, **kwargs)

    def fail_once(self, function: str, code: int) -> None:
        self.once[function] = code

    def _enter(self, name: str, handle: FakeHandle | None = None) -> None:
        code = self.once.pop(name, None)
        if code is not None:
            self.calls.append(name)
            raise error(code)
        super()._enter(name, handle)

    def _hook(self, phase: str, call: str) -> None:
        if self.mig_hook is not None:
            self.mig_hook(phase, call)

    def _capability(self, gpu: FakeGpu, gi: int, ci: int | None, create: bool) -> None:
        if self.proc_root is None or self.dev_root is None:
            return
        base = self.proc_root / "driver" / "nvidia" / "capabilities" / f"gpu{gpu.minor}" / "mig" / f"gi{gi}"
        path = base / "access" if ci is None else base / f"ci{ci}" / "access"
        minor = 1000 + gpu.minor * 200 + gi * 8 + (0 if ci is None else 1 + ci)
        if create:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"DeviceFileMinor: {minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n")
            if not self.make_nodes:
                return
            node = self.dev_root / "nvidia-caps" / f"nvidia-cap{minor}"
            node.parent.mkdir(parents=True, exist_ok=True)
            node.touch()
        else:
            path.unlink(missing_ok=True)

    def _layout(self, gpu: FakeGpu) -> Any:
        from backends.fake import migtables

        layout = migtables.layout_for(gpu.name)
        if layout is None or gpu.mig_mode is None or gpu.mig_mode[0] != 1:
            raise error(int(real.NVML_ERROR_NOT_SUPPORTED))
        return layout

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: FakeHandle, index: int) -> FakeHandle:
        self._enter("nvmlDeviceGetMigDeviceHandleByIndex", handle)
        migs = [m for m in handle.gpu.migs if m.ci_id != NO_CI]
        if index >= len(migs) or not handle.gpu.mig_handles:
            raise error(int(real.NVML_ERROR_NOT_FOUND))
        return FakeHandle(handle.gpu, migs[index], key=migs[index].uuid)

    def nvmlDeviceGetGpuInstanceProfileInfoV(self, handle: FakeHandle, profile: int, version: int = 2) -> Any:
        self._enter("nvmlDeviceGetGpuInstanceProfileInfoV", handle)
        return self.nvmlDeviceGetGpuInstanceProfileInfo(handle, profile, version)

    def nvmlDeviceGetGpuInstancePossiblePlacements(
        self, handle: FakeHandle, profileId: int, placementsRef: Any, countRef: Any
    ) -> int:
        self._enter("nvmlDeviceGetGpuInstancePossiblePlacements", handle)
        self._gi_api(handle)
        try:
            placements = self._layout(handle.gpu).profile(profileId).placements
        except LookupError:
            raise error(int(real.NVML_ERROR_NOT_SUPPORTED)) from None
        count = countRef._obj  # ctypes.byref(c_uint)
        if placementsRef is not None:
            if count.value < len(placements):
                raise error(int(real.NVML_ERROR_INSUFFICIENT_SIZE))
            for i, p in enumerate(placements):
                placementsRef[i].start, placementsRef[i].size = p.start, p.size
        count.value = len(placements)
        return int(real.NVML_SUCCESS)

    def nvmlDeviceCreateGpuInstanceWithPlacement(
        self, handle: FakeHandle, profileId: int, placement: Any
    ) -> Any:
        from backends.nvidia.migprofiles import Placement, fits, taken_counters

        self._hook("before", "nvmlDeviceCreateGpuInstanceWithPlacement")
        self._enter("nvmlDeviceCreateGpuInstanceWithPlacement", handle)
        self._gi_api(handle)
        gpu = handle.gpu
        layout = self._layout(gpu)
        try:
            profile = layout.profile(profileId)
        except LookupError:
            raise error(int(real.NVML_ERROR_INVALID_ARGUMENT)) from None
        where = Placement(int(placement.start), int(placement.size))
        if where not in profile.placements:
            raise error(int(real.NVML_ERROR_INVALID_ARGUMENT))
        held = [(layout.profile(m.profile_id), Placement(m.start, m.size)) for m in gpu.migs]
        taken = taken_counters(layout, held)
        if not fits(layout, taken, profile, where):
            raise error(int(real.NVML_ERROR_INSUFFICIENT_RESOURCES))
        used = {m.gi_id for m in gpu.migs}
        gi_id = next(i for i in range(1, 64) if i not in used)
        mig = FakeMig("", gi_id, NO_CI, profileId, where.start, where.size)
        gpu.migs.append(mig)
        self._capability(gpu, gi_id, None, create=True)
        self._hook("after", "nvmlDeviceCreateGpuInstanceWithPlacement")
        return FakeGpuInstance(gpu, mig)

    def _live(self, gpu: FakeGpu, mig: FakeMig) -> FakeMig:
        if not any(m is mig for m in gpu.migs):
            raise error(int(real.NVML_ERROR_NOT_FOUND))
        return mig

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, device: FakeGpuInstance, profile: int, engProfile: int, version: int = 2
    ) -> Any:
        self._enter("nvmlGpuInstanceGetComputeInstanceProfileInfo", FakeHandle(device.gpu))
        mig = self._live(device.gpu, device.mig)
        slices = CI_PROFILE_SLICES.get(profile)
        gi_slices = self._profile(device.gpu, mig.profile_id).slices
        if slices is None or slices > gi_slices or engProfile != 0:
            raise error(int(real.NVML_ERROR_NOT_SUPPORTED))
        info = real.c_nvmlComputeInstanceProfileInfo_v2_t()
        info.id, info.sliceCount, info.instanceCount = profile, slices, gi_slices // slices
        info.multiprocessorCount = self._profile(device.gpu, mig.profile_id).sms * slices // gi_slices
        info.name = f"MIG {slices}c".encode()
        return info

    def nvmlGpuInstanceGetComputeInstanceProfileInfoV(
        self, device: FakeGpuInstance, profile: int, engProfile: int, version: int = 2
    ) -> Any:
        return self.nvmlGpuInstanceGetComputeInstanceProfileInfo(device, profile, engProfile, version)

    def nvmlGpuInstanceCreateComputeInstance(self, gpuInstance: FakeGpuInstance, profileId: int) -> Any:
        self._hook("before", "nvmlGpuInstanceCreateComputeInstance")
        self._enter("nvmlGpuInstanceCreateComputeInstance", FakeHandle(gpuInstance.gpu))
        mig = self._live(gpuInstance.gpu, gpuInstance.mig)
        if mig.ci_id != NO_CI:
            raise error(int(real.NVML_ERROR_INSUFFICIENT_RESOURCES))
        if CI_PROFILE_SLICES.get(profileId) != self._profile(gpuInstance.gpu, mig.profile_id).slices:
            raise error(int(real.NVML_ERROR_NOT_SUPPORTED))  # only full-size compute instances
        self._next_uuid += 1
        mig.ci_id, mig.uuid = (
            0,
            f"MIG-{gpuInstance.gpu.minor:04d}{mig.gi_id:04d}-{self._next_uuid:04d}-0000-0000-000000000000",
        )
        self._capability(gpuInstance.gpu, mig.gi_id, 0, create=True)
        self._hook("after", "nvmlGpuInstanceCreateComputeInstance")
        return FakeComputeInstance(gpuInstance.gpu, mig)

    def nvmlGpuInstanceGetComputeInstanceById(self, gpuInstance: FakeGpuInstance, ci_id: int) -> Any:
        self._enter("nvmlGpuInstanceGetComputeInstanceById", FakeHandle(gpuInstance.gpu))
        mig = self._live(gpuInstance.gpu, gpuInstance.mig)
        if mig.ci_id == NO_CI or mig.ci_id != ci_id:
            raise error(int(real.NVML_ERROR_NOT_FOUND))
        return FakeComputeInstance(gpuInstance.gpu, mig)

    def nvmlComputeInstanceGetInfo(self, computeInstance: FakeComputeInstance) -> Any:
        self._enter("nvmlComputeInstanceGetInfo", FakeHandle(computeInstance.gpu))
        mig = self._live(computeInstance.gpu, computeInstance.mig)
        info = real.c_nvmlComputeInstanceInfo_t()
        info.id, info.profileId = (
            mig.ci_id,
            CI_PROFILE_SLICES_INDEX[self._profile(computeInstance.gpu, mig.profile_id).slices],
        )
        return info

    def nvmlComputeInstanceDestroy(self, computeInstance: FakeComputeInstance) -> None:
        self._hook("before", "nvmlComputeInstanceDestroy")
        self._enter("nvmlComputeInstanceDestroy", FakeHandle(computeInstance.gpu))
        self._gi_api(FakeHandle(computeInstance.gpu))
        mig = self._live(computeInstance.gpu, computeInstance.mig)
        if mig.ci_id == NO_CI:
            raise error(int(real.NVML_ERROR_NOT_FOUND))
        self._capability(computeInstance.gpu, mig.gi_id, mig.ci_id, create=False)
        mig.ci_id, mig.uuid = NO_CI, ""
        self._hook("after", "nvmlComputeInstanceDestroy")

    def nvmlGpuInstanceDestroy(self, gpuInstance: FakeGpuInstance) -> None:
        self._hook("before", "nvmlGpuInstanceDestroy")
        self._enter("nvmlGpuInstanceDestroy", FakeHandle(gpuInstance.gpu))
        self._gi_api(FakeHandle(gpuInstance.gpu))
        mig = self._live(gpuInstance.gpu, gpuInstance.mig)
        if mig.ci_id != NO_CI:
            raise error(int(real.NVML_ERROR_IN_USE))
        gpuInstance.gpu.migs[:] = [m for m in gpuInstance.gpu.migs if m is not mig]
        self._capability(gpuInstance.gpu, mig.gi_id, None, create=False)
        self._hook("after", "nvmlGpuInstanceDestroy")


CI_PROFILE_SLICES_INDEX = {slices: index for index, slices in CI_PROFILE_SLICES.items()}
