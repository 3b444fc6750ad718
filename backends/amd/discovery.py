"""Discovery of AMD GPUs and their partitions through amdsmi, with AMD's names and attributes.

Read-only: partition modes are never changed. `read_processors` runs in a worker thread and
gathers what amdsmi (plus a little sysfs) says about every processor handle; `build_devices` is
pure and turns that into `Device` values:

- one device per GPU, named ``gpu-<card>-<render>`` after its DRM nodes, ``type=amdgpu``;
- a GPU in a multi-partition mode (CPX, DPX...) publishes its partitions instead, each
  ``type=amdgpu-partition`` with its own DRM indices, ``parentDeviceID``/``parentPciAddr``, and
  the parent's ``deviceID`` so that ``matchAttribute: gpu.amd.com/deviceID`` keeps partitions
  on one GPU.

A call the GPU does not support leaves that attribute out; it never drops the device. amdsmi
answers a processor's PCI address, KFD and DRM ids from what it cached at ``amdsmi_init``, so a GPU
that fell off still lists: it is lost when a call that reaches the device (the DRM ioctl behind
``asic_info``, the UUID and ``vram_info``) answers with a lost status. Such a processor is reported
in `ProcessorScan.lost` with its current handle: the backend keeps the devices it published for
it, names and attributes as they were (tainted ``gpu-lost`` by the health pass).

A value the library should never give (a PCI address that does not parse, a serial that is not
hex, a partition mode AMD does not define) skips that processor with one line naming the value.
In-box amdgpu has no version of its own (amdsmi then answers the kernel release): no
``driverVersion``. Partitions get a UUID only when amdsmi gives each its own (7.0.x gives every
partition its GPU's).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.core.errors import VersionError
from agent.core.logs import log_fields
from agent.core.model import AttributeValue, Device, Version
from agent.core.quantity import Quantity
from agent.core.semver import normalize_version
from backends.amd.smi import describe, handle_key, is_lost, log_degraded

log = logging.getLogger("agent.backends.amd")

DEFAULT_DRIVER_NAME = "gpu.amd.com"
TYPE_GPU = "amdgpu"
TYPE_PARTITION = "amdgpu-partition"
PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
NUMA_NODE = "resource.kubernetes.io/numaNode"
"""Standard from Kubernetes 1.37 (an int), beside AMD's own ``numaNode``."""
MIB = 1024 * 1024
_NA = "N/A"
_BDF = re.compile(r"^([0-9a-fA-F]{4,}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")
# amdgpu family names by GFX major version (the kernel's AMDGPU_FAMILY_* of the ASICs using it).
_FAMILY_BY_GFX = {"9": "AI", "10": "NV", "11": "GC_11_0_0", "12": "GC_12_0_0"}
# SIMDs per CU when KFD topology is unreadable: 4 on GCN/CDNA (gfx9), 2 on RDNA.
_SIMD_PER_CU_BY_GFX = {"9": 4, "10": 2, "11": 2, "12": 2}
# amdsmi_compute_partition_type_t and amdsmi_memory_partition_type_t names.
COMPUTE_PARTITIONS = frozenset({"SPX", "DPX", "TPX", "QPX", "CPX"})
MEMORY_PARTITIONS = frozenset({"NPS1", "NPS2", "NPS4", "NPS8"})
# Calls that reach the device through the DRM ioctl (amd_smi_drm.cc): they fail on a lost GPU.
_DEVICE_CALLS = frozenset(
    {"amdsmi_get_gpu_asic_info", "amdsmi_get_gpu_device_uuid", "amdsmi_get_gpu_vram_info"}
)


