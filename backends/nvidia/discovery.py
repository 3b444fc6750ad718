"""Discovery of full GPUs and existing MIG devices through NVML, named and described as NVIDIA's driver does.

Read-only: nothing here changes MIG mode or any other GPU setting. Runs in a worker thread
(`discover_sync` is blocking). A call the GPU or driver cannot do drops that attribute, not the
device; a GPU that is lost (fell off the bus) is left out and logged, and its index is reported
(`Discovery.lost`) so that the backend keeps publishing what it knew of it (the health pass then
marks it ``gpu-lost``) instead of letting it vanish.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from agent.core.errors import AgentError
from agent.core.logs import log_fields
from agent.core.model import AttributeValue, Device, Version
from agent.core.quantity import Quantity
from agent.core.semver import normalize_version
from backends.nvidia.nvml import Nvml, text

log = logging.getLogger("agent.backends.nvidia")

DEFAULT_DRIVER_NAME = "gpu.nvidia.com"
PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
NUMA_NODE = "resource.kubernetes.io/numaNode"
"""Standard from Kubernetes 1.37 (an int); a domain-qualified name every release accepts."""
MIB = 1024 * 1024

# nvmlDeviceGetArchitecture values -> NVIDIA's names (as in the NVIDIA DRA driver).
ARCHITECTURES = {
    2: "Kepler",
    3: "Maxwell",
    4: "Pascal",
    5: "Volta",
    6: "Turing",
    7: "Ampere",
    8: "Ada Lovelace",
    9: "Hopper",
    10: "Blackwell",
    13: "Rubin",
}
# Fallback when the driver is too old for nvmlDeviceGetArchitecture: compute capability major.
ARCHITECTURE_BY_CC = {
    3: "Kepler",
    5: "Maxwell",
    6: "Pascal",
    7: "Volta",
    8: "Ampere",
    9: "Hopper",
    10: "Blackwell",
}
BRANDS = {
    0: "Unknown",
    1: "Quadro",
    2: "Tesla",
    3: "NVS",
    4: "Grid",
    5: "GeForce",
    6: "Titan",
    7: "NvidiaVApps",
    8: "NvidiaVPC",
    9: "NvidiaVCS",
    10: "NvidiaVWS",
    11: "NvidiaCloudGaming",
    12: "QuadroRTX",
    13: "NvidiaRTX",
    14: "Nvidia",
    15: "GeForceRTX",
    16: "TitanRTX",
}
MIG_ENABLED = 1
INVALID_INSTANCE_ID = 0xFFFFFFFF


@dataclass(frozen=True)
class GpuInfo:
    """One physical GPU as NVML sees it."""

    index: int
    minor: int
    uuid: str
    handle: Any = field(compare=False, repr=False)
    product: str = ""
    pci_bus_id: str = ""
    mig_enabled: bool = False


@dataclass(frozen=True)
class MigInfo:
    """One existing MIG device (a GPU instance with a compute instance)."""

    uuid: str
    handle: Any = field(compare=False, repr=False)
    gpu_instance_id: int
    compute_instance_id: int
    profile: str
    gi_profile_id: int
    placement_start: int
    placement_size: int


@dataclass(frozen=True)
class NvDevice:
    """A published device with what the backend needs to prepare, monitor and read it."""

    device: Device
    gpu: GpuInfo
    mig: MigInfo | None = None

    @property
    def name(self) -> str:
        return self.device.name

    @property
    def uuid(self) -> str:
        return self.mig.uuid if self.mig else self.gpu.uuid


@dataclass(frozen=True)
class Discovery:
    """The result of one discovery: GPUs seen and devices to publish."""

    gpus: tuple[GpuInfo, ...] = ()
    devices: tuple[NvDevice, ...] = ()
    lost: tuple[int, ...] = ()
    """Indices of the GPUs that answered GPU_IS_LOST (left out of `gpus` and `devices`)."""

    def by_name(self) -> dict[str, NvDevice]:
        return {d.name: d for d in self.devices}


class MigPartitioner(Protocol):
    """Decides how a GPU is published when dynamic MIG is on (`backends.nvidia.dynamicmig`)."""

    def gpu_devices(
        self, whole: NvDevice, total_memory: int, mig_mode: Any, static: list[NvDevice]
    ) -> list[NvDevice]:
        """The devices of one GPU, given it as a whole device and its static MIG devices."""
        ...


def normalize_bus_id(bus_id: str) -> str:
    """NVML's ``00000000:3B:00.0`` -> the Linux/Kubernetes form ``0000:3b:00.0``."""
    bus_id = bus_id.strip().lower()
    domain, sep, rest = bus_id.partition(":")
    if not sep or not rest:
        return bus_id
    try:
        return f"{int(domain, 16):04x}:{rest}"
    except ValueError:
        return bus_id


