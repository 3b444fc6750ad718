"""The state and call path of the stand-in libnvidia-ml: GPUs, handles, fault injection.

Handles are opaque pointers (`token`) that stand for a GPU, a MIG device, a GPU or compute instance,
or an event set. Every C function runs through `NvmlCore.c_call` (call record, `hang`, `missing`,
NVML_ERROR_UNINITIALIZED before ``nvmlInit``) and checks its GPU with `device` (GPU_IS_LOST for a
lost GPU, or the failure a test set with `fail`).
"""

from __future__ import annotations

import ctypes
import importlib.util
import queue
import sys
import threading
import types
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pynvml as installed

from tests.fakes.libnvml.cabi import (
    ERROR_FUNCTION_NOT_FOUND,
    ERROR_GPU_IS_LOST,
    ERROR_INVALID_ARGUMENT,
    ERROR_NOT_FOUND,
    ERROR_UNINITIALIZED,
    SUCCESS,
    CLibrary,
    NvmlReturn,
)
from tests.fakes.libnvml.devices import ANY_ID, FakeGpu, FakeMig, GiProfile

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


class NvmlCore:
    """The stand-in library's state, test controls and call path (`LibNvml` adds the C functions)."""

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