@dataclass(frozen=True)
class Sysfs:
    """Reads the few facts amdsmi does not give; `root` is injectable for tests and containers."""

    root: str = "/sys"

    def _read(self, *parts: str) -> str | None:
        try:
            with open(os.path.join(self.root, *parts), encoding="utf-8") as f:
                return f.read()
        except OSError:
            return None

    def pcie_root(self, bdf: str) -> str | None:
        """The PCIe root complex of a PCI device as ``pci<domain>:<bus>``, from its sysfs path."""
        try:
            real = os.path.realpath(os.path.join(self.root, "bus", "pci", "devices", bdf))
        except OSError:
            return None
        for part in real.split(os.sep):
            if re.match(r"^pci[0-9a-fA-F]{4,}:[0-9a-fA-F]{2}$", part):
                return part.lower()
        return None

    def kfd_properties(self, node_id: int) -> dict[str, int]:
        """The integer properties of a KFD topology node (``simd_count``, ``drm_render_minor``...)."""
        text = self._read("class", "kfd", "kfd", "topology", "nodes", str(node_id), "properties")
        props: dict[str, int] = {}
        for line in (text or "").splitlines():
            key, _, value = line.strip().partition(" ")
            try:
                props[key] = int(value.strip())
            except ValueError:
                continue
        return props

    def card_of_render(self, render: int) -> int | None:
        """The ``card<N>`` index that belongs to ``renderD<render>``."""
        try:
            names = os.listdir(os.path.join(self.root, "class", "drm", f"renderD{render}", "device", "drm"))
        except OSError:
            return None
        cards = sorted(int(n[4:]) for n in names if n.startswith("card") and n[4:].isdigit())
        return cards[0] if cards else None


@dataclass(frozen=True)
class ProcessorInfo:
    """What amdsmi reported about one processor handle (a GPU or one partition of it)."""

    handle: Any
    bdf: str
    card: int
    render: int
    uuid: str = ""
    asic_serial: str = ""
    market_name: str = ""
    product_name: str = ""
    pci_device_id: str = ""
    gfx_version: str = ""
    compute_units: int | None = None
    simd_units: int | None = None
    vram_bytes: int | None = None
    driver_version: str = ""
    compute_partition: str = ""
    memory_partition: str = ""
    partition_id: int = 0
    numa_node: int | None = None
    pcie_root: str | None = None


@dataclass(frozen=True)
class ProcessorScan:
    """One read of every processor handle: what answered, and what answered with a lost status."""

    infos: tuple[ProcessorInfo, ...] = ()
    lost: Mapping[str, tuple[Any, str]] = field(default_factory=dict)
    """PCI address -> (handle, why), for processors whose calls to the device met a lost status."""
    listing_lost: str = ""
    """Why listing the handles failed with a lost status (the driver went away); "" when it did not."""


class HandleLostError(Exception):
    """A processor handle answered with a status that means its GPU is gone."""


class BadValueError(Exception):
    """The library answered a value it never should (the processor is skipped)."""


@dataclass(frozen=True)
class DeviceEntry:
    """What the backend keeps about one published device to serve health, prepare and telemetry."""

    name: str
    handle: Any
    card: int
    render: int
    gpu_key: str
    """The physical GPU (``domain:bus:device``); partitions of one GPU share it."""
    primary: Any
    """The handle of the GPU's first partition (RAS and resets are per physical GPU)."""
    bdf: str = ""
    """The processor's PCI address as amdsmi gives it (a partition's has its id in the function)."""


@dataclass(frozen=True)
class Discovery:
    """The devices to publish and how to reach each one."""

    devices: tuple[Device, ...] = ()
    entries: Mapping[str, DeviceEntry] = field(default_factory=dict)


def _get(smi: Any, device: str, function: str, handle: Any) -> Any:
    """Call ``smi.<function>(handle)``; an amdsmi error (unsupported, missing) degrades to None.

    A lost status from a call that reaches the device raises `HandleLostError`; a value the
    binding cannot convert (``int(serial, 16)`` of a serial that is not hex) `BadValueError`.
    """
    try:
        return getattr(smi, function)(handle)
    except smi.AmdSmiException as error:
        if function in _DEVICE_CALLS and is_lost(error):
            raise HandleLostError(f"{function}: {describe(error)}") from error
        log_degraded(device, function, error)
    except ValueError as error:
        raise BadValueError(f"{function} answered a value amdsmi cannot read ({error})") from error
    except AttributeError as error:
        # An older amdsmi without this function: degrade like NOT_SUPPORTED.
        log_degraded(device, function, error)
    return None


