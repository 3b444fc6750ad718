"""A fake `amdsmi` module (7.0.2 names) fed by fixtures, for tests without AMD hardware.

Install it with ``monkeypatch.setitem(sys.modules, "amdsmi", FakeAmdSmi(fixture))``. Function,
enum and exception names, signatures and returned dict keys follow the real package
(``amdsmi/amdsmi_interface.py`` and ``amdsmi_exception.py``): status codes, "N/A" for values the
library cannot read, BDF strings with the partition id in the function, the shared event queue
read by any `AmdSmiEventReader`. Tests change a `FakeGpu` (``unsupported``, ``lost``,
``ecc_uncorrectable``, ``ecc_correctable``, ``cper``, ``bad_pages``, ``pcie_replay_count``,
``xgmi_status``) or push events to drive each path; ``calls`` counts the calls of each function.

Fixtures: `mi300x(mode)` (8 OAMs, ``spx_nps1`` or ``cpx_nps4`` with eight partitions per GPU),
`mi250x()` (4 OAMs, 8 GCDs), `mi210()` (4 PCIe cards).
"""

from __future__ import annotations

import threading
import types
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

# --- amdsmi_wrapper status codes ------------------------------------------------------------
AMDSMI_STATUS_SUCCESS = 0
AMDSMI_STATUS_INVAL = 1
AMDSMI_STATUS_NOT_SUPPORTED = 2
AMDSMI_STATUS_NOT_YET_IMPLEMENTED = 3
AMDSMI_STATUS_FAIL_LOAD_MODULE = 4
AMDSMI_STATUS_DRM_ERROR = 6
AMDSMI_STATUS_TIMEOUT = 8
AMDSMI_STATUS_RETRY = 9
AMDSMI_STATUS_NO_PERM = 10
AMDSMI_STATUS_IO = 12
AMDSMI_STATUS_FILE_ERROR = 14
AMDSMI_STATUS_INIT_ERROR = 18
AMDSMI_STATUS_BUSY = 30
AMDSMI_STATUS_NOT_FOUND = 31
AMDSMI_STATUS_NOT_INIT = 32
AMDSMI_STATUS_DRIVER_NOT_LOADED = 34

_ERR_INFO = {
    AMDSMI_STATUS_INVAL: "AMDSMI_STATUS_INVAL - Invalid parameters",
    AMDSMI_STATUS_NOT_SUPPORTED: "AMDSMI_STATUS_NOT_SUPPORTED - Feature not supported",
    AMDSMI_STATUS_NOT_YET_IMPLEMENTED: "AMDSMI_STATUS_NOT_YET_IMPLEMENTED - Feature not yet implemented",
    AMDSMI_STATUS_DRM_ERROR: "AMDSMI_STATUS_DRM_ERROR - Error when called libdrm",
    AMDSMI_STATUS_TIMEOUT: "AMDSMI_STATUS_TIMEOUT - Timeout in API call",
    AMDSMI_STATUS_RETRY: "AMDSMI_STATUS_RETRY - Retry operation",
    AMDSMI_STATUS_NO_PERM: "AMDSMI_STATUS_NO_PERM - Permission Denied",
    AMDSMI_STATUS_IO: "AMDSMI_STATUS_IO - I/O Error",
    AMDSMI_STATUS_FILE_ERROR: "AMDSMI_STATUS_FILE_ERROR - Error opening file",
    AMDSMI_STATUS_INIT_ERROR: "AMDSMI_STATUS_INIT_ERROR - Initialization error",
    AMDSMI_STATUS_BUSY: "AMDSMI_STATUS_BUSY - Device busy",
    AMDSMI_STATUS_NOT_FOUND: "AMDSMI_STATUS_NOT_FOUND - Device Not found",
    AMDSMI_STATUS_NOT_INIT: "AMDSMI_STATUS_NOT_INIT - Device not initialized",
    AMDSMI_STATUS_DRIVER_NOT_LOADED: "AMDSMI_STATUS_DRIVER_NOT_LOADED - Driver not loaded",
}


# --- amdsmi_exception ------------------------------------------------------------------------
class AmdSmiException(Exception):
    """Base smi exception class."""


