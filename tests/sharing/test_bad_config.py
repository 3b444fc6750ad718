"""Bad sharing configuration: a per-claim error naming claim, field and accepted values; nothing applied.

NVIDIA's format and its strict decoding follow ``api/nvidia.com/resource/v1beta1/sharing.go`` of
NVIDIA's DRA driver; unknown request names in a config are refused as the API server's
``validateDeviceConfiguration`` (``K/pkg/apis/resource/validation/validation.go``) does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agent.core.backend import ClaimRef
from agent.core.sharing import DeviceConfigError, DeviceShare, OpaqueConfig
from backends.fake.sharing import FakeGpuPolicy, FakeMpsProgram
from backends.nvidia.mps import MpsDaemons, NoMounter
from backends.nvidia.sharing import DeviceFacts, NvSharingManager
from tests.kubelet.fakes import FakeClaimSource
from tests.sharing.helpers import (
    NVIDIA,
    claim,
    daemon_state,
    device_state,
    fake_backend,
    gpu_config,
    intervals,
    ref,
    uid,
)

MPS_CONFIG = {"strategy": "MPS"}

BAD: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
    (
        "apiVersion",
        {**gpu_config(), "apiVersion": "resource.nvidia.com/v1alpha1"},
        ("apiVersion", "resource.nvidia.com/v1beta1"),
    ),
    ("kind", {**gpu_config(), "kind": "GpuClaimParameters"}, ("kind", "GpuConfig or MigDeviceConfig")),
    (
        "unknown field",
        {**gpu_config(), "mode": "shared"},
        ("field mode", "only the fields apiVersion, kind, sharing"),
    ),
    ("strategy", gpu_config({"strategy": "Shared"}), ("sharing.strategy", "TimeSlicing or MPS")),
    (
        "interval",
        gpu_config({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Fast"}}),
        ("interval", "Default | Short | Medium | Long"),
    ),
    (
        "percentage 0",
        gpu_config({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 0}}),
        ("defaultActiveThreadPercentage", "1 to 100"),
    ),
    (
        "percentage 101",
        gpu_config({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 101}}),
        ("1 to 100",),
    ),
    (
        "percentage text",
        gpu_config({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": "50"}}),
        ("1 to 100",),
    ),
    (
        "quantity",
        gpu_config({"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "lots"}}),
        ("defaultPinnedDeviceMemoryLimit", "a quantity such as 4Gi"),
    ),
    (
        "tiny quantity",
        gpu_config({"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "512Ki"}}),
        ("at least 1Mi",),
    ),
    (
        "per-device key",
        gpu_config({"strategy": "MPS", "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {"3": "1Gi"}}}),
        ("key", "0 or the device's UUID"),
    ),
    (
        "mps fields with time-slicing",
        gpu_config({"strategy": "TimeSlicing", "mpsConfig": {}}),
        ("sharing.mpsConfig", "no mpsConfig with TimeSlicing"),
    ),
    (
        "MIG config on a GPU",
        gpu_config(MPS_CONFIG, kind="MigDeviceConfig"),
        ("kind", "GpuConfig for device 'gpu-0'"),
    ),
]


@pytest.mark.parametrize(("config", "expected"), [(c, e) for _, c, e in BAD], ids=[n for n, _, _ in BAD])
async def test_bad_nvidia_config_fails_the_claim_and_applies_nothing(
    tmp_path: Path, config: dict[str, Any], expected: tuple[str, ...]
) -> None:
    bad = claim(1, config=config)
    state = device_state(tmp_path, FakeClaimSource([bad]), fake_backend(tmp_path))
    await state.start()
    error = (await state.prepare([ref(bad)]))[uid(1)].error
    assert "claim default/claim-1" in error
    assert "status.allocation.devices.config[0] (from the claim)" in error
    for part in expected:
        assert part in error
    assert state.store.entries() == {}
    assert not (tmp_path / "cdi" / f"k8s.{NVIDIA}-claim_{uid(1)}.yaml").exists()
    assert daemon_state(tmp_path) is None and intervals(tmp_path) == {}


async def test_config_for_a_request_the_claim_does_not_have(tmp_path: Path) -> None:
    bad = claim(1, config=gpu_config(MPS_CONFIG), config_requests=["gpus"])
    state = device_state(tmp_path, FakeClaimSource([bad]), fake_backend(tmp_path))
    await state.start()
    error = (await state.prepare([ref(bad)]))[uid(1)].error
    assert "'gpus', which is not a request of the claim (its requests: gpu)" in error


async def test_negative_consumed_capacity_is_refused(tmp_path: Path) -> None:
    """The API server lets ``memory: -1Gi`` through (dra-1.36-verified-shapes.md): the driver refuses it."""
    bad = claim(1, share_id="11111111-0000-4000-8000-000000000001", memory="-1Gi")
    state = device_state(tmp_path, FakeClaimSource([bad]), fake_backend(tmp_path))
    await state.start()
    assert "negative quantity" in (await state.prepare([ref(bad)]))[uid(1)].error


async def test_mps_on_a_gpu_that_cannot(tmp_path: Path) -> None:
    manager = NvSharingManager(
        lambda name: DeviceFacts(uuid="GPU-old", compute_capability=(6, 1)),
        FakeGpuPolicy(tmp_path),
        MpsDaemons(tmp_path / "mps", FakeMpsProgram(), NoMounter()),
    )
    share = DeviceShare(
        "gpu-0", ClaimRef("default", "old", uid(1)), config=OpaqueConfig(NVIDIA, gpu_config(MPS_CONFIG))
    )
    with pytest.raises(DeviceConfigError, match=r"compute capability 6\.1, MPS with limits needs 7\.0"):
        await manager.prepare(share, [])
    assert not (tmp_path / "mps").exists()


AMD_GPU_CONFIG = {"apiVersion": "gpu.resource.amd.com/v1alpha1", "kind": "GpuConfig"}


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({**AMD_GPU_CONFIG, "apiVersion": "gpu.resource.amd.com/v1"}, "gpu.resource.amd.com/v1alpha1"),
        ({**AMD_GPU_CONFIG, "apiVersion": "gpu.amd.com/v1alpha1"}, "gpu.resource.amd.com/v1alpha1"),
        ({**AMD_GPU_CONFIG, "sharing": {"enabled": False}}, "field sharing"),
        ({**AMD_GPU_CONFIG, "kind": "VfioDeviceConfig"}, "VfioDeviceConfig"),
    ],
)
async def test_bad_amd_config(tmp_path: Path, params: dict[str, Any], expected: str) -> None:
    """AMD's group and kinds: ``api/amd.com/resource/gpu/v1alpha1/api.go`` of ROCm/k8s-gpu-dra-driver."""
    bad = claim(1, driver="gpu.amd.com", device="gpu-1-128", config=params)
    state = device_state(tmp_path, FakeClaimSource([bad]), fake_backend(tmp_path, profile="amd-mi300x-8x"))
    await state.start()
    error = (await state.prepare([ref(bad)]))[uid(1)].error
    assert "claim default/claim-1" in error and expected in error
    assert state.store.entries() == {}