def _text(value: object) -> str:
    return value.strip() if isinstance(value, str) and value.strip() != _NA else ""


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _drm_indices(
    smi: Any, handle: Any, label: str, sysfs: Sysfs, kfd_node: int | None
) -> tuple[int, int] | None:
    enum = _get(smi, label, "amdsmi_get_gpu_enumeration_info", handle)
    if isinstance(enum, Mapping):
        card, render = _int(enum.get("drm_card")), _int(enum.get("drm_render"))
        if card is not None and render is not None:
            return card, render
    # Older amdsmi: the render minor from KFD topology, the card from the render node's device.
    if kfd_node is not None:
        render = sysfs.kfd_properties(kfd_node).get("drm_render_minor")
        if render:
            card = sysfs.card_of_render(render)
            if card is not None:
                return card, render
    return None


def _partition(value: object, known: frozenset[str], what: str) -> str:
    text = _text(value).upper()
    if text and text not in known:
        raise BadValueError(f"{what} {text!r} is none of {', '.join(sorted(known))}")
    return text


def read_processor(smi: Any, handle: Any, sysfs: Sysfs) -> ProcessorInfo | None:
    """Gather one handle's facts (blocking); None when its PCI address or DRM nodes are unknown.

    Raises `HandleLostError` when a call that reaches the device answers with a lost status, and
    `BadValueError` for a value the library never should answer.
    """
    try:
        bdf = str(smi.amdsmi_get_gpu_device_bdf(handle)).lower()
    except smi.AmdSmiException as error:
        if is_lost(error):
            raise HandleLostError(describe(error)) from error
        log.warning(
            "skipping a GPU whose PCI address amdsmi cannot read",
            extra=log_fields(handle=handle_key(handle), error=describe(error)),
        )
        return None
    if not _BDF.match(bdf):
        raise BadValueError(f"PCI address {bdf!r} does not parse")
    kfd = _get(smi, bdf, "amdsmi_get_gpu_kfd_info", handle)
    kfd_node = _int(kfd.get("node_id")) if isinstance(kfd, Mapping) else None
    indices = _drm_indices(smi, handle, bdf, sysfs, kfd_node)
    if indices is None:
        log.warning(
            "skipping a GPU whose DRM nodes are unknown (amdsmi too old and no /sys/class/kfd)",
            extra=log_fields(pci_bus_id=bdf),
        )
        return None
    card, render = indices
    label = f"gpu-{card}-{render}"
    asic = _get(smi, label, "amdsmi_get_gpu_asic_info", handle) or {}
    board = _get(smi, label, "amdsmi_get_gpu_board_info", handle) or {}
    driver = _get(smi, label, "amdsmi_get_gpu_driver_info", handle) or {}
    vram = _get(smi, label, "amdsmi_get_gpu_vram_info", handle) or {}
    uuid = _get(smi, label, "amdsmi_get_gpu_device_uuid", handle)
    compute = _partition(
        _get(smi, label, "amdsmi_get_gpu_compute_partition", handle), COMPUTE_PARTITIONS, "compute partition"
    )
    memory = _partition(
        _get(smi, label, "amdsmi_get_gpu_memory_partition", handle), MEMORY_PARTITIONS, "memory partition"
    )
    numa = _get(smi, label, "amdsmi_topo_get_numa_node_number", handle)
    gfx = _text(asic.get("target_graphics_version"))
    gfx_major = _gfx_major(gfx)
    cus = _int(asic.get("num_compute_units"))
    simds = sysfs.kfd_properties(kfd_node).get("simd_count") if kfd_node is not None else None
    if not simds and cus is not None and gfx_major in _SIMD_PER_CU_BY_GFX:
        simds = cus * _SIMD_PER_CU_BY_GFX[gfx_major]
    vram_mb = _int(vram.get("vram_size"))
    partition_id = _int(kfd.get("current_partition_id")) if isinstance(kfd, Mapping) else None
    if partition_id is None:
        partition_id = int(bdf[-1])
    return ProcessorInfo(
        handle=handle,
        bdf=bdf,
        card=card,
        render=render,
        uuid=_text(uuid),
        asic_serial=_text(asic.get("asic_serial")),
        market_name=_text(asic.get("market_name")),
        product_name=_text(board.get("product_name")),
        pci_device_id=_text(asic.get("device_id")),
        gfx_version=gfx,
        compute_units=cus,
        simd_units=simds or None,
        vram_bytes=vram_mb * MIB if vram_mb else None,
        driver_version=_text(driver.get("driver_version")),
        compute_partition=compute,
        memory_partition=memory,
        partition_id=partition_id,
        numa_node=numa if isinstance(numa, int) and numa >= 0 else None,
        pcie_root=sysfs.pcie_root(_parent_bdf(bdf)),
    )


