"""The GPUs behind the stand-in libnvidia-ml: their state, MIG profiles, and ready-made products.

Fixtures: `a100_mig` (A100-SXM4-80GB with MIG devices), `a100_full_mig` (one 7g.80gb), `h100`
(H100 80GB HBM3, MIG off), `l4` (no MIG), `t4` (retired pages, no row remapping), `l40s`
(neither), `b200_mig` (Blackwell profiles with NVIDIA's newer names: ``+me.all``, ``-me``,
``+gfx``), `dynamic_gpu` (a GPU in MIG mode with no MIG device, for dynamic MIG) and `as_mock`
(a GPU answering as NVIDIA's mock NVML does).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# nvml.h: nvmlEventType* bits, brands, architectures, recovery actions.
SINGLE_BIT_ECC = 0x1
DOUBLE_BIT_ECC = 0x2
PSTATE = 0x4
XID_CRITICAL = 0x8
ALL_HEALTH_EVENTS = XID_CRITICAL | DOUBLE_BIT_ECC | SINGLE_BIT_ECC
ANY_ID = 0xFFFFFFFF
"""nvml.h:3249-3251: an event's GPU/compute instance ID when it concerns no instance."""
MIB = 1024 * 1024
BRAND_TESLA, BRAND_NVIDIA = 2, 14
ARCH_TURING, ARCH_AMPERE, ARCH_ADA, ARCH_HOPPER, ARCH_BLACKWELL = 6, 7, 8, 9, 10
RECOVERY_ACTION_NONE = 0

# nvml.h:12517-12550: GPU instance profile indices (the `profile` argument of the profile calls).
PROFILE_1_SLICE, PROFILE_2_SLICE, PROFILE_3_SLICE, PROFILE_4_SLICE, PROFILE_7_SLICE = 0, 1, 2, 3, 4
PROFILE_1_SLICE_REV1, PROFILE_1_SLICE_REV2 = 0x7, 0x9
PROFILE_1_SLICE_GFX, PROFILE_1_SLICE_NO_ME, PROFILE_1_SLICE_ALL_ME = 0x0A, 0x0D, 0x0F
PROFILE_2_SLICE_ALL_ME, PROFILE_3_SLICE_GFX = 0x10, 0x11
PROFILE_COUNT = 0x12


@dataclass
class GiProfile:
    """One GPU instance profile (what ``nvmlDeviceGetGpuInstanceProfileInfoV`` returns at `index`)."""

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


NO_CI = -1
"""`FakeMig.ci_id` of a GPU instance without a compute instance (no MIG device handle yet)."""


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
    brand: int = BRAND_NVIDIA
    memory_used: int = 0
    mig_mode: tuple[int, int] | None = (0, 0)
    profiles: list[GiProfile] = field(default_factory=list)
    migs: list[FakeMig] = field(default_factory=list)
    max_migs: int = 7
    supported_events: int = ALL_HEALTH_EVENTS | PSTATE
    utilization: int = 0
    temperature: int = 35
    power_mw: int = 60_000
    ecc_corrected: int = 0
    ecc_uncorrected: int = 0
    recovery_action: int | None = RECOVERY_ACTION_NONE
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
    still_answers: frozenset[str] = frozenset()
    """C functions a lost GPU still answers (static identity such as nvmlDeviceGetUUID may)."""
    failures: dict[str, int] = field(default_factory=dict)
    """C symbol -> error code it returns for this GPU."""


A100_PROFILES = [
    GiProfile(PROFILE_1_SLICE, 19, 1, 7, 14, 1, 0, 0, 0, 0, 9728, "MIG 1g.10gb"),
    GiProfile(PROFILE_2_SLICE, 14, 2, 3, 28, 2, 1, 0, 0, 0, 19968, "MIG 2g.20gb"),
    GiProfile(PROFILE_3_SLICE, 9, 3, 2, 42, 3, 2, 0, 0, 0, 40192, "MIG 3g.40gb"),
    GiProfile(PROFILE_4_SLICE, 5, 4, 1, 56, 4, 2, 0, 0, 0, 40192, "MIG 4g.40gb"),
    GiProfile(PROFILE_7_SLICE, 0, 7, 1, 98, 7, 5, 0, 1, 1, 80896, "MIG 7g.80gb"),
    GiProfile(PROFILE_1_SLICE_REV1, 20, 1, 1, 14, 1, 1, 0, 1, 1, 9728, "MIG 1g.10gb+me"),
    GiProfile(PROFILE_1_SLICE_REV2, 15, 1, 4, 14, 1, 1, 0, 0, 0, 19968, "MIG 1g.20gb"),
]

