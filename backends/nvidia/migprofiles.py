"""MIG GPU-instance profiles and placements as shared counters (partitionable devices, KEP-4815).

A GPU in MIG mode is described by what NVML reports: each GPU-instance profile (slices, memory,
engines) and its possible placements (a start and a size in memory slices). From that:

- one `CounterSet` per GPU: ``memory-slice-<i>`` and ``compute-slice-<i>`` (1 each), plus the
  engines that limit which profiles fit together (``decoders``, ``encoders``, ``jpeg-engines``,
  ``ofa-engines``; the totals of the largest profile, left out when 0);
- the whole GPU as a device consuming every counter;
- every placement (profile x start) as a device consuming its memory slices
  ``[start, start + size)``, its compute slices ``[start, start + slices)`` and its engines.

Nothing is hard-coded per GPU model: `read_layout` asks NVML (blocking; run it in a worker
thread). The device names and attributes are those of the static MIG devices of `discovery`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any

from agent.core.model import AttributeValue, CounterConsumption, CounterSet, Device
from agent.core.quantity import Quantity
from backends.nvidia.discovery import MIB, GpuInfo, mig_device_name, mig_profile_name
from backends.nvidia.nvml import Nvml, text

ENGINES = (
    ("decoders", "decoders"),
    ("encoders", "encoders"),
    ("jpegs", "jpeg-engines"),
    ("ofas", "ofa-engines"),
)
"""`MigProfile` field -> counter name of the engines a GPU has a fixed number of."""
MAX_PLACEMENTS = 32


@dataclass(frozen=True)
class Placement:
    """Where a GPU instance can sit: memory slices ``[start, start + size)``."""

    start: int
    size: int


@dataclass(frozen=True)
class MigProfile:
    """One GPU-instance profile as NVML reports it, with its possible placements."""

    profile_id: int
    name: str
    """NVIDIA's profile name as the static MIG devices use it (``3g.40gb``, ``1g.10gb+me``)."""
    slices: int
    memory_mib: int
    multiprocessors: int = 0
    copy_engines: int = 0
    decoders: int = 0
    encoders: int = 0
    jpegs: int = 0
    ofas: int = 0
    placements: tuple[Placement, ...] = ()


@dataclass(frozen=True)
class MigLayout:
    """What one GPU can be partitioned into."""

    profiles: tuple[MigProfile, ...]
    memory_slices: int = field(init=False)
    compute_slices: int = field(init=False)

    def __post_init__(self) -> None:
        ends = [p.start + p.size for prof in self.profiles for p in prof.placements]
        object.__setattr__(self, "memory_slices", max(ends, default=0))
        object.__setattr__(self, "compute_slices", max((p.slices for p in self.profiles), default=0))

    def engine_totals(self) -> dict[str, int]:
        """Engines of the whole GPU: the most any one profile gets (the full profile's)."""
        totals = {
            counter: max((int(getattr(p, attr)) for p in self.profiles), default=0)
            for attr, counter in ENGINES
        }
        return {k: v for k, v in totals.items() if v > 0}

    def profile(self, profile_id: int) -> MigProfile:
        for p in self.profiles:
            if p.profile_id == profile_id:
                return p
        raise LookupError(f"no GPU instance profile {profile_id}")


def counter_set_name(minor: int) -> str:
    return f"gpu-{minor}-counters"


def gpu_counters(layout: MigLayout) -> dict[str, Quantity]:
    """Every counter of one GPU with its total."""
    counters = {f"memory-slice-{i}": Quantity.parse(1) for i in range(layout.memory_slices)}
    counters.update({f"compute-slice-{i}": Quantity.parse(1) for i in range(layout.compute_slices)})
    counters.update({k: Quantity.parse(v) for k, v in layout.engine_totals().items()})
    return counters


def placement_counters(layout: MigLayout, profile: MigProfile, placement: Placement) -> dict[str, Quantity]:
    """What a GPU instance of `profile` at `placement` takes from its GPU's counter set."""
    one = Quantity.parse(1)
    counters = {f"memory-slice-{i}": one for i in range(placement.start, placement.start + placement.size)}
    # Compute slices follow the memory start; a window running past the last slice is moved back.
    first = min(placement.start, layout.compute_slices - profile.slices)
    counters.update({f"compute-slice-{i}": one for i in range(max(first, 0), max(first, 0) + profile.slices)})
    for attr, counter in ENGINES:
        if int(getattr(profile, attr)) > 0:
            counters[counter] = Quantity.parse(int(getattr(profile, attr)))
    return counters


@dataclass(frozen=True)
class PlacementDevice:
    """A published placement: which GPU, profile and start a device name stands for."""

    name: str
    gpu_uuid: str
    minor: int
    profile: MigProfile
    placement: Placement