class AmdSmiLibraryException(AmdSmiException):
    def __init__(self, err_code: int) -> None:
        err_code = abs(err_code)
        super().__init__(err_code)
        self.err_code = err_code
        self.err_info = _ERR_INFO.get(err_code, "AMDSMI_STATUS_UNKNOWN_ERROR - An unknown error occurred")

    def __str__(self) -> str:
        return f"Error code:\n\t{self.err_code} | {self.err_info}"

    def get_error_info(self, detailed: bool = True) -> str:
        return self.err_info if detailed else self.err_info.split(" - ")[0]

    def get_error_code(self) -> int:
        return self.err_code


class AmdSmiRetryException(AmdSmiLibraryException):
    def __init__(self) -> None:
        super().__init__(AMDSMI_STATUS_RETRY)


class AmdSmiTimeoutException(AmdSmiLibraryException):
    def __init__(self) -> None:
        super().__init__(AMDSMI_STATUS_TIMEOUT)


class AmdSmiParameterException(AmdSmiException):
    def __init__(self, received_value: object, expected_type: object, msg: str | None = None) -> None:
        super().__init__(msg)
        self.err_code = None
        self.err_msg = (
            msg or f"Invalid parameter:\nActual type: {type(received_value)}\nExpected type: {expected_type}"
        )

    def __str__(self) -> str:
        return self.err_msg


class AmdSmiKeyException(AmdSmiException):
    pass


class AmdSmiBdfFormatException(AmdSmiException):
    pass


# --- amdsmi_interface enums --------------------------------------------------------------------
class AmdSmiInitFlags(IntEnum):
    INIT_ALL_PROCESSORS = 0xFFFFFFFF
    INIT_AMD_CPUS = 1
    INIT_AMD_GPUS = 2
    INIT_NON_AMD_CPUS = 4
    INIT_NON_AMD_GPUS = 8
    INIT_AMD_APUS = 3


class AmdSmiEvtNotificationType(IntEnum):
    NONE = 0
    VMFAULT = 1
    THERMAL_THROTTLE = 2
    GPU_PRE_RESET = 3
    GPU_POST_RESET = 4
    MIGRATE_START = 5
    MIGRATE_END = 6
    PAGE_FAULT_START = 8  # 7.0.2 maps START to the END value (an upstream quirk kept on purpose)
    PAGE_FAULT_END = 8
    QUEUE_EVICTION = 9
    QUEUE_RESTORE = 10
    UNMAP_FROM_GPU = 11
    PROCESS_START = 12
    PROCESS_END = 13


class AmdSmiGpuBlock(IntEnum):
    INVALID = 0
    UMC = 1
    SDMA = 2
    GFX = 4
    MMHUB = 8
    ATHUB = 16
    PCIE_BIF = 32
    HDP = 64
    XGMI_WAFL = 128
    DF = 256
    SMN = 512
    SEM = 1024
    MP0 = 2048
    MP1 = 4096
    FUSE = 8192
    MCA = 16384
    VCN = 32768
    JPEG = 65536
    IH = 131072
    MPIO = 262144
    RESERVED = 9223372036854775808


class AmdSmiRasErrState(IntEnum):
    NONE = 0
    DISABLED = 1
    PARITY = 2
    SING_C = 3
    MULT_UC = 4
    POISON = 5
    ENABLED = 6
    INVALID = 4294967295


class AmdSmiMemoryPageStatus(IntEnum):
    RESERVED = 0
    PENDING = 1
    UNRESERVABLE = 2


class AmdSmiXgmiStatus(IntEnum):
    NO_ERRORS = 0
    ERROR = 1
    MULTIPLE_ERRORS = 2


class AmdSmiTemperatureType(IntEnum):
    EDGE = 0
    HOTSPOT = 1
    JUNCTION = 1
    VRAM = 2
    HBM_0 = 3
    HBM_1 = 4
    HBM_2 = 5
    HBM_3 = 6
    PLX = 7


class AmdSmiTemperatureMetric(IntEnum):
    CURRENT = 0
    MAX = 1
    MIN = 2
    CRITICAL = 5