def scan_processors(smi: Any, sysfs: Sysfs) -> ProcessorScan:
    """Read every AMD GPU processor handle (blocking: run in a worker thread).

    Only the PCI address read and the calls that reach the device decide that a handle is lost: a
    sysfs read failing (board info unreadable on some boards) only leaves an attribute out.
    """
    try:
        handles = smi.amdsmi_get_processor_handles()
    except smi.AmdSmiException as error:
        if is_lost(error):
            return ProcessorScan(listing_lost=describe(error))
        raise
    infos: list[ProcessorInfo] = []
    lost: dict[str, tuple[Any, str]] = {}
    for handle in handles:
        try:
            info = read_processor(smi, handle, sysfs)
        except HandleLostError as error:
            lost[_bdf_or_key(smi, handle)] = (handle, str(error))
            continue
        except BadValueError as error:
            log.warning(
                "skipping a GPU: the library answered a bad value",
                extra=log_fields(handle=handle_key(handle), error=str(error)),
            )
            continue
        if info is not None:
            infos.append(info)
    return ProcessorScan(tuple(infos), lost)


def _bdf_or_key(smi: Any, handle: Any) -> str:
    """The PCI address amdsmi cached for `handle` (or its handle key when even that fails)."""
    try:
        return str(smi.amdsmi_get_gpu_device_bdf(handle)).lower()
    except smi.AmdSmiException:
        return f"handle-{handle_key(handle)}"


def read_processors(smi: Any, sysfs: Sysfs) -> list[ProcessorInfo]:
    """The processors `scan_processors` finds answering (blocking)."""
    return list(scan_processors(smi, sysfs).infos)


def _gfx_major(gfx: str) -> str:
    # gfx942 -> "9", gfx90a -> "9", gfx1100 -> "11"
    digits = gfx[3:] if gfx.startswith("gfx") else ""
    if len(digits) >= 4:
        return digits[:2]
    return digits[:1]


def _parent_bdf(bdf: str) -> str:
    """The PCI function a partition lives on (amdsmi puts the partition id in the BDF function)."""
    match = _BDF.match(bdf)
    return f"{match.group(1)}:{match.group(2)}:{match.group(3)}.0" if match else bdf


def _gpu_key(bdf: str) -> str:
    return bdf.rpartition(".")[0] or bdf


def _device_id(info: ProcessorInfo) -> str:
    """AMD's deviceID: the GPU's unique id (ASIC serial) in decimal, else its UUID or PCI address."""
    serial = info.asic_serial.lower().removeprefix("0x")
    if serial:
        try:
            return str(int(serial, 16))
        except ValueError:
            pass
    return info.uuid or info.bdf


def _product(info: ProcessorInfo) -> str:
    name = info.product_name or info.market_name
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name.strip()).strip("_")[:64]


def _profile(info: ProcessorInfo) -> str:
    if not info.compute_partition:
        return ""
    if info.memory_partition:
        return f"{info.compute_partition}_{info.memory_partition}".lower()
    return info.compute_partition.lower()


