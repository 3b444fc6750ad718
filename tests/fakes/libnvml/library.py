"""A stand-in for libnvidia-ml under the real pynvml: nvml.h's C functions over `devices` GPUs.

``LibNvml(gpus).module`` is a fresh copy of the installed ``pynvml`` (nvidia-ml-py, its own code)
whose ``nvmlLib`` is this library, so every pynvml function the backend calls runs as on a node:
it builds its ctypes arguments, calls the C function pointer, and turns the ``nvmlReturn_t`` into
its ``NVMLError_*`` class. Each C function is declared with nvml.h's prototype (`cabi`) and answers
with the return codes nvml.h documents for it (the line is cited). Handles are opaque pointers
that stand for a GPU, a MIG device, a GPU or compute instance, or an event set.

Test controls: `emit` / `emit_error` feed events, `fail` makes a C function return a code for one
GPU, `lose` loses a GPU, `hang` makes a function block like a wedged driver (until `release`),
`missing` names symbols an older driver lacks. NVIDIA's mock NVML (k8s-test-infra ``mocknvml``)
differs in places (/work/shared/reference/nvml-mock-vs-fake.md): `devices.as_mock`, `lose(...,
event=False)` (its ``lost`` mode), `fall_off_bus` (its ``fallen_off_bus`` mode) and `raise_ecc`
(its ``ecc_uncorrectable`` mode) answer as it does.
"""

from __future__ import annotations

import ctypes
import importlib.util
import queue
import sys
import threading
import types
from collections.abc import Callable, Iterable, Sequence
from ctypes import POINTER, c_char_p, c_int, c_uint, c_ulonglong, c_void_p
from dataclasses import dataclass, field
from typing import Any

import pynvml as installed

from tests.fakes.libnvml.cabi import (
    CHARS,
    ERROR_ARGUMENT_VERSION_MISMATCH,
    ERROR_FUNCTION_NOT_FOUND,
    ERROR_GPU_IS_LOST,
    ERROR_INVALID_ARGUMENT,
    ERROR_NOT_FOUND,
    ERROR_NOT_SUPPORTED,
    ERROR_TIMEOUT,
    ERROR_UNINITIALIZED,
    GI_PROFILE_INFO_V2,
    HANDLE,
    I32,
    OUT_HANDLE,
    SUCCESS,
    TEMPERATURE_V1,
    U32,
    U64,
    CLibrary,
    DeviceAttributes,
    EventData,
    FieldValue,
    GiInfo,
    GiProfileInfo,
    GiProfileInfoV2,
    Memory,
    NvmlReturn,
    PciInfo,
    Temperature,
    Utilization,
    c_function,
    put_text,
    store,
)
from tests.fakes.libnvml.devices import ANY_ID, MIB, FakeGpu, FakeMig, GiProfile

RECOVERY_ACTION_FIELD = 230  # nvml.h NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
NVLINK_ERROR_COUNT = 5  # nvml.h nvmlNvLinkErrorCounter_t: DL_REPLAY .. DL_CRC_DATA, then COUNT

# nvml.h:1304-1340: what each nvmlReturn_t means (nvmlErrorString's answer).
ERROR_STRINGS = {
    1: "NVML was not first initialized with nvmlInit()",
    2: "A supplied argument is invalid",
    3: "The requested operation is not available on target device",
    6: "A query to find an object was unsuccessful",
    7: "An input argument is not large enough",
    10: "User provided timeout passed",
    13: "Local version of NVML doesn't implement this function",
    15: "The GPU has fallen off the bus or has otherwise become inaccessible",
    19: "An operation cannot be performed because the GPU is currently in use",
    23: "Ran out of critical resources, other than memory",
    25: "The provided version is invalid/unsupported",
    999: "An internal driver error occurred",
}

# pynvml names -> the C symbol its wrapper calls (for `fail`, `hang`, `count`, `missing`).
ALIASES = {
    "nvmlInit": "nvmlInitWithFlags",
    "nvmlDeviceGetCount": "nvmlDeviceGetCount_v2",
    "nvmlDeviceGetHandleByIndex": "nvmlDeviceGetHandleByIndex_v2",
    "nvmlDeviceGetPciInfo": "nvmlDeviceGetPciInfo_v3",
    "nvmlDeviceGetAttributes": "nvmlDeviceGetAttributes_v2",
    "nvmlDeviceGetGpuInstancePossiblePlacements": "nvmlDeviceGetGpuInstancePossiblePlacements_v2",
    "nvmlGpuInstanceGetComputeInstanceProfileInfo": "nvmlGpuInstanceGetComputeInstanceProfileInfoV",
    "nvmlComputeInstanceGetInfo": "nvmlComputeInstanceGetInfo_v2",
}


def symbol(name: str) -> str:
    """The C symbol behind pynvml function `name`."""
    return ALIASES.get(name, name)