def dynamic_devices(
    whole: Device, gpu_uuid: str, minor: int, index: int, layout: MigLayout
) -> tuple[Device, list[tuple[Device, PlacementDevice]]]:
    """The whole GPU (with the counter set) and one device per placement.

    `whole` is the GPU as it would be published without MIG; its attributes (product,
    architecture, driver, PCI...) are shared by the placements, as for static MIG devices.
    """
    set_name = counter_set_name(minor)
    totals = gpu_counters(layout)
    gpu_device = replace(
        whole,
        consumes_counters=(CounterConsumption(set_name, totals),),
        counter_sets=(CounterSet(set_name, totals),),
    )
    common = {k: v for k, v in whole.attributes.items() if k not in ("type", "uuid", "index", "minor")}
    placements: list[tuple[Device, PlacementDevice]] = []
    for profile in layout.profiles:
        for placement in profile.placements:
            name = mig_device_name(minor, profile.name, profile.profile_id, placement.start)
            attrs: dict[str, AttributeValue] = {
                "type": "mig",
                "parentUUID": gpu_uuid,
                "index": index,
                "minor": minor,
                "profile": profile.name,
                "migProfile": profile.name,
                **common,
            }
            device = Device(
                name=name,
                driver=whole.driver,
                attributes=attrs,
                capacity=mig_capacity(profile),
                pci_bus_id=whole.pci_bus_id,
                product=whole.product,
                parent=whole.name,
                consumes_counters=(
                    CounterConsumption(set_name, placement_counters(layout, profile, placement)),
                ),
            )
            placements.append((device, PlacementDevice(name, gpu_uuid, minor, profile, placement)))
    return gpu_device, placements


def mig_capacity(profile: MigProfile) -> dict[str, Quantity]:
    """The capacities of a MIG device, as the static MIG devices publish them."""
    return {
        "multiprocessors": Quantity.parse(profile.multiprocessors),
        "copyEngines": Quantity.parse(profile.copy_engines),
        "decoders": Quantity.parse(profile.decoders),
        "encoders": Quantity.parse(profile.encoders),
        "jpegEngines": Quantity.parse(profile.jpegs),
        "ofaEngines": Quantity.parse(profile.ofas),
        "memory": Quantity.binary(profile.memory_mib * MIB),
    }


def taken_counters(
    layout: MigLayout, instances: Iterable[tuple[MigProfile, Placement]]
) -> dict[str, Quantity]:
    """The counters that existing GPU instances hold, summed."""
    taken: dict[str, Fraction] = {}
    for profile, placement in instances:
        for key, value in placement_counters(layout, profile, placement).items():
            taken[key] = taken.get(key, Fraction(0)) + value.value
    return {k: Quantity(v, "DecimalSI") for k, v in taken.items()}


def fits(layout: MigLayout, taken: Mapping[str, Quantity], profile: MigProfile, placement: Placement) -> bool:
    """Whether `placement` fits next to the counters already `taken` (the scheduler's arithmetic)."""
    totals = gpu_counters(layout)
    for key, value in placement_counters(layout, profile, placement).items():
        used = taken.get(key)
        if (used.value if used else 0) + value.value > totals[key].value:
            return False
    return True


# -- reading the layout from NVML (blocking) ----------------------------------------------------


def read_layout(nvml: Nvml, gpu: GpuInfo, total_memory: int) -> MigLayout:
    """Profiles and placements of `gpu` from NVML; a profile NVML refuses is left out."""
    lib = nvml.lib
    profiles: list[MigProfile] = []
    for index in range(int(getattr(lib, "NVML_GPU_INSTANCE_PROFILE_COUNT", 0))):
        try:
            info = lib.nvmlDeviceGetGpuInstanceProfileInfoV(gpu.handle, index)
        except Exception as error:
            if nvml.is_error(error) and not nvml.is_gpu_lost(error):
                continue  # this GPU has no such profile (NOT_SUPPORTED / INVALID_ARGUMENT)
            raise
        placements = _placements(nvml, gpu.handle, int(info.id))
        if not placements:
            continue
        slices = int(info.sliceCount)
        suffix = "+me" if "+me" in text(getattr(info, "name", b"") or b"") else ""
        profiles.append(
            MigProfile(
                profile_id=int(info.id),
                name=mig_profile_name(slices, slices, int(info.memorySizeMB), total_memory, suffix),
                slices=slices,
                memory_mib=int(info.memorySizeMB),
                multiprocessors=int(info.multiprocessorCount),
                copy_engines=int(info.copyEngineCount),
                decoders=int(info.decoderCount),
                encoders=int(info.encoderCount),
                jpegs=int(info.jpegCount),
                ofas=int(info.ofaCount),
                placements=placements,
            )
        )
    return MigLayout(tuple(profiles))


def _placements(nvml: Nvml, handle: Any, profile_id: int) -> tuple[Placement, ...]:
    lib = nvml.lib
    array = (lib.c_nvmlGpuInstancePlacement_t * MAX_PLACEMENTS)()
    count = ctypes.c_uint(MAX_PLACEMENTS)
    try:
        lib.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, array, ctypes.byref(count))
    except Exception as error:
        if nvml.is_error(error) and not nvml.is_gpu_lost(error):
            return ()
        raise
    return tuple(
        Placement(int(array[i].start), int(array[i].size)) for i in range(min(count.value, MAX_PLACEMENTS))
    )
