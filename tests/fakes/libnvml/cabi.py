"""The C side of the stand-in libnvidia-ml: nvml.h's types, and functions callable only as C.

Every function of the stand-in is a ctypes callback declared with its nvml.h prototype (argument
types, pointer or value, integer widths), and pynvml reaches it through a plain C function pointer
without ``argtypes`` (`CFunction`), exactly as it calls the real library loaded with ``CDLL``: ctypes
converts pynvml's arguments by its default rules and libffi passes them by the C calling
convention. So a structure passed where nvml.h wants a pointer arrives as its bytes in the pointer's
register, and reading it (as the real library does) crashes the process; a missing ``byref`` fails
here as it would on a node.

The structures are written from nvml.h (NVIDIA/go-nvml ``pkg/nvml/nvml.h``, the line cited with
each), not taken from pynvml, so a layout pynvml got wrong would show too.
"""

from __future__ import annotations

import _ctypes
import ctypes
import sys
import threading
import traceback
from collections.abc import Callable
from ctypes import (
    POINTER,
    Structure,
    Union,
    c_char,
    c_char_p,
    c_double,
    c_int,
    c_longlong,
    c_uint,
    c_ulong,
    c_ulonglong,
    c_ushort,
    c_void_p,
)
from typing import Any

# nvml.h:1304-1340 (nvmlReturn_t)
SUCCESS = 0
ERROR_UNINITIALIZED = 1
ERROR_INVALID_ARGUMENT = 2
ERROR_NOT_SUPPORTED = 3
ERROR_NO_PERMISSION = 4
ERROR_NOT_FOUND = 6
ERROR_INSUFFICIENT_SIZE = 7
ERROR_INSUFFICIENT_RESOURCES = 23
ERROR_TIMEOUT = 10
ERROR_FUNCTION_NOT_FOUND = 13
ERROR_IN_USE = 19
ERROR_GPU_IS_LOST = 15
ERROR_ARGUMENT_VERSION_MISMATCH = 25
ERROR_UNKNOWN = 999

HANDLE = c_void_p
"""nvmlDevice_t, nvmlGpuInstance_t, nvmlComputeInstance_t, nvmlEventSet_t: opaque pointers."""

PCI_BUS_ID_SIZE = 32  # nvml.h:171 NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE
PCI_BUS_ID_V2_SIZE = 16  # nvml.h:176 NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE
NAME_V2_SIZE = 96  # nvml.h:4126 NVML_DEVICE_NAME_V2_BUFFER_SIZE


class PciInfo(Structure):  # nvml.h:202-214 nvmlPciInfo_t
    _fields_ = [
        ("busIdLegacy", c_char * PCI_BUS_ID_V2_SIZE),
        ("domain", c_uint),
        ("bus", c_uint),
        ("device", c_uint),
        ("pciDeviceId", c_uint),
        ("pciSubSystemId", c_uint),
        ("busId", c_char * PCI_BUS_ID_SIZE),
    ]


class Memory(Structure):  # nvml.h:261-267 nvmlMemory_t
    _fields_ = [("total", c_ulonglong), ("free", c_ulonglong), ("used", c_ulonglong)]


class Utilization(Structure):  # nvml.h:251-255 nvmlUtilization_t
    _fields_ = [("gpu", c_uint), ("memory", c_uint)]


class Temperature(Structure):  # nvml.h:6008-6013 nvmlTemperature_v1_t
    _fields_ = [("version", c_uint), ("sensorType", c_int), ("temperature", c_int)]


class Placement(Structure):  # nvml.h:12570-12574 nvmlGpuInstancePlacement_t (and the CI one, 12680)
    _fields_ = [("start", c_uint), ("size", c_uint)]


_GI_PROFILE_V1 = [
    ("id", c_uint),
    ("isP2pSupported", c_uint),
    ("sliceCount", c_uint),
    ("instanceCount", c_uint),
    ("multiprocessorCount", c_uint),
    ("copyEngineCount", c_uint),
    ("decoderCount", c_uint),
    ("encoderCount", c_uint),
    ("jpegCount", c_uint),
    ("ofaCount", c_uint),
    ("memorySizeMB", c_ulonglong),
]


class GiProfileInfo(Structure):  # nvml.h nvmlGpuInstanceProfileInfo_t (v1: no version, no name)
    _fields_ = _GI_PROFILE_V1


class GiProfileInfoV2(Structure):  # nvml.h:12602-12617 nvmlGpuInstanceProfileInfo_v2_t
    _fields_ = [("version", c_uint), *_GI_PROFILE_V1, ("name", c_char * NAME_V2_SIZE)]


class GiInfo(Structure):  # nvml.h:12652-12658 nvmlGpuInstanceInfo_t
    _fields_ = [("device", HANDLE), ("id", c_uint), ("profileId", c_uint), ("placement", Placement)]


class CiProfileInfoV2(Structure):  # nvml.h:12710-12723 nvmlComputeInstanceProfileInfo_v2_t
    _fields_ = [
        ("version", c_uint),
        ("id", c_uint),
        ("sliceCount", c_uint),
        ("instanceCount", c_uint),
        ("multiprocessorCount", c_uint),
        ("sharedCopyEngineCount", c_uint),
        ("sharedDecoderCount", c_uint),
        ("sharedEncoderCount", c_uint),
        ("sharedJpegCount", c_uint),
        ("sharedOfaCount", c_uint),
        ("name", c_char * NAME_V2_SIZE),
    ]


class CiInfo(Structure):  # nvml.h:12757-12764 nvmlComputeInstanceInfo_t
    _fields_ = [
        ("device", HANDLE),
        ("gpuInstance", HANDLE),
        ("id", c_uint),
        ("profileId", c_uint),
        ("placement", Placement),
    ]


