"""Slices with ``consumable-shares``: accepted by the API server's rules and shaped for two memory shares.

Rules: ``validateSingleAllocatableDeviceCapacity`` and ``validateRequestPolicy`` of
``K/pkg/apis/resource/validation/validation.go`` (requestPolicy only with allowMultipleAllocations,
default and max on the step grid from min, max within the capacity), as the emulator applies them
per release and gate; rounding of requests: ``CapacityRequirements.Requests`` in
``K/staging/src/k8s.io/api/resource/v1/types.go`` and ``dra-1.36-verified-shapes.md``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agent.core.errors import ConfigError, DeviceModelError
from agent.core.model import Device, RequestPolicy
from agent.core.quantity import Quantity
from agent.core.sharing import ConsumableShares
from agent.emulator import KubeApiEmulator
from agent.kube.slices import build_slice, device_to_api, semantic_device
from tests.sharing.allocator import allocate
from tests.sharing.helpers import NODE, fake_backend

GI = 1024**3


def consumed(policy: dict[str, Any] | None, capacity: int, requested: int | None) -> int | None:
    """What the scheduler consumes for `requested` bytes (None: not allocatable), per the verified rules."""
    if policy is None:
        return capacity if requested is None else (requested if requested <= capacity else None)
    if requested is None:
        return int(Quantity.parse(policy["default"]).value)
    valid_range = policy["validRange"]
    low, step = int(Quantity.parse(valid_range["min"]).value), int(Quantity.parse(valid_range["step"]).value)
    value = max(requested, low)
    value = low + -(-(value - low) // step) * step
    high = int(Quantity.parse(valid_range["max"]).value)
    return value if value <= min(high, capacity) else None


async def _slice(tmp_path: Path, profile: str, shares: str) -> dict[str, Any]:
    backend = fake_backend(tmp_path, profile=profile, shares=shares)
    devices = await backend.discover()
    body = build_slice(
        driver=backend.driver_name,
        node_name=NODE,
        node_uid="",
        entries=[device_to_api(d) for d in devices],
        generation=1,
        slice_count=1,
    )
    body["metadata"] = {"name": f"{NODE}-{backend.driver_name}"}
    return body


@pytest.mark.parametrize("shares", ["memory", "unlimited", "4"])
@pytest.mark.parametrize("profile", ["nvidia-a100-8x", "amd-mi300x-8x", "amd-mi300x-8x-cpx"])
@pytest.mark.parametrize(
    ("release", "gates"),
    [("1.34", {"DRAConsumableCapacity": True}), ("1.35", {"DRAConsumableCapacity": True}), ("1.36", {})],
)
async def test_shareable_slices_pass_the_api_server(
    tmp_path: Path, shares: str, profile: str, release: str, gates: dict[str, bool]
) -> None:
    body = await _slice(tmp_path, profile, shares)
    async with KubeApiEmulator(version=release, feature_gates=gates) as emu:
        stored = emu.create("resourceslices", body)
    sent, kept = body["spec"]["devices"], stored["spec"]["devices"]
    assert all(d["allowMultipleAllocations"] is True for d in kept)
    assert [semantic_device(d) for d in kept] == [semantic_device(d) for d in sent], (
        "the server dropped a field"
    )


async def test_two_memory_claims_fit_on_one_gpu(tmp_path: Path) -> None:
    device = (await _slice(tmp_path, "nvidia-a100-8x", "memory"))["spec"]["devices"][0]
    memory = device["capacity"]["memory"]
    assert memory["requestPolicy"] == {
        "default": "1Gi",
        "validRange": {"min": "1Gi", "max": "80Gi", "step": "1Gi"},
    }
    capacity = int(Quantity.parse(memory["value"]).value)
    first, second = (
        consumed(memory["requestPolicy"], capacity, 20 * GI),
        consumed(memory["requestPolicy"], capacity, int(24.5 * GI)),
    )
    assert (first, second) == (20 * GI, 25 * GI)
    assert first is not None and second is not None and first + second <= capacity
    assert consumed(memory["requestPolicy"], capacity, None) == GI, "an omitted request must not take the GPU"
    assert consumed(memory["requestPolicy"], capacity, 81 * GI) is None
    # Every capacity is consumed: with compute shares too (an omitted compute takes the whole GPU,
    # see test_compute_shares), the two claims fit side by side.
    assert allocate(device, [{"memory": "20Gi", "compute": "50"}, {"memory": "24.5Gi", "compute": "50"}]) == [
        True,
        True,
    ]


async def test_count_shares_and_unlimited(tmp_path: Path) -> None:
    counted = (await _slice(tmp_path, "nvidia-a100-8x", "4"))["spec"]["devices"][0]["capacity"]
    assert counted["shares"] == {
        "value": "4",
        "requestPolicy": {"default": "1", "validRange": {"min": "1", "max": "4", "step": "1"}},
    }
    assert counted["memory"]["requestPolicy"] == {"default": "0"}
    unlimited = (await _slice(tmp_path, "nvidia-a100-8x", "unlimited"))["spec"]["devices"][0]["capacity"]
    assert set(unlimited) == {"memory"} and unlimited["memory"]["requestPolicy"] == {"default": "0"}


async def test_disabled_publishes_exclusive_devices(tmp_path: Path) -> None:
    device = (await _slice(tmp_path, "nvidia-a100-8x", "disabled"))["spec"]["devices"][0]
    assert "allowMultipleAllocations" not in device
    assert device["capacity"]["memory"] == {"value": "80Gi"}


@pytest.mark.parametrize("value", ["some", "0", "1025", "-1", ""])
def test_bad_setting_names_it_and_what_is_accepted(value: str) -> None:
    with pytest.raises(ConfigError) as caught:
        ConsumableShares.parse(value, "--backend fake setting consumable-shares")
    assert str(caught.value) == (
        f"invalid value {value!r} for --backend fake setting consumable-shares: expected disabled, memory, "
        "unlimited or a number of shares from 1 to 1024"
    )


def test_request_policy_needs_a_shareable_device() -> None:
    with pytest.raises(
        DeviceModelError, match=r"capacity\[memory\]\.requestPolicy: allowMultipleAllocations must be true"
    ):
        Device(
            name="gpu-0",
            driver="gpu.example.com",
            capacity={"memory": Quantity.parse("1Gi")},
            request_policies={"memory": RequestPolicy(default=Quantity.parse("1Gi"))},
        )


async def test_small_devices_stay_exclusive_with_memory_shares(tmp_path: Path) -> None:
    small = Device(name="gpu-0", driver="gpu.example.com", capacity={"memory": Quantity.parse("1536Mi")})
    assert ConsumableShares.parse("memory", "x").apply(small) == small