def _version(device: str, raw: str, warned: set[str]) -> Version | None:
    if raw and raw == os.uname().release:
        # In-box amdgpu has no version file; amdsmi then answers the kernel release
        # (amd_smi_utils.cc smi_amdgpu_get_driver_version reads /proc/version): not amdgpu's version.
        if f"{device}/driverVersion" not in warned:
            warned.add(f"{device}/driverVersion")
            log.info(
                "in-box amdgpu (amdsmi answers the kernel release); no driverVersion",
                extra=log_fields(device=device, kernel=raw),
            )
        return None
    if not raw:
        if f"{device}/driverVersion" not in warned:
            warned.add(f"{device}/driverVersion")
            log.warning("amdgpu driver version unknown; no driverVersion", extra=log_fields(device=device))
        return None
    try:
        return Version(normalize_version(raw))
    except VersionError as error:
        if f"{device}/driverVersion" not in warned:
            warned.add(f"{device}/driverVersion")
            log.warning(
                "amdgpu driver version is not a usable version; leaving driverVersion out",
                extra=log_fields(device=device, version=raw, error=str(error)),
            )
        return None


def _device(
    info: ProcessorInfo, parent: ProcessorInfo | None, driver: str, warned: set[str], uuid: str
) -> Device:
    name = f"gpu-{info.card}-{info.render}"
    owner = parent or info
    product = _product(info) or _product(owner)
    attrs: dict[str, AttributeValue] = {
        "type": TYPE_PARTITION if parent else TYPE_GPU,
        "cardIndex": info.card,
        "renderIndex": info.render,
        "deviceID": _device_id(owner),
        "pciAddr": info.bdf,
        # The standard attribute names the real PCI function; partitions share their GPU's.
        PCI_BUS_ID: _parent_bdf(info.bdf),
    }
    family = _FAMILY_BY_GFX.get(_gfx_major(info.gfx_version or owner.gfx_version))
    if family:
        attrs["family"] = family
    if product:
        attrs["productName"] = product
    version = _version(name, info.driver_version or owner.driver_version, warned)
    if version is not None:
        attrs["driverVersion"] = version
    profile = _profile(info) or _profile(owner)
    if profile:
        attrs["partitionProfile"] = profile
    numa = info.numa_node if info.numa_node is not None else owner.numa_node
    if numa is not None:
        attrs["numaNode"] = numa
        attrs[NUMA_NODE] = numa
    root = info.pcie_root or owner.pcie_root
    if root:
        attrs[PCIE_ROOT] = root
    if parent is not None:
        attrs["parentDeviceID"] = _device_id(parent)
        attrs["parentPciAddr"] = parent.bdf
    capacity: dict[str, Quantity] = {}
    if info.vram_bytes:
        capacity["memory"] = Quantity.binary(info.vram_bytes)
    if info.compute_units is not None:
        capacity["computeUnits"] = Quantity.parse(info.compute_units)
    if info.simd_units:
        capacity["simdUnits"] = Quantity.parse(info.simd_units)
    return Device(
        name=name,
        driver=driver,
        attributes=attrs,
        capacity=capacity,
        uuid=uuid,
        pci_bus_id=info.bdf,
        product=product,
        parent=f"gpu-{parent.card}-{parent.render}" if parent else "",
    )


def build_devices(infos: Sequence[ProcessorInfo], driver: str, warned: set[str] | None = None) -> Discovery:
    """Turn processor facts into devices: GPUs, or the partitions of partitioned GPUs."""
    warned = set() if warned is None else warned
    groups: dict[str, list[ProcessorInfo]] = {}
    for info in infos:
        groups.setdefault(_gpu_key(info.bdf), []).append(info)
    devices: list[Device] = []
    entries: dict[str, DeviceEntry] = {}
    for key, members in sorted(groups.items()):
        members.sort(key=lambda i: (i.partition_id, i.bdf))
        first = members[0]
        partitioned = len(members) > 1
        # 7.0.x gives every partition its GPU's UUID: a partition's identity is then its PCI
        # address (partition id in the function), never a UUID it shares.
        uuids = [m.uuid for m in members]
        for info in members:
            uuid = info.uuid if uuids.count(info.uuid) == 1 else ""
            device = _device(info, first if partitioned else None, driver, warned, uuid)
            if device.name in entries:
                log.warning("two GPUs share DRM nodes; skipping one", extra=log_fields(device=device.name))
                continue
            devices.append(device)
            entries[device.name] = DeviceEntry(
                device.name, info.handle, info.card, info.render, key, first.handle, info.bdf
            )
    devices.sort(key=lambda d: (entries[d.name].card, entries[d.name].render))
    return Discovery(tuple(devices), entries)