class AmdSmiComputePartitionType(IntEnum):
    SPX = 1
    DPX = 2
    TPX = 3
    QPX = 4
    CPX = 5
    INVALID = 0


class AmdSmiMemoryPartitionType(IntEnum):
    NPS1 = 1
    NPS2 = 2
    NPS4 = 4
    NPS8 = 8
    UNKNOWN = 0


class AmdSmiVirtualizationMode(IntEnum):
    UNKNOWN = 0
    BAREMETAL = 1
    HOST = 2
    GUEST = 3
    PASSTHROUGH = 4


# Aliases for annotations inside FakeAmdSmi, whose class attributes shadow the enum names.
_InitFlags = AmdSmiInitFlags
_EvtType = AmdSmiEvtNotificationType
_GpuBlock = AmdSmiGpuBlock
_RasErrState = AmdSmiRasErrState
_TempType = AmdSmiTemperatureType
_TempMetric = AmdSmiTemperatureMetric
_VirtMode = AmdSmiVirtualizationMode


# --- fixtures ------------------------------------------------------------------------------


@dataclass
class FakeGpu:
    """One processor handle's data: a whole GPU, or one partition of one.

    ``unsupported`` names functions that raise NOT_SUPPORTED for this handle; ``lost`` makes every
    call raise ``lost_code``; ``ecc_uncorrectable`` and ``ecc_correctable`` map block names to
    counts; ``bad_pages`` are `bad_page` records; ``bad_page_threshold`` None is the driver's
    default (one page per 100 MB of VRAM), "N/A" what amdsmi answers without root.
    """

    bdf: str
    card: int
    render: int
    market_name: str
    product_name: str
    device_id: int
    asic_serial: str
    num_compute_units: int
    gfx: str
    vram_mb: int
    driver_version: str = "6.12.12"
    compute_partition: str | None = None
    memory_partition: str | None = None
    partition_id: int = 0
    numa_node: int = 0
    kfd_node: int = 1
    uuid: str = ""
    ecc_enabled_mask: int = (
        AmdSmiGpuBlock.UMC | AmdSmiGpuBlock.SDMA | AmdSmiGpuBlock.GFX | AmdSmiGpuBlock.MMHUB
    )
    ecc_uncorrectable: dict[str, int] = field(default_factory=dict)
    ecc_correctable: dict[str, int] = field(default_factory=dict)
    cper: list[dict[str, Any]] = field(default_factory=list)
    bad_pages: list[dict[str, Any]] = field(default_factory=list)
    bad_page_threshold: int | str | None = None
    pcie_replay_count: int | str = 0
    xgmi_status: int = AmdSmiXgmiStatus.NO_ERRORS
    gfx_activity: int = 0
    vram_used_mb: int = 0
    temp_hotspot: int = 45
    temp_edge: int = 38
    socket_power: int | str = 150
    unsupported: set[str] = field(default_factory=set)
    lost: bool = False
    lost_code: int = AMDSMI_STATUS_NOT_FOUND


def _serial(base: int, gpu: int) -> str:
    return f"{base + gpu * 0x1111:016X}"


def mi300x(mode: str = "spx_nps1", count: int = 8, driver_version: str = "6.12.12") -> list[FakeGpu]:
    """MI300X OAM nodes: SPX/NPS1 (one handle per GPU) or CPX/NPS4 (eight partitions per GPU)."""
    compute, memory = mode.upper().split("_")
    parts = 8 if compute == "CPX" else 1
    gpus: list[FakeGpu] = []
    buses = [0x05, 0x26, 0x46, 0x65, 0x85, 0xA6, 0xC6, 0xE5]
    for g in range(count):
        for p in range(parts):
            n = g * parts + p
            gpus.append(
                FakeGpu(
                    bdf=f"0000:{buses[g % 8]:02x}:00.{p}",
                    card=1 + n,
                    render=128 + n,
                    market_name="AMD Instinct MI300X",
                    product_name="AMD Instinct MI300X OAM",
                    device_id=0x74A1,
                    asic_serial=_serial(0x7570A3C2DD4D12D8, g),
                    num_compute_units=304 // parts,
                    gfx="gfx942",
                    vram_mb=196592 // parts,
                    driver_version=driver_version,
                    compute_partition=compute,
                    memory_partition=memory,
                    partition_id=p,
                    numa_node=0 if g < 4 else 1,
                    kfd_node=2 + n,
                    uuid=f"{0x1E + g:02x}ff74a1-0000-1000-80{p:02x}-{0xD8 + g:012x}",
                )
            )
    return gpus


