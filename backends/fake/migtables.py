"""What NVML reports for the MIG profiles of A100-40GB, A100-80GB and H100-80GB.

From NVIDIA's MIG user guide ("Supported MIG Profiles": slices, memory, engines, placements).
The fake backend's ``dynamic-mig=true`` and the tests' stand-in libnvidia-ml both read these
tables, so the two describe the same hardware. Keys are NVML's GPU-instance profile *index*
(``NVML_GPU_INSTANCE_PROFILE_1_SLICE`` = 0, ``..._2_SLICE`` = 1, ``..._3_SLICE`` = 2,
``..._4_SLICE`` = 3, ``..._7_SLICE`` = 4, ``..._1_SLICE_REV1`` (+me) = 7, ``..._1_SLICE_REV2`` = 9).
"""

from __future__ import annotations

from collections.abc import Mapping

from backends.nvidia.migprofiles import MigLayout, MigProfile, Placement


def _at(size: int, *starts: int) -> tuple[Placement, ...]:
    return tuple(Placement(s, size) for s in starts)


ONE_SLICE = _at(1, 0, 1, 2, 3, 4, 5, 6)

A100_80GB: Mapping[int, MigProfile] = {
    0: MigProfile(19, "1g.10gb", 1, 9728, 14, 1, 0, 0, 0, 0, ONE_SLICE),
    7: MigProfile(20, "1g.10gb+me", 1, 9728, 14, 1, 1, 0, 1, 1, ONE_SLICE),
    9: MigProfile(15, "1g.20gb", 1, 19968, 14, 1, 1, 0, 0, 0, _at(2, 0, 2, 4, 6)),
    1: MigProfile(14, "2g.20gb", 2, 19968, 28, 2, 1, 0, 0, 0, _at(2, 0, 2, 4)),
    2: MigProfile(9, "3g.40gb", 3, 40192, 42, 3, 2, 0, 0, 0, _at(4, 0, 4)),
    3: MigProfile(5, "4g.40gb", 4, 40192, 56, 4, 2, 0, 0, 0, _at(4, 0)),
    4: MigProfile(0, "7g.80gb", 7, 80896, 98, 7, 5, 0, 1, 1, _at(8, 0)),
}

A100_40GB: Mapping[int, MigProfile] = {
    0: MigProfile(19, "1g.5gb", 1, 4864, 14, 1, 0, 0, 0, 0, ONE_SLICE),
    7: MigProfile(20, "1g.5gb+me", 1, 4864, 14, 1, 1, 0, 1, 1, ONE_SLICE),
    9: MigProfile(15, "1g.10gb", 1, 9856, 14, 1, 1, 0, 0, 0, _at(2, 0, 2, 4, 6)),
    1: MigProfile(14, "2g.10gb", 2, 9856, 28, 2, 1, 0, 0, 0, _at(2, 0, 2, 4)),
    2: MigProfile(9, "3g.20gb", 3, 19968, 42, 3, 2, 0, 0, 0, _at(4, 0, 4)),
    3: MigProfile(5, "4g.20gb", 4, 19968, 56, 4, 2, 0, 0, 0, _at(4, 0)),
    4: MigProfile(0, "7g.40gb", 7, 40192, 98, 7, 5, 0, 1, 1, _at(8, 0)),
}

H100_80GB: Mapping[int, MigProfile] = {
    0: MigProfile(19, "1g.10gb", 1, 9856, 16, 1, 1, 0, 1, 0, ONE_SLICE),
    7: MigProfile(20, "1g.10gb+me", 1, 9856, 16, 1, 1, 0, 1, 1, ONE_SLICE),
    9: MigProfile(15, "1g.20gb", 1, 19968, 26, 1, 1, 0, 1, 0, _at(2, 0, 2, 4, 6)),
    1: MigProfile(14, "2g.20gb", 2, 19968, 32, 2, 2, 0, 2, 0, _at(2, 0, 2, 4)),
    2: MigProfile(9, "3g.40gb", 3, 40192, 60, 3, 3, 0, 3, 0, _at(4, 0, 4)),
    3: MigProfile(5, "4g.40gb", 4, 40192, 64, 4, 4, 0, 4, 0, _at(4, 0)),
    4: MigProfile(0, "7g.80gb", 7, 80384, 132, 8, 7, 0, 7, 1, _at(8, 0)),
}

BY_PRODUCT: Mapping[str, Mapping[int, MigProfile]] = {
    "NVIDIA A100-SXM4-80GB": A100_80GB,
    "NVIDIA A100-SXM4-40GB": A100_40GB,
    "NVIDIA H100 80GB HBM3": H100_80GB,
}


def layout_for(product: str) -> MigLayout | None:
    """The MIG layout of a product name, or None when it cannot do MIG (or is not in the tables)."""
    table = BY_PRODUCT.get(product)
    return MigLayout(tuple(table.values())) if table is not None else None