class Symbols(set[str]):
    """A set of C symbols that takes pynvml's names too."""

    def __init__(self, names: Iterable[str] = ()) -> None:
        super().__init__(symbol(name) for name in names)

    def add(self, name: str) -> None:
        super().add(symbol(name))

    def __contains__(self, name: object) -> bool:
        return super().__contains__(symbol(name) if isinstance(name, str) else name)


def error(code: int) -> Exception:
    """The installed pynvml's exception for `code` (an ``NVMLError_*`` subclass instance)."""
    exc: Exception = installed.NVMLError(code)
    return exc


@dataclass(frozen=True)
class FakeHandle:
    """What an ``nvmlDevice_t`` points to: a GPU, or a MIG device of it."""

    gpu: FakeGpu = field(compare=False)
    mig: FakeMig | None = field(default=None, compare=False)
    key: str = ""


@dataclass(frozen=True)
class FakeInstance:
    """What an ``nvmlGpuInstance_t`` / ``nvmlComputeInstance_t`` points to."""

    gpu: FakeGpu = field(compare=False)
    mig: FakeMig = field(compare=False)


@dataclass(frozen=True)
class FakeEvent:
    gpu: FakeGpu
    event_type: int
    data: int
    gpu_instance_id: int = ANY_ID
    compute_instance_id: int = ANY_ID


class FakeEventSet:
    """An event set: registrations plus a queue tests feed."""

    def __init__(self) -> None:
        self.registered: dict[str, int] = {}
        self.queue: queue.Queue[FakeEvent | int] = queue.Queue()
        self.freed = False
        self.waits = 0


def load_pynvml(library: Any) -> types.ModuleType:
    """A fresh copy of the installed pynvml whose library is `library` (None: no library found)."""
    spec = importlib.util.spec_from_file_location("pynvml", installed.__file__)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # pynvml makes its NVMLError_* classes on sys.modules[__name__]: let that be this copy.
    with _LOADING:
        sys.modules["pynvml"] = module
        try:
            spec.loader.exec_module(module)
        finally:
            sys.modules["pynvml"] = installed
    if library is None:
        # No libnvidia-ml.so.1 on this loader path (a node without the driver), even on a host
        # that has one: pynvml's own loader then raises NVML_ERROR_LIBRARY_NOT_FOUND.
        setattr(module, "CDLL", _no_library)  # noqa: B010 (pynvml's own global)
    else:
        setattr(module, "nvmlLib", library)  # noqa: B010
    return module


_LOADING = threading.Lock()


def _no_library(name: str, *args: Any, **kwargs: Any) -> Any:
    raise OSError(f"{name}: cannot open shared object file: No such file or directory")


