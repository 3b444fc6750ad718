"""AMD's real `amdsmi` package over our stand-in ``libamd_smi.so`` (tests/fakes/amdsmi_standin/standin.c).

The tests never replace the binding: they load AMD's unmodified ``amdsmi`` (the ``amd`` extra)
with ``ROCM_PATH`` pointing at a library built here from C with the system compiler, and drive the
library's "hardware" through its control functions. `build` compiles it (once per source
change) into ``build/amd-standin/<variant>/lib/libamd_smi.so``: every symbol the wrapper binds at
import is exported (those the stand-in does not implement answer NOT_SUPPORTED; the list is read
from the installed wrapper), and the ``no-cper`` variant lacks ``amdsmi_get_gpu_cper_entries``, as
a ROCm older than the binding does.

`StandIn` is the library in this process: `configure` installs `GpuSpec`s (fixtures `mi300x`,
`mi250x`, `mi210`); changing a spec's fields afterwards changes the hardware at once, while what
amdsmi caches at ``amdsmi_init`` (handles, PCI address, DRM and KFD ids) follows only after
``amdsmi_shut_down`` + ``amdsmi_init``, as on a real node.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SOURCE = Path(__file__).resolve().parent / "amdsmi_standin" / "standin.c"
BUILD = REPO / "build" / "amd-standin"
VARIANTS = {"full": [], "no-cper": ["-DSTANDIN_WITHOUT_CPER"]}
_WITHOUT = {"no-cper": {"amdsmi_get_gpu_cper_entries"}}

# amdsmi_status_t values used by the tests (amdsmi_wrapper.AMDSMI_STATUS_*).
STATUS_NOT_SUPPORTED = 2
STATUS_DRM_ERROR = 6
STATUS_NO_PERM = 10
STATUS_INIT_ERROR = 18
STATUS_FILE_ERROR = 14
STATUS_NOT_FOUND = 31
STATUS_DRIVER_NOT_LOADED = 34
STATUS_NO_DATA = 40
STATUS_UNKNOWN_ERROR = 0xFFFFFFFF

BLOCKS = {"UMC": 1, "SDMA": 2, "GFX": 4, "MMHUB": 8, "ATHUB": 16, "PCIE_BIF": 32, "HDP": 64, "XGMI_WAFL": 128}
EVENTS = {"VMFAULT": 1, "THERMAL_THROTTLE": 2, "GPU_PRE_RESET": 3, "GPU_POST_RESET": 4, "PROCESS_START": 12}
CPER_SEVERITIES = {"non_fatal_uncorrected": 0, "fatal": 1, "non_fatal_corrected": 2}
# AmdSmiCperNotifyType values (the notify GUID's first 8 bytes, little endian).
CPER_NOTIFY = {"CMC": 4976123370175105969, "MCE": 5531987820403847166, "PCIE": 5619395120325705759}
PAGE_RESERVED, PAGE_PENDING, PAGE_UNRESERVABLE = 0, 1, 2


class StandInUnavailableError(RuntimeError):
    """The stand-in library cannot be built (no C compiler): run ``make test``, which installs one."""


def _wrapper_symbols() -> list[str]:
    spec = importlib.util.find_spec("amdsmi")
    if spec is None or spec.origin is None:
        raise StandInUnavailableError("the amdsmi package is not installed: pip install -e '.[dev,amd]'")
    text = (Path(spec.origin).parent / "amdsmi_wrapper.py").read_text()
    return sorted(set(re.findall(r"_libraries\['libamd_smi\.so'\]\.(\w+)", text)))


def _implemented() -> set[str]:
    return set(re.findall(r"^uint32_t (amdsmi_\w+)\(", SOURCE.read_text(), re.M))


def build(variant: str = "full") -> Path:
    """The ROCm directory (``ROCM_PATH``) of the stand-in `variant`, built when out of date."""
    root = BUILD / variant
    lib = root / "lib" / "libamd_smi.so"
    symbols = _wrapper_symbols()
    implemented, without = _implemented(), _WITHOUT.get(variant, set())
    stubs_text = "".join(
        f"unsigned {name}(void) {{ return 2; }}\n"  # AMDSMI_STATUS_NOT_SUPPORTED
        for name in symbols
        if name not in implemented and name not in without
    )
    stubs = root / "stubs.c"
    fresh = lib.exists() and stubs.exists() and lib.stat().st_mtime >= SOURCE.stat().st_mtime
    if fresh and stubs.read_text() == stubs_text:
        return root
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise StandInUnavailableError("no C compiler (cc): 'make test' installs one, or apt-get install gcc")
    lib.parent.mkdir(parents=True, exist_ok=True)
    stubs.write_text(stubs_text)
    partial = lib.with_suffix(f".{os.getpid()}.tmp")
    flags = ["-shared", "-fPIC", "-O1", "-Wall", "-pthread", *VARIANTS[variant]]
    subprocess.run(
        [compiler, *flags, "-o", str(partial), str(SOURCE), str(stubs)],
        check=True,
        capture_output=True,
    )
    partial.replace(lib)
    return root


@dataclass
class GpuSpec:
    """One processor (a GPU, or one partition of one) of the stand-in's hardware.

    ``driver_version`` "inbox" answers as in-box amdgpu does (the kernel release, from
    /proc/version); ``bad_page_threshold`` None is what amdsmi answers without root (NOT_SUPPORTED);
    ``unsupported`` names functions that answer NOT_SUPPORTED; ``fail`` maps functions to a status;
    ``lost`` makes the GPU fall off: DRM calls answer DRM_ERROR, sysfs ones an unknown error.
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
    compute_partition: str = ""
    memory_partition: str = ""
    partition_id: int = 0
    numa_node: int = 0
    kfd_node: int = 1
    ecc_enabled_mask: int = BLOCKS["UMC"] | BLOCKS["SDMA"] | BLOCKS["GFX"] | BLOCKS["MMHUB"]
    ecc_uncorrectable: dict[str, int] = field(default_factory=dict)
    ecc_correctable: dict[str, int] = field(default_factory=dict)
    cper: list[tuple[str, str, str, str]] = field(default_factory=list)
    """(timestamp ``YYYY/MM/DD HH:MM:SS``, severity, notify type, record id), oldest first."""
    bad_pages: list[tuple[int, int]] = field(default_factory=list)
    """(page address, status) of 4 KiB pages."""
    bad_page_threshold: int | None = None
    pcie_replay_count: int | None = 0
    xgmi_status: int = 0
    gfx_activity: int = 0
    vram_used_mb: int = 0
    temp_hotspot: int | None = 45
    temp_edge: int | None = 38
    socket_power: int = 150
    unsupported: set[str] = field(default_factory=set)
    fail: dict[str, int] = field(default_factory=dict)
    lost: bool = False
    _bound: Any = field(default=None, repr=False, compare=False)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        bound = self.__dict__.get("_bound")
        if bound is not None and not name.startswith("_"):
            standin, index = bound
            standin.push(index, self)

    def commands(self, index: int | None) -> list[str]:
        """The commands that make processor `index` (None: a new one) what this spec says; the lines
        after the first name the processor ``{index}``, filled in once the first has answered it."""
        values = {
            "bdf": self.bdf,
            "card": self.card,
            "render": self.render,
            "kfd": self.kfd_node,
            "partition": self.partition_id,
            "numa": self.numa_node,
            "market": self.market_name,
            "product": self.product_name,
            "serial": self.asic_serial,
            "driver": self.driver_version,
            "compute": self.compute_partition,
            "memory": self.memory_partition,
            "device_id": self.device_id,
            "gfx": self.gfx.removeprefix("gfx"),
            "vram_mb": self.vram_mb,
            "cus": self.num_compute_units,
            "ecc_mask": self.ecc_enabled_mask,
            "threshold": -1 if self.bad_page_threshold is None else self.bad_page_threshold,
            "pcie_replay": -1 if self.pcie_replay_count is None else self.pcie_replay_count,
            "xgmi": self.xgmi_status,
            "activity": self.gfx_activity,
            "vram_used": self.vram_used_mb,
            "power": self.socket_power,
            "temp_hotspot": -100000 if self.temp_hotspot is None else self.temp_hotspot,
            "temp_edge": -100000 if self.temp_edge is None else self.temp_edge,
            "lost": int(self.lost),
            "unsupported": ",".join(sorted(self.unsupported)),
        }
        fields = "|".join(f"{k}={v}" for k, v in values.items())
        head = "gpu" if index is None else f"set|{index}"
        lines = [f"{head}|{fields}"]
        at = "{index}"
        lines.append(f"clear|{at}")  # the lists below replace what the processor had
        for block in set(self.ecc_correctable) | set(self.ecc_uncorrectable):
            ce, ue = self.ecc_correctable.get(block, 0), self.ecc_uncorrectable.get(block, 0)
            lines.append(f"ecc|{at}|{BLOCKS[block]}|{ce}|{ue}")
        for address, status in self.bad_pages:
            lines.append(f"page|{at}|{address}|4096|{status}")
        for stamp, severity, notify, record in self.cper:
            lines.append(f"cper|{at}|{CPER_SEVERITIES[severity]}|{CPER_NOTIFY[notify]}|{stamp}|{record}")
        for function, status in self.fail.items():
            lines.append(f"fail|{at}|{function}|{status}")
        return lines