# Blackwell-generation profiles at the indices nvml.h:12531-12549 adds. The IDs past 20 are this
# stand-in's (only their distinctness matters); the names are what the driver reports, whose
# suffixes the agent must not read: NVIDIA names a profile by its index (go-nvlib mig_profile.go).
B200_PROFILES = [
    GiProfile(PROFILE_1_SLICE, 19, 1, 7, 18, 1, 1, 0, 1, 0, 22784, "MIG 1g.23gb"),
    GiProfile(PROFILE_7_SLICE, 0, 7, 1, 148, 7, 7, 0, 7, 1, 182272, "MIG 7g.180gb"),
    GiProfile(PROFILE_1_SLICE_REV1, 20, 1, 1, 18, 1, 1, 0, 1, 1, 22784, "MIG 1g.23gb+me"),
    GiProfile(PROFILE_1_SLICE_GFX, 47, 1, 7, 18, 1, 1, 0, 1, 0, 22784, "MIG 1g.23gb+gfx"),
    GiProfile(PROFILE_1_SLICE_NO_ME, 44, 1, 7, 18, 1, 0, 0, 0, 0, 22784, "MIG 1g.23gb-me"),
    GiProfile(PROFILE_1_SLICE_ALL_ME, 45, 1, 1, 18, 1, 7, 0, 7, 1, 22784, "MIG 1g.23gb+me.all"),
    GiProfile(PROFILE_2_SLICE_ALL_ME, 46, 2, 1, 36, 2, 7, 0, 7, 1, 45568, "MIG 2g.45gb+me.all"),
    GiProfile(PROFILE_3_SLICE_GFX, 48, 3, 2, 54, 3, 3, 0, 3, 0, 90112, "MIG 3g.90gb+gfx"),
]


def a100_mig(minor: int = 0, bus: str = "00000000:07:00.0") -> FakeGpu:
    """A100-SXM4-80GB in MIG mode with 3g.40gb, 2g.20gb and two 1g.10gb devices."""
    return FakeGpu(
        name="NVIDIA A100-SXM4-80GB",
        uuid=f"GPU-a100{minor:04d}-0000-0000-0000-000000000000",
        minor=minor,
        bus_id=bus,
        architecture=ARCH_AMPERE,
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


def b200_mig(minor: int = 6, bus: str = "00000000:9a:00.0") -> FakeGpu:
    """B200 in MIG mode with one MIG device of each newer profile (+me, +gfx, -me, +me.all).

    The layout is a listing, not a valid placement plan (static discovery does not check it)."""
    return FakeGpu(
        name="NVIDIA B200",
        uuid=f"GPU-b200{minor:04d}-0000-0000-0000-000000000000",
        minor=minor,
        bus_id=bus,
        architecture=ARCH_BLACKWELL,
        cc=(10, 0),
        memory_total=183359 * MIB,
        mig_mode=(1, 1),
        profiles=list(B200_PROFILES),
        migs=[
            FakeMig(f"MIG-b200{minor:04d}-0001-0000-0000-000000000000", 1, 0, 20, 0, 1),
            FakeMig(f"MIG-b200{minor:04d}-0002-0000-0000-000000000000", 2, 0, 47, 1, 1),
            FakeMig(f"MIG-b200{minor:04d}-0003-0000-0000-000000000000", 3, 0, 44, 2, 1),
            FakeMig(f"MIG-b200{minor:04d}-0004-0000-0000-000000000000", 4, 0, 45, 3, 1),
            FakeMig(f"MIG-b200{minor:04d}-0005-0000-0000-000000000000", 5, 0, 46, 4, 2),
            # Profile index 0x11: read only by a pynvml whose NVML_GPU_INSTANCE_PROFILE_COUNT is 0x12.
            FakeMig(f"MIG-b200{minor:04d}-0006-0000-0000-000000000000", 6, 0, 48, 6, 1),
        ],
    )


def h100(minor: int = 2, bus: str = "00000000:18:00.0") -> FakeGpu:
    """H100 80GB HBM3, MIG capable but off."""
    return FakeGpu(
        name="NVIDIA H100 80GB HBM3",
        uuid=f"GPU-h100{minor:04d}-0000-0000-0000-000000000000",
        minor=minor,
        bus_id=bus,
        architecture=ARCH_HOPPER,
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
        architecture=ARCH_ADA,
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
        architecture=ARCH_TURING,
        cc=(7, 5),
        memory_total=15360 * MIB,
        brand=BRAND_TESLA,
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
        architecture=ARCH_ADA,
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


def dynamic_gpu(product: str, minor: int, bus: str | None = None) -> FakeGpu:
    """A GPU of `product` (a `migtables.BY_PRODUCT` key) in MIG mode with no MIG device."""
    from backends.fake import migtables

    table = migtables.BY_PRODUCT[product]
    is_h100 = "H100" in product
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
        uuid=f"GPU-d{minor:03d}{'h100' if is_h100 else 'a100'}-0000-0000-0000-000000000000",
        minor=minor,
        bus_id=bus or f"00000000:{0x10 + minor:02x}:00.0",
        architecture=ARCH_HOPPER if is_h100 else ARCH_AMPERE,
        cc=(9, 0) if is_h100 else (8, 0),
        memory_total=memory * MIB,
        mig_mode=(1, 1),
        profiles=profiles,
    )