def mi250x(count: int = 8) -> list[FakeGpu]:
    """MI250X: each OAM shows as two GCDs (two GPUs); no partition modes."""
    return [
        FakeGpu(
            bdf=f"0000:{0x29 + g * 0x1F:02x}:00.0",
            card=1 + g,
            render=128 + g,
            market_name="AMD Instinct MI250X",
            product_name="AMD Instinct MI250X",
            device_id=0x740C,
            asic_serial=_serial(0x2C5A6B1E00000001, g),
            num_compute_units=110,
            gfx="gfx90a",
            vram_mb=65520,
            driver_version="6.7.0.60103",
            numa_node=g // 4,
            kfd_node=2 + g,
            uuid=f"{g:02x}ff740c-0000-1000-8000-000000000000",
            unsupported={"amdsmi_get_gpu_compute_partition", "amdsmi_get_gpu_memory_partition"},
        )
        for g in range(count)
    ]


def mi210(count: int = 4) -> list[FakeGpu]:
    """MI210 PCIe cards: no partitions, no CPER, an empty driver version (in-box amdgpu)."""
    return [
        FakeGpu(
            bdf=f"0000:{0x03 + g * 0x20:02x}:00.0",
            card=1 + g,
            render=128 + g,
            market_name="AMD Instinct MI210",
            product_name="N/A",
            device_id=0x740F,
            asic_serial=_serial(0x1B2C3D4E5F000010, g),
            num_compute_units=104,
            gfx="gfx90a",
            vram_mb=65520,
            driver_version="",
            numa_node=0,
            kfd_node=2 + g,
            uuid=f"{g:02x}ff740f-0000-1000-8000-000000000000",
            unsupported={
                "amdsmi_get_gpu_compute_partition",
                "amdsmi_get_gpu_memory_partition",
                "amdsmi_get_gpu_cper_entries",
                "amdsmi_gpu_xgmi_error_status",  # no XGMI bridge
            },
        )
        for g in range(count)
    ]