def cper_record(
    timestamp: str, severity: str = "fatal", notify_type: str = "MCE", record_id: str = "1"
) -> tuple[str, str, str, str]:
    """One CPER record for `GpuSpec.cper` (timestamp ``YYYY/MM/DD HH:MM:SS``, UTC)."""
    return (timestamp, severity, notify_type, record_id)


def bad_page(address: int, status: int = PAGE_RESERVED) -> tuple[int, int]:
    """One bad-page record for `GpuSpec.bad_pages`."""
    return (address, status)


class StandIn:
    """The stand-in library loaded in this process, and the real `amdsmi` module over it."""

    def __init__(self, lib: ctypes.CDLL, module: Any) -> None:
        self.lib = lib
        self.module = module
        self.gpus: list[GpuSpec] = []
        lib.standin_command.argtypes = [ctypes.c_char_p]
        lib.standin_command.restype = ctypes.c_int
        lib.standin_calls.argtypes = [ctypes.c_char_p]
        lib.standin_calls.restype = ctypes.c_uint64
        lib.standin_handle.argtypes = [ctypes.c_int]
        lib.standin_handle.restype = ctypes.c_void_p
        lib.standin_event_mask.argtypes = [ctypes.c_int]
        lib.standin_event_mask.restype = ctypes.c_uint64
        lib.standin_uuid.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]

    def command(self, line: str) -> int:
        result = int(self.lib.standin_command(line.encode()))
        if result < 0:
            raise ValueError(f"the stand-in rejected the command {line!r}")
        return result

    def configure(self, gpus: Iterable[GpuSpec], **behaviour: object) -> StandIn:
        """A fresh library (not initialised) with `gpus` and `behaviour` (see `set_behaviour`)."""
        self.command("reset")
        for spec in self.gpus:
            object.__setattr__(spec, "_bound", None)
        self.gpus = []
        for spec in gpus:
            self.add(spec)
        self.set_behaviour(**behaviour)
        return self

    def set_behaviour(self, **behaviour: object) -> None:
        """Library-wide behaviours: ``cper_empty_file_error`` (7.0.x, default True),
        ``uuid_per_partition`` (newer amdsmi, default False), ``init_status``, ``events_status``,
        ``first_read_status`` (a stale status of the first event read), ``read_status`` (every
        read), ``lib_version``
        ("26.0.2"), ``hang`` (a function that blocks until `release`)."""
        for key, value in behaviour.items():
            text = str(int(value)) if isinstance(value, bool) else str(value)
            self.command(f"global|{key}={text}")

    def add(self, spec: GpuSpec) -> int:
        """Install one more processor (listed from the next ``amdsmi_init``); its index."""
        lines = spec.commands(None)
        index = self.command(lines[0])
        for line in lines[1:]:
            self.command(line.replace("{index}", str(index)))
        object.__setattr__(spec, "_bound", (self, index))
        self.gpus.append(spec)
        return index

    def push(self, index: int, spec: GpuSpec) -> None:
        for line in spec.commands(index):
            self.command(line.replace("{index}", str(index)))

    def remove(self, index: int) -> None:
        """Take processor `index` out of the hardware (gone from the next ``amdsmi_init``)."""
        self.command(f"remove|{index}")

    def push_event(self, index: int, event: str, message: str = "") -> None:
        """Queue a KFD event of processor `index` (delivered when its reader subscribes to it)."""
        self.command(f"event|{index}|{EVENTS[event] if event in EVENTS else int(event)}|{message}")

    def release(self) -> None:
        """Let the function made to hang (``hang``) return."""
        self.command("release")

    def calls(self, function: str) -> int:
        return int(self.lib.standin_calls(function.encode()))

    def handle(self, index: int) -> Any:
        """amdsmi's handle of processor `index` now (it changes at each ``amdsmi_init``)."""
        value = self.lib.standin_handle(index)
        if value is None:
            raise LookupError(f"processor {index} is not listed since amdsmi_init")
        return self.module.amdsmi_wrapper.amdsmi_processor_handle(value)

    def event_mask(self, index: int) -> int:
        return int(self.lib.standin_event_mask(index))

    def uuid(self, index: int) -> str:
        out = ctypes.create_string_buffer(64)
        self.lib.standin_uuid(index, out, 64)
        return out.value.decode()