class LibNvml:
    """The stand-in library's state; `module` is the pynvml the backend gets."""

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
        self.missing = Symbols(missing)
        """C symbols the 'driver' is too old for (pynvml raises FunctionNotFound)."""
        self.initialized = 0
        self.event_sets: list[FakeEventSet] = []
        self.calls: list[str] = []
        self.crashes: list[BaseException] = []
        """Exceptions inside the stand-in (its bugs; each answered NVML_ERROR_UNKNOWN)."""
        self.hung = Symbols()
        """C symbols whose calls block until `release` (a wedged driver); `on_hang(symbol)` first."""
        self.on_hang: Callable[[str], None] | None = None
        self._released = threading.Event()
        self._lock = threading.Lock()
        self._objects: dict[int, object] = {}
        self._strings: dict[int, ctypes.Array[ctypes.c_char]] = {}
        self._tokens: dict[tuple[str, int], int] = {}
        self._next_token = 0x7F0000001000
        self.library = CLibrary(self)
        no_library = init_error == int(installed.NVML_ERROR_LIBRARY_NOT_FOUND)
        self.module = load_pynvml(None if no_library else self.library)

    # -- test controls ------------------------------------------------------------------------

    def gpu(self, uuid: str) -> FakeGpu:
        return next(g for g in self.gpus if g.uuid == uuid)

    def emit(self, gpu_uuid: str, event_type: int, data: int = 0, gi: int = ANY_ID, ci: int = ANY_ID) -> None:
        """Deliver an event to every event set where the GPU registered that type."""
        gpu = self.gpu(gpu_uuid)
        for event_set in self.event_sets:
            if not event_set.freed and event_set.registered.get(gpu_uuid, 0) & event_type:
                event_set.queue.put(FakeEvent(gpu, event_type, data, gi, ci))

    def emit_error(self, code: int) -> None:
        """Make the next wait of every live event set return `code`."""
        for event_set in self.event_sets:
            if not event_set.freed:
                event_set.queue.put(code)

    def lose(self, gpu_uuid: str, *, event: bool = True, still_answers: Iterable[str] = ()) -> None:
        """The GPU falls off the bus: its calls return GPU_IS_LOST and waits report it.

        ``event=False`` is the mock's ``lost`` mode: the getters (handle lookups too) answer
        GPU_IS_LOST but no wait reports anything; waits keep timing out. `still_answers` names C
        functions the lost GPU still answers (nvml.h only lists GPU_IS_LOST for a getter).
        """
        gpu = self.gpu(gpu_uuid)
        gpu.lost, gpu.still_answers = True, frozenset(symbol(s) for s in still_answers)
        if event:
            self.emit_error(int(installed.NVML_ERROR_GPU_IS_LOST))

    def fall_off_bus(self, gpu_uuid: str, xid: int = 79) -> None:
        """The mock's ``fallen_off_bus`` mode: XID 79 is delivered, but reading the event's device
        (its UUID) already answers GPU_IS_LOST, as does every getter of the GPU."""
        self.emit(gpu_uuid, 0x8, xid)
        self.gpu(gpu_uuid).lost = True

    def raise_ecc(self, gpu_uuid: str, uncorrected: int = 0, corrected: int = 0) -> None:
        """The volatile ECC counters rise with no event (the mock's ``ecc_uncorrectable`` mode)."""
        gpu = self.gpu(gpu_uuid)
        gpu.ecc_uncorrected += uncorrected
        gpu.ecc_corrected += corrected

    def count(self, name: str) -> int:
        """How many calls of the C function behind `name` were made so far."""
        with self._lock:
            return self.calls.count(symbol(name))

    def fail(self, gpu_uuid: str, function: str, code: int) -> None:
        self.gpu(gpu_uuid).failures[symbol(function)] = code

    def hang(self, function: str) -> None:
        """Calls of `function` block (in their thread) until `release`."""
        self.hung.add(symbol(function))

    def release(self) -> None:
        """Let every hung call return (as it would have)."""
        self.hung.clear()
        self._released.set()

    # -- the call path ------------------------------------------------------------------------

    def c_call(self, name: str, method: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """Run C function `name` (its callback's arguments `args`); an `NvmlReturn` is its result."""
        with self._lock:
            self.calls.append(name)
        if name in self.hung:
            if self.on_hang is not None:
                self.on_hang(name)
            self._released.wait()
        if name in self.missing:  # made missing after pynvml looked the symbol up
            raise NvmlReturn(ERROR_FUNCTION_NOT_FOUND)
        if name not in ("nvmlInitWithFlags", "nvmlErrorString") and not self.initialized:
            raise NvmlReturn(ERROR_UNINITIALIZED)
        result = method(*args)
        return SUCCESS if result is None else result

    def _check(self, name: str, gpu: FakeGpu) -> None:
        """GPU_IS_LOST for a lost GPU, or the failure a test set on `name`."""
        if gpu.lost and name not in gpu.still_answers:
            raise NvmlReturn(ERROR_GPU_IS_LOST)
        code = gpu.failures.get(name)
        if code is not None:
            raise NvmlReturn(code)

    def token(self, obj: object, kind: str, anchor: object) -> int:
        """The opaque pointer that stands for `obj`: the same one each time for `kind` of `anchor`."""
        ident = (kind, id(anchor))
        with self._lock:
            token = self._tokens.get(ident)
            if token is None:
                token = self._tokens[ident] = self._next_token
                self._next_token += 0x40
            self._objects[token] = obj
            return token

    def _object(self, handle: int | None, kind: type[Any]) -> Any:
        found = self._objects.get(handle or 0)
        if not isinstance(found, kind):
            raise NvmlReturn(ERROR_INVALID_ARGUMENT)  # nvml.h: "if device is invalid"
        return found

    def device(self, name: str, handle: int | None) -> FakeHandle:
        """The device an ``nvmlDevice_t`` stands for, after the lost/failure checks."""
        found: FakeHandle = self._object(handle, FakeHandle)
        self._check(name, found.gpu)
        return found

    def gpu_token(self, gpu: FakeGpu) -> int:
        return self.token(FakeHandle(gpu, key=gpu.uuid), "gpu", gpu)

    def mig_token(self, gpu: FakeGpu, mig: FakeMig) -> int:
        return self.token(FakeHandle(gpu, mig, key=mig.uuid), "mig", mig)

    def profile(self, gpu: FakeGpu, profile_id: int) -> GiProfile:
        for p in gpu.profiles:
            if p.id == profile_id:
                return p
        raise NvmlReturn(ERROR_NOT_FOUND)

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


def install(monkeypatch: Any, fake: LibNvml) -> types.ModuleType:
    """Make ``import pynvml`` give `fake.module` (pynvml's own code over the stand-in library)."""
    monkeypatch.setitem(sys.modules, "pynvml", fake.module)
    return fake.module