class FakeProcessorHandle:
    """Like ``amdsmi_wrapper.amdsmi_processor_handle`` (a ctypes c_void_p): identity is ``.value``."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"c_void_p({self.value})"


class FakeAmdSmi(types.ModuleType):
    """The fake module. Every public function checks init state and the handle like the real one."""

    AmdSmiException = AmdSmiException
    AmdSmiLibraryException = AmdSmiLibraryException
    AmdSmiRetryException = AmdSmiRetryException
    AmdSmiTimeoutException = AmdSmiTimeoutException
    AmdSmiParameterException = AmdSmiParameterException
    AmdSmiKeyException = AmdSmiKeyException
    AmdSmiBdfFormatException = AmdSmiBdfFormatException
    AmdSmiInitFlags = AmdSmiInitFlags
    AmdSmiEvtNotificationType = AmdSmiEvtNotificationType
    AmdSmiGpuBlock = AmdSmiGpuBlock
    AmdSmiRasErrState = AmdSmiRasErrState
    AmdSmiMemoryPageStatus = AmdSmiMemoryPageStatus
    AmdSmiXgmiStatus = AmdSmiXgmiStatus
    AmdSmiTemperatureType = AmdSmiTemperatureType
    AmdSmiTemperatureMetric = AmdSmiTemperatureMetric
    AmdSmiComputePartitionType = AmdSmiComputePartitionType
    AmdSmiMemoryPartitionType = AmdSmiMemoryPartitionType
    AmdSmiVirtualizationMode = AmdSmiVirtualizationMode

    def __init__(
        self,
        gpus: Sequence[FakeGpu] = (),
        *,
        init_error: int | None = None,
        events_error: int | None = None,
        virtualization: _VirtMode = AmdSmiVirtualizationMode.BAREMETAL,
    ) -> None:
        super().__init__("amdsmi")
        self.__version__ = "7.0.2"
        self.gpus = list(gpus)
        self.init_error = init_error
        self.events_error = events_error
        self.virtualization = virtualization
        self.initialized = False
        self.init_calls = 0
        self.shutdown_calls = 0
        self.calls: dict[str, int] = {}
        self._handles = [FakeProcessorHandle(0x5000 + i * 0x10) for i in range(len(self.gpus))]
        self._cond = threading.Condition()
        self._queue: list[dict[str, Any]] = []
        self.event_masks: dict[int, int] = {}
        self.readers_stopped = 0

        # The real AmdSmiEventReader class, bound to this fake's state.
        fake = self

        class AmdSmiEventReader:
            def __init__(self, processor_handle: Any, event_types: Iterable[_EvtType]) -> None:
                fake._gpu(processor_handle, "amdsmi_init_gpu_event_notification")
                for event_type in event_types:
                    if not isinstance(event_type, AmdSmiEvtNotificationType):
                        raise AmdSmiParameterException(event_type, AmdSmiEvtNotificationType)
                if fake.events_error is not None:
                    raise AmdSmiLibraryException(fake.events_error)
                self.processor_handle = processor_handle
                mask = 0
                for event_type in event_types:
                    if event_type != AmdSmiEvtNotificationType.NONE:
                        mask |= 1 << (int(event_type) - 1)
                fake.event_masks[processor_handle.value] = mask

            def read(self, timestamp: int, num_elem: int = 10) -> list[dict[str, Any]]:
                return fake._read_events(timestamp, num_elem)

            def stop(self) -> None:
                fake.readers_stopped += 1
                fake.event_masks.pop(self.processor_handle.value, None)

            def __enter__(self) -> AmdSmiEventReader:
                return self

            def __exit__(self, *exc: object) -> None:
                self.stop()

        self.AmdSmiEventReader = AmdSmiEventReader

    # --- test controls ---------------------------------------------------------------------
    def handle(self, index: int) -> FakeProcessorHandle:
        """The handle of fixture entry `index`."""
        return self._handles[index]

    def push_event(self, index: int, event: str, message: str = "") -> None:
        """Queue a notification for fixture entry `index` (delivered if its mask subscribes it)."""
        with self._cond:
            self._queue.append({"index": index, "event": event, "message": message})
            self._cond.notify_all()

    # --- internals ---------------------------------------------------------------------------
    def _gpu(self, handle: Any, function: str) -> FakeGpu:
        self.calls[function] = self.calls.get(function, 0) + 1
        if not self.initialized:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_INIT)
        if not isinstance(handle, FakeProcessorHandle):
            raise AmdSmiParameterException(handle, FakeProcessorHandle)
        gpu = self.gpus[self._handles.index(handle)]
        if gpu.lost:
            raise AmdSmiLibraryException(gpu.lost_code)
        if function in gpu.unsupported:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)
        return gpu

    def _read_events(self, timeout_ms: int, num_elem: int) -> list[dict[str, Any]]:
        # Like amdsmi_get_gpu_event_notification: waits up to the timeout, then returns what came.
        with self._cond:
            if not self._queue:
                self._cond.wait(timeout_ms / 1000)
            taken, self._queue = self._queue[:num_elem], self._queue[num_elem:]
        out = []
        for item in taken:
            handle = self._handles[item["index"]]
            event = AmdSmiEvtNotificationType[item["event"]]
            if self.event_masks.get(handle.value, 0) & (1 << (int(event) - 1)):
                out.append({"processor_handle": handle, "event": event.name, "message": item["message"]})
        return out

    # --- library ------------------------------------------------------------------------------
    def amdsmi_init(self, flag: _InitFlags = AmdSmiInitFlags.INIT_AMD_GPUS) -> None:
        self.init_calls += 1
        if self.init_error is not None:
            raise AmdSmiLibraryException(self.init_error)
        self.initialized = True

    def amdsmi_shut_down(self) -> None:
        self.shutdown_calls += 1
        self.initialized = False

    def amdsmi_get_processor_handles(self) -> list[FakeProcessorHandle]:
        if not self.initialized:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_INIT)
        return list(self._handles)

    def amdsmi_get_lib_version(self) -> dict[str, Any]:
        return {"major": 25, "minor": 5, "release": 1, "build": ""}

    def amdsmi_get_gpu_device_bdf(self, processor_handle: Any) -> str:
        return self._gpu(processor_handle, "amdsmi_get_gpu_device_bdf").bdf

    def amdsmi_get_gpu_device_uuid(self, processor_handle: Any) -> str:
        return self._gpu(processor_handle, "amdsmi_get_gpu_device_uuid").uuid

    def amdsmi_get_gpu_enumeration_info(self, processor_handle: Any) -> dict[str, Any]:
        gpu = self._gpu(processor_handle, "amdsmi_get_gpu_enumeration_info")
        return {
            "drm_render": gpu.render,
            "drm_card": gpu.card,
            "hsa_id": gpu.kfd_node,
            "hip_id": self._handles.index(processor_handle),
            "hip_uuid": f"GPU-{gpu.asic_serial.lower()}",
        }

    def amdsmi_get_gpu_kfd_info(self, processor_handle: Any) -> dict[str, Any]:
        gpu = self._gpu(processor_handle, "amdsmi_get_gpu_kfd_info")
        return {
            "kfd_id": 0x9000 + gpu.kfd_node,
            "node_id": gpu.kfd_node,
            "current_partition_id": gpu.partition_id,
        }

    def amdsmi_get_gpu_asic_info(self, processor_handle: Any) -> dict[str, Any]:
        gpu = self._gpu(processor_handle, "amdsmi_get_gpu_asic_info")
        return {
            "market_name": gpu.market_name,
            "vendor_id": "0x1002",
            "vendor_name": "Advanced Micro Devices Inc. [AMD/ATI]",
            "subvendor_id": "0x1002",
            "device_id": hex(gpu.device_id),
            "rev_id": "0x00",
            "asic_serial": f"0x{gpu.asic_serial}",
            "oam_id": 0,
            "num_compute_units": gpu.num_compute_units,
            "target_graphics_version": gpu.gfx,
            "subsystem_id": "0x74a1",
        }

    def amdsmi_get_gpu_board_info(self, processor_handle: Any) -> dict[str, Any]:
        gpu = self._gpu(processor_handle, "amdsmi_get_gpu_board_info")
        return {
            "model_number": "102-G30211-0C",
            "product_serial": "N/A",
            "fru_id": "N/A",
            "product_name": gpu.product_name or "N/A",
            "manufacturer_name": "AMD",
        }

    def amdsmi_get_gpu_driver_info(self, processor_handle: Any) -> dict[str, Any]:
        gpu = self._gpu(processor_handle, "amdsmi_get_gpu_driver_info")
        return {"driver_name": "amdgpu", "driver_version": gpu.driver_version or "N/A", "driver_date": "N/A"}

    def amdsmi_get_gpu_vram_info(self, processor_handle: Any) -> dict[str, Any]:
        gpu = self._gpu(processor_handle, "amdsmi_get_gpu_vram_info")
        return {
            "vram_type": 3,
            "vram_vendor": "HYNIX",
            "vram_size": gpu.vram_mb,
            "vram_bit_width": 8192,
            "vram_max_bandwidth": "N/A",
        }

    def amdsmi_get_gpu_compute_partition(self, processor_handle: Any) -> str:
        gpu = self._gpu(processor_handle, "amdsmi_get_gpu_compute_partition")
        if gpu.compute_partition is None:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)
        return gpu.compute_partition

    def amdsmi_get_gpu_memory_partition(self, processor_handle: Any) -> str:
        gpu = self._gpu(processor_handle, "amdsmi_get_gpu_memory_partition")
        if gpu.memory_partition is None:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)
        return gpu.memory_partition

    def amdsmi_topo_get_numa_node_number(self, processor_handle: Any) -> int:
        return self._gpu(processor_handle, "amdsmi_topo_get_numa_node_number").numa_node

    def amdsmi_get_gpu_virtualization_mode(self, processor_handle: Any) -> dict[str, Any]:
        self._gpu(processor_handle, "amdsmi_get_gpu_virtualization_mode")
        return {"mode": self.virtualization}

    def amdsmi_get_gpu_activity(self, processor_handle: Any) -> dict[str, Any]:
        gpu = self._gpu(processor_handle, "amdsmi_get_gpu_activity")
        return {"gfx_activity": gpu.gfx_activity, "umc_activity": "N/A", "mm_activity": "N/A"}

    def amdsmi_get_gpu_vram_usage(self, processor_handle: Any) -> dict[str, Any]:
        gpu = self._gpu(processor_handle, "amdsmi_get_gpu_vram_usage")
        return {"vram_total": gpu.vram_mb, "vram_used": gpu.vram_used_mb}

    def amdsmi_get_temp_metric(
        self, processor_handle: Any, sensor_type: _TempType, metric: _TempMetric
    ) -> int:
        if not isinstance(sensor_type, AmdSmiTemperatureType):
            raise AmdSmiParameterException(sensor_type, AmdSmiTemperatureType)
        if not isinstance(metric, AmdSmiTemperatureMetric):
            raise AmdSmiParameterException(metric, AmdSmiTemperatureMetric)
        gpu = self._gpu(processor_handle, f"amdsmi_get_temp_metric({sensor_type.name})")
        if sensor_type == AmdSmiTemperatureType.HOTSPOT:
            return gpu.temp_hotspot
        if sensor_type == AmdSmiTemperatureType.EDGE:
            return gpu.temp_edge
        raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)

    def amdsmi_get_power_info(self, processor_handle: Any) -> dict[str, Any]:
        gpu = self._gpu(processor_handle, "amdsmi_get_power_info")
        return {
            "socket_power": gpu.socket_power,
            "current_socket_power": gpu.socket_power,
            "average_socket_power": "N/A",
            "gfx_voltage": "N/A",
            "soc_voltage": "N/A",
            "mem_voltage": "N/A",
            "power_limit": 750000000,
        }

    def amdsmi_get_gpu_total_ecc_count(self, processor_handle: Any) -> dict[str, Any]:
        # Like the library: the sums of the enabled blocks' counts.
        gpu = self._gpu(processor_handle, "amdsmi_get_gpu_total_ecc_count")
        enabled = [b.name for b in AmdSmiGpuBlock if b.value and gpu.ecc_enabled_mask & b.value]
        return {
            "correctable_count": sum(gpu.ecc_correctable.get(b, 0) for b in enabled),
            "uncorrectable_count": sum(gpu.ecc_uncorrectable.get(b, 0) for b in enabled),
            "deferred_count": 0,
        }

    def amdsmi_get_gpu_ecc_enabled(self, processor_handle: Any) -> int:
        return self._gpu(processor_handle, "amdsmi_get_gpu_ecc_enabled").ecc_enabled_mask

    def amdsmi_get_gpu_ecc_count(self, processor_handle: Any, block: _GpuBlock) -> dict[str, int]:
        if not isinstance(block, AmdSmiGpuBlock):
            raise AmdSmiParameterException(block, AmdSmiGpuBlock)
        gpu = self._gpu(processor_handle, "amdsmi_get_gpu_ecc_count")
        if not gpu.ecc_enabled_mask & block.value:
            raise AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)
        return {
            "correctable_count": gpu.ecc_correctable.get(block.name, 0),
            "uncorrectable_count": gpu.ecc_uncorrectable.get(block.name, 0),
            "deferred_count": 0,
        }

    def amdsmi_get_gpu_ecc_status(self, processor_handle: Any, block: _GpuBlock) -> _RasErrState:
        gpu = self._gpu(processor_handle, "amdsmi_get_gpu_ecc_status")
        if not gpu.ecc_enabled_mask & block.value:
            return AmdSmiRasErrState.DISABLED
        return AmdSmiRasErrState.MULT_UC if gpu.ecc_uncorrectable.get(block.name) else AmdSmiRasErrState.NONE

    def amdsmi_get_gpu_bad_page_info(self, processor_handle: Any) -> list[dict[str, Any]]:
        """Records of ``value``, ``page_address``, ``page_size`` and ``status`` (an int, as amdsmi gives)."""
        gpu = self._gpu(processor_handle, "amdsmi_get_gpu_bad_page_info")
        return [{"value": i, **record} for i, record in enumerate(gpu.bad_pages)]

    def amdsmi_get_gpu_bad_page_threshold(self, processor_handle: Any) -> int | str:
        gpu = self._gpu(processor_handle, "amdsmi_get_gpu_bad_page_threshold")
        return gpu.vram_mb // 100 if gpu.bad_page_threshold is None else gpu.bad_page_threshold

    def amdsmi_get_pcie_info(self, processor_handle: Any) -> dict[str, Any]:
        gpu = self._gpu(processor_handle, "amdsmi_get_pcie_info")
        return {
            "pcie_static": {
                "max_pcie_width": 16,
                "max_pcie_speed": 32000,
                "pcie_interface_version": 5,
                "slot_type": "OAM",
            },
            "pcie_metric": {
                "pcie_width": 16,
                "pcie_speed": 32000,
                "pcie_bandwidth": "N/A",
                "pcie_replay_count": gpu.pcie_replay_count,
                "pcie_l0_to_recovery_count": 0,
                "pcie_replay_roll_over_count": 0,
                "pcie_nak_sent_count": 0,
                "pcie_nak_received_count": 0,
                "pcie_lc_perf_other_end_recovery_count": "N/A",
            },
        }

    def amdsmi_gpu_xgmi_error_status(self, processor_handle: Any) -> int:
        """The status's int value, as `AmdSmiXgmiStatus(status.value).value` gives it."""
        return int(self._gpu(processor_handle, "amdsmi_gpu_xgmi_error_status").xgmi_status)

    def amdsmi_get_gpu_cper_entries(
        self, processor_handle: Any, severity_mask: int, buffer_size: int = 4 * 1048576, cursor: int = 0
    ) -> tuple[dict[int, dict[str, Any]], int, list[dict[str, Any]], int]:
        """Entries are dicts with ``error_severity`` ("fatal"...), ``notify_type`` and ``timestamp``."""
        gpu = self._gpu(processor_handle, "amdsmi_get_gpu_cper_entries")
        severities = {"non_fatal_uncorrected": 0, "fatal": 1, "non_fatal_corrected": 2}
        entries: dict[int, dict[str, Any]] = {}
        data: list[dict[str, Any]] = []
        for record in gpu.cper[cursor:]:
            if severity_mask & (1 << severities.get(record["error_severity"], 10)):
                entries[len(entries)] = dict(record)
                data.append({"bytes": [], "size": record.get("record_length", 0)})
        return entries, len(gpu.cper), data, AMDSMI_STATUS_SUCCESS


def bad_page(
    address: int, status: AmdSmiMemoryPageStatus = AmdSmiMemoryPageStatus.RESERVED
) -> dict[str, Any]:
    """One bad-page record for `FakeGpu.bad_pages` (4 KiB pages; the status as the int amdsmi gives)."""
    return {"page_address": address, "page_size": 4096, "status": int(status)}


def cper_record(
    timestamp: str, severity: str = "fatal", notify_type: str = "MCE", record_id: str = "1"
) -> dict[str, Any]:
    """One CPER header as `amdsmi_get_gpu_cper_entries` returns it (timestamp ``YYYY/MM/DD HH:MM:SS``)."""
    return {
        "error_severity": severity,
        "notify_type": notify_type,
        "timestamp": timestamp,
        "signature": b"CPER",
        "revision": 256,
        "signature_end": "0xffffffff",
        "sec_cnt": 1,
        "record_length": 256,
        "platform_id": "",
        "creator_id": "",
        "record_id": record_id,
        "flags": 0,
        "persistence_info": 0,
    }