_loaded: dict[str, StandIn] = {}


def load() -> StandIn:
    """The stand-in in this process, with AMD's real `amdsmi` imported over it (once)."""
    if "full" in _loaded:
        return _loaded["full"]
    root = build("full")
    os.environ["ROCM_PATH"] = str(root)
    if "amdsmi" in sys.modules:
        del sys.modules["amdsmi"]
    module = importlib.import_module("amdsmi")
    lib = ctypes.CDLL(str(root / "lib" / "libamd_smi.so"))  # the same library amdsmi loaded
    _loaded["full"] = StandIn(lib, module)
    return _loaded["full"]


def environment(gpus: Sequence[GpuSpec], variant: str = "full", **behaviour: object) -> dict[str, str]:
    """Environment variables that give an agent process the real amdsmi over the stand-in."""
    lines: list[str] = []
    for index, spec in enumerate(gpus):
        for line in spec.commands(None):
            lines.append(line.replace("{index}", str(index)))
    for key, value in behaviour.items():
        lines.append(f"global|{key}={int(value) if isinstance(value, bool) else value}")
    return {"ROCM_PATH": str(build(variant)), "AMDSMI_STANDIN_COMMANDS": "\n".join(lines)}


def _serial(base: int, gpu: int) -> str:
    return f"{base + gpu * 0x1111:016X}"