def pcie_root(sysfs_root: Path, bus_id: str) -> str | None:
    """``pci<domain>:<bus>`` of the root complex above `bus_id`, read from sysfs; None if unknown."""
    if not bus_id:
        return None
    link = sysfs_root / "bus" / "pci" / "devices" / bus_id
    try:
        resolved = link.resolve(strict=True)
    except OSError:
        return None
    for part in resolved.parts:
        if re.fullmatch(r"pci[0-9a-f]{4}:[0-9a-f]{2}", part):
            return part
    return None


def numa_node(sysfs_root: Path, bus_id: str) -> int | None:
    """The NUMA node of PCI device `bus_id` from sysfs (``numa_node``); None where the host reports
    none (-1 on a single-node machine, or no file)."""
    if not bus_id:
        return None
    try:
        value = int((sysfs_root / "bus" / "pci" / "devices" / bus_id / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None
    return value if value >= 0 else None


def mig_profile_name(
    gi_slices: int, ci_slices: int, memory_mib: int, total_memory_bytes: int, suffix: str = ""
) -> str:
    """NVIDIA's profile name (``3g.40gb``, ``1c.3g.40gb``) from slice counts and memory.

    The memory figure is rounded as NVIDIA does: to the next eighth of the GPU's memory, then to
    whole GB of the GPU's size in GiB.
    """
    fraction = memory_mib * MIB / total_memory_bytes if total_memory_bytes else 0.0
    fraction = math.ceil(fraction * 8) / 8
    total_gb = (total_memory_bytes + 1024**3 - 1) // 1024**3
    gb = math.floor(fraction * total_gb + 0.5)  # Go's math.Round (half away from zero), not round()
    base = f"{gi_slices}g.{gb}gb{suffix}"
    return base if ci_slices in (0, gi_slices) else f"{ci_slices}c.{base}"


# nvml.h:12525-12549: GPU instance profile index -> the suffix NVIDIA's name gives it (go-nvlib
# pkg/nvlib/device/mig_profile.go names by index: REV1 "+me", ALL_ME "+me.all", GFX "+gfx", NO_ME
# "-me"). The driver's own profile name is not parsed: "+me.all" contains "+me". 0x11 (3_SLICE_GFX,
# "gfx + media capable") is newer than go-nvlib's table: named "+gfx" after its nvml.h name.
PROFILE_SUFFIXES = {
    0x07: "+me",
    0x08: "+me",
    0x0A: "+gfx",
    0x0B: "+gfx",
    0x0C: "+gfx",
    0x0D: "-me",
    0x0E: "-me",
    0x0F: "+me.all",
    0x10: "+me.all",
    0x11: "+gfx",
}


def profile_suffix(profile_index: int) -> str:
    """The name suffix of GPU instance profile `profile_index` (``NVML_GPU_INSTANCE_PROFILE_*``)."""
    return PROFILE_SUFFIXES.get(profile_index, "")


def mig_device_name(minor: int, profile: str, gi_profile_id: int, placement_start: int) -> str:
    """``gpu-<minor>-mig-<profile without dots>-<giProfileId>-<placementStart>``."""
    compact = re.sub(r"[^a-z0-9]", "", profile.lower())
    return f"gpu-{minor}-mig-{compact}-{gi_profile_id}-{placement_start}"


def _version(what: str, raw: object) -> Version | None:
    try:
        return Version(normalize_version(str(raw)))
    except AgentError as error:
        log.warning("cannot use version", extra=log_fields(attribute=what, value=str(raw), error=str(error)))
        return None


@dataclass
class _System:
    driver_version: Version | None
    cuda_driver_version: Version | None


def _system(nvml: Nvml) -> _System:
    lib = nvml.lib
    driver = nvml.optional("nvmlSystemGetDriverVersion", lib.nvmlSystemGetDriverVersion)
    cuda = nvml.optional("nvmlSystemGetCudaDriverVersion", lib.nvmlSystemGetCudaDriverVersion)
    cuda_version = None
    if isinstance(cuda, int) and cuda > 0:
        # 12040 -> 12.4.0
        cuda_version = Version(f"{cuda // 1000}.{(cuda % 1000) // 10}.0")
    return _System(
        driver_version=_version("driverVersion", text(driver)) if driver else None,
        cuda_driver_version=cuda_version,
    )


def _common_attributes(
    nvml: Nvml, handle: Any, system: _System, sysfs_root: Path
) -> tuple[dict[str, AttributeValue], str, str]:
    """Attributes shared by a GPU and its MIG devices; also the product name and bus id."""
    lib = nvml.lib
    attrs: dict[str, AttributeValue] = {}
    product = text(nvml.optional("nvmlDeviceGetName", lib.nvmlDeviceGetName, handle) or "")
    if product:
        attrs["productName"] = product[:64]
    brand = nvml.optional("nvmlDeviceGetBrand", lib.nvmlDeviceGetBrand, handle)
    if brand is not None:
        attrs["brand"] = BRANDS.get(int(brand), "Unknown")
    cc = nvml.optional("nvmlDeviceGetCudaComputeCapability", lib.nvmlDeviceGetCudaComputeCapability, handle)
    if cc is not None:
        attrs["cudaComputeCapability"] = Version(f"{int(cc[0])}.{int(cc[1])}.0")
    arch = nvml.optional("nvmlDeviceGetArchitecture", lib.nvmlDeviceGetArchitecture, handle)
    arch_name = ARCHITECTURES.get(int(arch)) if arch is not None else None
    if arch_name is None and cc is not None:
        arch_name = ARCHITECTURE_BY_CC.get(int(cc[0]))
    if arch_name:
        attrs["architecture"] = arch_name
    if system.driver_version:
        attrs["driverVersion"] = system.driver_version
    if system.cuda_driver_version:
        attrs["cudaDriverVersion"] = system.cuda_driver_version
    bus_id = ""
    pci = nvml.optional("nvmlDeviceGetPciInfo", lib.nvmlDeviceGetPciInfo, handle)
    if pci is not None:
        bus_id = normalize_bus_id(text(pci.busId))
    if bus_id:
        attrs[PCI_BUS_ID] = bus_id
        # The name NVIDIA's driver used before the standard attribute; selectors still use it.
        attrs["pcieBusID"] = bus_id
        root = pcie_root(sysfs_root, bus_id)
        if root:
            attrs[PCIE_ROOT] = root
        numa = numa_node(sysfs_root, bus_id)
        if numa is not None:
            attrs[NUMA_NODE] = numa
    return attrs, product, bus_id


def discover_sync(
    nvml: Nvml, driver: str, sysfs_root: Path = Path("/sys"), partitioner: MigPartitioner | None = None
) -> Discovery:
    """Read every GPU and MIG device (blocking; run it in a worker thread).

    With a `partitioner` (dynamic MIG), it decides what each GPU publishes.
    """
    lib = nvml.lib
    system = _system(nvml)
    count = int(lib.nvmlDeviceGetCount())
    gpus: list[GpuInfo] = []
    devices: list[NvDevice] = []
    lost: list[int] = []
    for index in range(count):
        try:
            gpu, found = _discover_gpu(nvml, driver, index, system, sysfs_root, partitioner=partitioner)
        except Exception as error:
            if not nvml.is_error(error):
                raise
            # One unreadable GPU (lost, or an odd driver state) must not hide the others.
            log.error(
                "GPU left out of discovery",
                extra=log_fields(
                    index=index, error=str(error), lost=nvml.is_gpu_lost(error), hint="check 'nvidia-smi'"
                ),
            )
            if nvml.is_gpu_lost(error):
                lost.append(index)
            continue
        gpus.append(gpu)
        devices.extend(found)
    return Discovery(tuple(gpus), tuple(devices), tuple(lost))


def _discover_gpu(
    nvml: Nvml,
    driver: str,
    index: int,
    system: _System,
    sysfs_root: Path,
    *,
    partitioner: MigPartitioner | None = None,
) -> tuple[GpuInfo, list[NvDevice]]:
    lib = nvml.lib
    handle = lib.nvmlDeviceGetHandleByIndex(index)
    uuid = text(lib.nvmlDeviceGetUUID(handle))
    minor = int(lib.nvmlDeviceGetMinorNumber(handle))
    common, product, bus_id = _common_attributes(nvml, handle, system, sysfs_root)
    memory = nvml.optional("nvmlDeviceGetMemoryInfo", lib.nvmlDeviceGetMemoryInfo, handle)
    total_memory = int(memory.total) if memory is not None else 0
    mig_mode = nvml.optional("nvmlDeviceGetMigMode", lib.nvmlDeviceGetMigMode, handle)
    mig_enabled = mig_mode is not None and int(mig_mode[0]) == MIG_ENABLED
    gpu = GpuInfo(index, minor, uuid, handle, product, bus_id, mig_enabled)
    if partitioner is not None:
        static = _discover_migs(nvml, driver, gpu, common, total_memory) if mig_enabled else []
        whole = _whole_gpu(driver, gpu, common, total_memory)
        return gpu, partitioner.gpu_devices(whole, total_memory, mig_mode, static)
    if mig_enabled:
        migs = _discover_migs(nvml, driver, gpu, common, total_memory)
        if not migs:
            log.info(
                "MIG mode is on but no MIG devices exist: the GPU publishes nothing",
                extra=log_fields(gpu=uuid, hint="create MIG devices with nvidia-smi mig or the MIG manager"),
            )
        return gpu, migs
    return gpu, [_whole_gpu(driver, gpu, common, total_memory)]


def _whole_gpu(driver: str, gpu: GpuInfo, common: dict[str, AttributeValue], total_memory: int) -> NvDevice:
    attrs: dict[str, AttributeValue] = {
        "type": "gpu",
        "uuid": gpu.uuid,
        "index": gpu.index,
        "minor": gpu.minor,
        **common,
    }
    capacity = {"memory": Quantity.binary(total_memory)} if total_memory else {}
    device = Device(
        name=f"gpu-{gpu.minor}",
        driver=driver,
        attributes=attrs,
        capacity=capacity,
        uuid=gpu.uuid,
        pci_bus_id=gpu.pci_bus_id,
        product=gpu.product,
    )
    return NvDevice(device, gpu)


def _profile_infos(nvml: Nvml, handle: Any) -> dict[int, tuple[int, Any]]:
    """(profile index, GPU instance profile info) by profile ID (read-only queries)."""
    lib = nvml.lib
    infos: dict[int, tuple[int, Any]] = {}
    version = 2
    for profile in range(int(getattr(lib, "NVML_GPU_INSTANCE_PROFILE_COUNT", 0))):
        try:
            info = lib.nvmlDeviceGetGpuInstanceProfileInfo(handle, profile, version)
        except Exception as error:
            if version == 2 and isinstance(error, nvml.error_class("NVMLError_FunctionNotFound")):
                # A driver older than the V call: the v1 structure has no profile name.
                version = 1
                try:
                    info = lib.nvmlDeviceGetGpuInstanceProfileInfo(handle, profile, version)
                except Exception as retry:
                    if nvml.is_error(retry) and not nvml.is_gpu_lost(retry):
                        continue
                    raise
            elif nvml.is_error(error) and not nvml.is_gpu_lost(error):
                continue
            else:
                raise
        infos[int(info.id)] = (profile, info)
    return infos


def _discover_migs(
    nvml: Nvml, driver: str, gpu: GpuInfo, common: dict[str, AttributeValue], total_memory: int
) -> list[NvDevice]:
    lib = nvml.lib
    profiles = _profile_infos(nvml, gpu.handle)
    found: list[NvDevice] = []
    for slot in range(int(lib.nvmlDeviceGetMaxMigDeviceCount(gpu.handle))):
        try:
            mig_handle = lib.nvmlDeviceGetMigDeviceHandleByIndex(gpu.handle, slot)
        except Exception as error:
            if nvml.is_error(error) and not nvml.is_gpu_lost(error):
                continue  # an empty slot (NotFound)
            raise
        try:
            found.append(
                _mig_device(
                    nvml,
                    driver=driver,
                    gpu=gpu,
                    handle=mig_handle,
                    common=common,
                    total_memory=total_memory,
                    profiles=profiles,
                )
            )
        except Exception as error:
            if not isinstance(error, LookupError) and (not nvml.is_error(error) or nvml.is_gpu_lost(error)):
                raise
            log.warning(
                "MIG device left out of discovery",
                extra=log_fields(gpu=gpu.uuid, slot=slot, error=str(error)),
            )
    return _distinct_names(found)


def _distinct_names(found: list[NvDevice]) -> list[NvDevice]:
    """Name each MIG device distinctly: compute instances of one GPU instance share the name.

    NVIDIA's scheme names the GPU instance (profile, profile id, placement), so two compute
    instances with the same profile in one GPU instance collide; the inventory would keep only
    the last. The lowest compute instance keeps the name, the others get ``-ci<id>``.
    """
    by_name: dict[str, list[NvDevice]] = {}
    for nv in found:
        by_name.setdefault(nv.name, []).append(nv)
    out: list[NvDevice] = []
    for name, group in by_name.items():
        group.sort(key=lambda nv: nv.mig.compute_instance_id if nv.mig else 0)
        out.append(group[0])
        for nv in group[1:]:
            ci = nv.mig.compute_instance_id if nv.mig else 0
            renamed = replace(nv.device, name=f"{name}-ci{ci}")
            log.warning(
                "several compute instances of one GPU instance have the same device name; naming "
                "this one distinctly",
                extra=log_fields(device=name, renamed=renamed.name, mig=renamed.uuid, compute_instance=ci),
            )
            out.append(replace(nv, device=renamed))
    return out


def _mig_device(
    nvml: Nvml,
    *,
    driver: str,
    gpu: GpuInfo,
    handle: Any,
    common: dict[str, AttributeValue],
    total_memory: int,
    profiles: dict[int, tuple[int, Any]],
) -> NvDevice:
    lib = nvml.lib
    uuid = text(lib.nvmlDeviceGetUUID(handle))
    gi_id = int(lib.nvmlDeviceGetGpuInstanceId(handle))
    ci_id = int(lib.nvmlDeviceGetComputeInstanceId(handle))
    gi_info = lib.nvmlGpuInstanceGetInfo(lib.nvmlDeviceGetGpuInstanceById(gpu.handle, gi_id))
    profile_id = int(gi_info.profileId)
    start, size = int(gi_info.placement.start), int(gi_info.placement.size)
    found = profiles.get(profile_id)
    if found is None:
        raise LookupError(f"NVML lists no GPU instance profile {profile_id}")
    profile_index, profile_info = found
    attributes = nvml.optional("nvmlDeviceGetAttributes", lib.nvmlDeviceGetAttributes, handle)
    gi_slices = int(profile_info.sliceCount)
    ci_slices = int(attributes.computeInstanceSliceCount) if attributes is not None else gi_slices
    suffix = profile_suffix(profile_index)
    profile = mig_profile_name(gi_slices, ci_slices, int(profile_info.memorySizeMB), total_memory, suffix)
    name = mig_device_name(gpu.minor, profile, profile_id, start)
    mig = MigInfo(uuid, handle, gi_id, ci_id, profile, profile_id, start, size)
    attrs: dict[str, AttributeValue] = {
        "type": "mig",
        "uuid": uuid,
        "parentUUID": gpu.uuid,
        "index": gpu.index,
        "minor": gpu.minor,
        "profile": profile,
        "migProfile": profile,
        **common,
    }
    capacity = {
        "multiprocessors": Quantity.parse(int(profile_info.multiprocessorCount)),
        "copyEngines": Quantity.parse(int(profile_info.copyEngineCount)),
        "decoders": Quantity.parse(int(profile_info.decoderCount)),
        "encoders": Quantity.parse(int(profile_info.encoderCount)),
        "jpegEngines": Quantity.parse(int(profile_info.jpegCount)),
        "ofaEngines": Quantity.parse(int(profile_info.ofaCount)),
        # NVML's "MB" is MiB.
        "memory": Quantity.binary(int(profile_info.memorySizeMB) * MIB),
    }
    device = Device(
        name=name,
        driver=driver,
        attributes=attrs,
        capacity=capacity,
        uuid=uuid,
        pci_bus_id=gpu.pci_bus_id,
        product=gpu.product,
        parent=f"gpu-{gpu.minor}",
    )
    return NvDevice(device, gpu, mig)