class EventData(Structure):  # nvml.h:3243-3255 nvmlEventData_t
    _fields_ = [
        ("device", HANDLE),
        ("eventType", c_ulonglong),
        ("eventData", c_ulonglong),
        ("gpuInstanceId", c_uint),
        ("computeInstanceId", c_uint),
    ]


class Value(Union):  # nvml.h:671-680 nvmlValue_t
    _fields_ = [
        ("dVal", c_double),
        ("siVal", c_int),
        ("uiVal", c_uint),
        ("ulVal", c_ulong),
        ("ullVal", c_ulonglong),
        ("sllVal", c_longlong),
        ("usVal", c_ushort),
    ]


class FieldValue(Structure):  # nvml.h:3022-3031 nvmlFieldValue_t
    _fields_ = [
        ("fieldId", c_uint),
        ("scopeId", c_uint),
        ("timestamp", c_longlong),
        ("latencyUsec", c_longlong),
        ("valueType", c_int),
        ("nvmlReturn", c_int),
        ("value", Value),
    ]


class DeviceAttributes(Structure):  # nvml.h:368-379 nvmlDeviceAttributes_t
    _fields_ = [
        ("multiprocessorCount", c_uint),
        ("sharedCopyEngineCount", c_uint),
        ("sharedDecoderCount", c_uint),
        ("sharedEncoderCount", c_uint),
        ("sharedJpegCount", c_uint),
        ("sharedOfaCount", c_uint),
        ("gpuInstanceSliceCount", c_uint),
        ("computeInstanceSliceCount", c_uint),
        ("memorySizeMB", c_ulonglong),
    ]


def struct_version(struct: type[Structure], version: int) -> int:
    """nvml.h:141 NVML_STRUCT_VERSION: the structure's size | version << 24."""
    return ctypes.sizeof(struct) | version << 24


GI_PROFILE_INFO_V2 = struct_version(GiProfileInfoV2, 2)  # nvml.h:12622
CI_PROFILE_INFO_V2 = struct_version(CiProfileInfoV2, 2)  # nvml.h:12728
TEMPERATURE_V1 = struct_version(Temperature, 1)  # nvml.h:6017

P = POINTER
U32 = P(c_uint)
U64 = P(c_ulonglong)
I32 = P(c_int)
OUT_HANDLE = P(HANDLE)
CHARS = c_void_p
"""A ``char *`` buffer the function fills (`put_text`)."""


class NvmlReturn(Exception):
    """Raised inside a stand-in function: the function returns `code`."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def put_text(buffer: int | None, length: int, value: str) -> None:
    """Copy `value` NUL-terminated into a caller's ``char *`` of `length` bytes.

    nvml.h: INSUFFICIENT_SIZE when `length` is too small."""
    raw = value.encode() + b"\0"
    if not buffer:
        raise NvmlReturn(ERROR_INVALID_ARGUMENT)
    if len(raw) > length:
        raise NvmlReturn(ERROR_INSUFFICIENT_SIZE)
    ctypes.memmove(buffer, raw, len(raw))


def store(pointer: Any, value: Any) -> None:
    """``*pointer = value``; a NULL pointer is INVALID_ARGUMENT, as nvml.h documents for every output."""
    if not pointer:
        raise NvmlReturn(ERROR_INVALID_ARGUMENT)
    pointer[0] = value


class CFunction(_ctypes.CFuncPtr):
    """A C function pointer called as ``CDLL`` functions are: cdecl, int result, no ``argtypes``."""

    _flags_ = _ctypes.FUNCFLAG_CDECL
    _restype_ = c_int


PROTOTYPES: dict[str, tuple[Any, tuple[Any, ...]]] = {}
"""C symbol -> (result type, nvml.h argument types), filled by `c_function`."""


def c_function(symbol: str, *argtypes: Any, restype: Any = c_int) -> Callable[[Any], Any]:
    """Declare a stand-in method as the C function `symbol` with nvml.h's argument types."""

    def mark(method: Any) -> Any:
        PROTOTYPES[symbol] = (restype, argtypes)
        method.c_symbol = symbol
        return method

    return mark


class CLibrary:
    """What pynvml holds as ``nvmlLib``: one C function pointer per exported symbol.

    `owner.missing` names symbols this 'driver' lacks (pynvml then raises FUNCTION_NOT_FOUND);
    `owner.c_call(symbol, method, args)` runs each call (fault injection, bookkeeping).
    """

    def __init__(self, owner: Any) -> None:
        self._owner = owner
        self._callbacks: dict[str, Any] = {}
        self._lock = threading.Lock()
        for name in dir(type(owner)):
            method = getattr(type(owner), name)
            symbol = getattr(method, "c_symbol", None)
            if symbol is not None:
                self._callbacks[symbol] = self._callback(symbol, getattr(owner, name))

    def _callback(self, symbol: str, method: Callable[..., Any]) -> Any:
        restype, argtypes = PROTOTYPES[symbol]
        owner = self._owner

        def call(*args: Any) -> Any:
            try:
                return owner.c_call(symbol, method, args)
            except NvmlReturn as returned:
                return returned.code
            except BaseException as error:  # a bug in the stand-in: never answer SUCCESS for it
                owner.crashes.append(error)
                traceback.print_exc(file=sys.stderr)
                return ERROR_UNKNOWN

        return ctypes.CFUNCTYPE(restype, *argtypes)(call)

    def __getattr__(self, symbol: str) -> Any:
        if symbol.startswith("_") or symbol in self._owner.missing or symbol not in self._callbacks:
            raise AttributeError(symbol)
        address = ctypes.cast(self._callbacks[symbol], c_void_p).value
        assert address is not None
        return CFunction(address)


__all__ = ["CHARS", "I32", "OUT_HANDLE", "U32", "U64", "c_char_p"]