def mi300x(mode: str = "spx_nps1", count: int = 8, driver_version: str = "6.12.12") -> list[GpuSpec]:
    """MI300X OAM nodes: SPX/NPS1 (one processor per GPU) or CPX/NPS4 (eight partitions per GPU).

    In CPX the partitions share the GPU's PCI device (partition id in the BDF function), its
    serial and, in 7.0.x, its UUID; amdsmi reports each partition's VRAM share.
    """
    compute, memory = mode.upper().split("_")
    parts = 8 if compute == "CPX" else 1
    buses = [0x05, 0x26, 0x46, 0x65, 0x85, 0xA6, 0xC6, 0xE5]
    return [
        GpuSpec(
            bdf=f"0000:{buses[g % 8]:02x}:00.{p}",
            card=1 + g * parts + p,
            render=128 + g * parts + p,
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
            kfd_node=2 + g * parts + p,
        )
        for g in range(count)
        for p in range(parts)
    ]


def mi250x(count: int = 8) -> list[GpuSpec]:
    """MI250X: each OAM shows as two GCDs (two GPUs); no partition modes."""
    return [
        GpuSpec(
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
        )
        for g in range(count)
    ]


def mi210(count: int = 4) -> list[GpuSpec]:
    """MI210 PCIe cards: no partitions, no CPER, no XGMI, in-box amdgpu (kernel release as version)."""
    return [
        GpuSpec(
            bdf=f"0000:{0x03 + g * 0x20:02x}:00.0",
            card=1 + g,
            render=128 + g,
            market_name="AMD Instinct MI210",
            product_name="",
            device_id=0x740F,
            asic_serial=_serial(0x1B2C3D4E5F000010, g),
            num_compute_units=104,
            gfx="gfx90a",
            vram_mb=65520,
            driver_version="inbox",
            numa_node=0,
            kfd_node=2 + g,
            unsupported={"amdsmi_get_gpu_cper_entries", "amdsmi_gpu_xgmi_error_status"},
        )
        for g in range(count)
    ]


def replace(spec: GpuSpec, **changes: Any) -> GpuSpec:
    """A copy of `spec` (unbound) with `changes`."""
    return dataclasses.replace(spec, _bound=None, **changes)


def __getattr__(name: str) -> Any:
    # AMD's exception classes (``AmdSmiLibraryException``...), from the real binding over the stand-in.
    if name.startswith("AmdSmi"):
        return getattr(load().module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
