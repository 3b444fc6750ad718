"""MIG GPU-instance profiles and placements as shared counters (partitionable devices, KEP-4815).

A GPU in MIG mode is described by what NVML reports: each GPU-instance profile (slices, memory,
engines) and its possible placements (a start and a size in memory slices). From that:

- one `CounterSet` per GPU: ``memory-slice-<i>`` and ``compute-slice-<i>`` (1 each), plus the
  engines that limit which profiles fit together (``decoders``, ``encoders``, ``jpeg-engines``,
  ``ofa-engines``; the totals of the largest profile, left out when 0);
- the whole GPU as a device consuming every counter;
- every placement (profile x start) as a device consuming its memory slices
  ``[start, start + size)``, its compute slices ``[start, start + slices)`` and its engines.

The placements are listed in `packing_order`: the scheduler takes the first device that fits, in
slice order, so that order decides how MIG devices pack (see there).

Nothing is hard-coded per GPU model: `read_layout` asks NVML (blocking; run it in a worker
thread). The device names and attributes are those of the static MIG devices of `discovery`.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any

from agent.core.model import AttributeValue, CounterConsumption, CounterSet, Device
from agent.core.quantity import Quantity
from backends.nvidia.discovery import MIB, GpuInfo, mig_device_name, mig_profile_name, profile_suffix
from backends.nvidia.nvml import Nvml

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
    """The whole GPU (with the counter set) and one device per placement, in `packing_order`.

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
    for profile, placement in packing_order(layout):
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
            consumes_counters=(CounterConsumption(set_name, placement_counters(layout, profile, placement)),),
        )
        placements.append((device, PlacementDevice(name, gpu_uuid, minor, profile, placement)))
    return gpu_device, placements


def profile_size(layout: MigLayout, profile: MigProfile) -> tuple[int, int, Fraction, int, str]:
    """How much of a GPU one GPU instance of `profile` takes, to sort profiles smallest first.

    Compute slices, then memory slices, then the share of the GPU's engines (``1g.10gb`` before
    ``1g.10gb+me``, which takes the only OFA engine), memory and the name as the last ties.
    """
    size = max((p.size for p in profile.placements), default=0)
    totals = layout.engine_totals()
    engines = sum(
        (
            Fraction(int(getattr(profile, attr)), totals[counter])
            for attr, counter in ENGINES
            if counter in totals
        ),
        Fraction(0),
    )
    return profile.slices, size, engines, profile.memory_mib, profile.name


@functools.lru_cache(maxsize=32)
def packing_order(layout: MigLayout) -> tuple[tuple[MigProfile, Placement], ...]:
    """Every placement of `layout` in the order to publish them, so that first fit packs well.

    The scheduler's allocator (``staging/src/k8s.io/dynamic-resource-allocation/structured/
    internal/*/allocator_*.go``, ``allocateOne``) walks pools, then the pool's slices in the order
    it got them, then each slice's devices in order, and takes the first device that is free,
    matches the request and whose counters all fit. Claims arrive one at a time, so this order
    is the packing policy:

    - profiles smallest first (`profile_size`): a claim any MIG device satisfies ("any MIG", or
      "at least 10Gi") gets the smallest placement that fits;
    - each profile's placements keep the larger profiles' placements free, larger profiles
      ordered first. A profile is larger when its GPU instance takes more compute slices, or as
      many and more memory slices (``1g.10gb+me`` is not larger than ``1g.10gb``: same slots). For
      each larger profile with several placements, from the largest down, a placement is worse
      the more preferred the best placement of that profile it blocks (blocking none is best):
      the larger profile goes to its first choice, so the smaller ones fill around it. Then the
      number of single-placement larger profiles it blocks (``4g``, ``7g``), then the start.

    On an A100-80GB or H100-80GB: ``3g.40gb`` at 4 then 0 (4 leaves ``4g.40gb`` free);
    ``2g.20gb`` at 0, 2, then 4 (leaving the ``3g.40gb`` at 4); ``1g.10gb`` at 2, 3, 0, 1, 6, 4,
    5. No fixed order fits every arrival order of every valid layout (a first ``2g.20gb`` must be
    at 4 for ``2g``, ``4g``, ``1g`` and must not be for ``2g``, ``2g``, ``3g``). Of the 65 arrival
    orders of the 19 maximal layouts of ``1g.10gb``, ``2g.20gb``, ``3g.40gb``, ``4g.40gb`` and
    ``7g.80gb`` there, this order fits 55, as many as the best of every order of those placements
    (the names' reverse order fitted 50); what it gives up is a ``4g.40gb`` arriving after a
    smaller profile, which keeps the ``3g.40gb`` at 4 free instead.
    """
    totals = gpu_counters(layout)
    needs = {
        (profile.profile_id, placement): placement_counters(layout, profile, placement)
        for profile in layout.profiles
        for placement in profile.placements
    }

    def blocks(mine: tuple[int, Placement], profile: MigProfile, placement: Placement) -> bool:
        first, second = needs[mine], needs[(profile.profile_id, placement)]
        return any(v.value + second[k].value > totals[k].value for k, v in first.items() if k in second)

    profiles = sorted((p for p in layout.profiles if p.placements), key=lambda p: profile_size(layout, p))
    orders: dict[int, tuple[Placement, ...]] = {}
    for index in reversed(range(len(profiles))):  # the largest first: the smaller ones follow them
        profile = profiles[index]
        slots = profile_size(layout, profile)[:2]
        larger = [q for q in reversed(profiles[index + 1 :]) if profile_size(layout, q)[:2] > slots]
        keys: dict[Placement, tuple[int, ...]] = {}
        for placement in profile.placements:
            mine = (profile.profile_id, placement)
            steer = [
                -min(
                    (rank for rank, p in enumerate(orders[q.profile_id]) if blocks(mine, q, p)),
                    default=len(q.placements),
                )
                for q in larger
                if len(q.placements) > 1
            ]
            single = sum(blocks(mine, q, q.placements[0]) for q in larger if len(q.placements) == 1)
            keys[placement] = (*steer, single, placement.start)
        orders[profile.profile_id] = tuple(sorted(profile.placements, key=keys.__getitem__))
    return tuple((profile, placement) for profile in profiles for placement in orders[profile.profile_id])


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
        suffix = profile_suffix(index)
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
