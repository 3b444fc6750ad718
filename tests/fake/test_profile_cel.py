"""The shipped profiles are selected by the CEL expressions the public DRA guides use."""

from __future__ import annotations

import pytest

from agent.core.cel import match_attribute, matches
from agent.core.model import Device
from backends.fake.profile import load_profile

MIG = "device.attributes['gpu.nvidia.com'].type == 'mig'"


def devices(profile: str) -> list[Device]:
    return [d for drv in load_profile(profile).drivers for d in drv.devices]


@pytest.mark.parametrize(
    ("expression", "count"),
    [
        ("device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'", 6),
        ("device.attributes['gpu.nvidia.com'].type == 'mig'", 6),
        ("device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0", 6),
        ("device.attributes['gpu.nvidia.com'].architecture in ['Ampere', 'Hopper', 'Blackwell']", 12),
        ("device.attributes['gpu.nvidia.com'].cudaComputeCapability.isGreaterThan(semver('7.5.0'))", 12),
        ("device.attributes['gpu.nvidia.com'].productName == 'NVIDIA A100-SXM4-80GB'", 12),
        # An unknown attribute aborts evaluation, as in Kubernetes: select MIG devices first.
        (MIG + " && device.attributes['gpu.nvidia.com'].profile == '3g.40gb'", 3),
        (MIG + " && device.attributes['gpu.nvidia.com'].migProfile == '1g.10gb'", 2),
    ],
)
def test_nvidia_selectors(expression: str, count: int) -> None:
    assert sum(matches(expression, d) for d in devices("nvidia-a100-8x")) == count


def test_nvidia_pcie_root_pairs() -> None:
    gpus = {d.name: d for d in devices("nvidia-a100-8x")}
    assert match_attribute("resource.kubernetes.io/pcieRoot", [gpus["gpu-0"], gpus["gpu-1"]])
    assert not match_attribute("resource.kubernetes.io/pcieRoot", [gpus["gpu-0"], gpus["gpu-2"]])


def test_amd_selectors() -> None:
    spx = devices("amd-mi300x-8x")
    seed = (
        'device.attributes["gpu.amd.com"].productName == "AMD_Instinct_MI300X_OAM" && '
        'device.attributes["gpu.amd.com"].partitionProfile == "spx_nps1"'
    )
    assert all(matches(seed, d) for d in spx)
    cpx = devices("amd-mi300x-8x-cpx")
    partition = 'device.attributes["gpu.amd.com"].type == "amdgpu-partition"'
    assert all(matches(partition, d) for d in cpx)
    assert not any(matches(seed, d) for d in cpx)
    # matchAttribute gpu.amd.com/deviceID puts two partitions on one GPU.
    assert match_attribute("gpu.amd.com/deviceID", cpx[0:2])
    assert not match_attribute("gpu.amd.com/deviceID", [cpx[0], cpx[8]])


def test_mixed_profile_two_drivers() -> None:
    mixed = devices("mixed")
    assert sum(matches("device.driver == 'gpu.nvidia.com'", d) for d in mixed) == 4
    assert sum(matches("device.driver == 'gpu.amd.com'", d) for d in mixed) == 4
