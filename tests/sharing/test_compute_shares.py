"""Enforced compute shares (issue 24 point 6): a ``compute`` capacity next to ``memory``, enforced by MPS.

Slices: ``validateRequestPolicy`` of ``K/pkg/apis/resource/validation/validation.go`` as the
emulator applies it per release and gate; allocation: the scheduler's arithmetic of
``dra-1.36-verified-shapes.md`` (`tests.sharing.allocator`). Enforcement: NVIDIA's MPS client
variables ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` (it "will only further constrain the limit set by
the control daemon") and ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agent.core.model import Device, Version
from agent.core.quantity import Quantity
from agent.core.sharing import ConsumableShares
from agent.emulator import KubeApiEmulator
from agent.kube.slices import build_slice, device_to_api
from tests.kubelet.fakes import FakeClaimSource
from tests.sharing.allocator import allocate
from tests.sharing.helpers import (
    GPU0_UUID,
    NODE,
    NVIDIA,
    TIME_SLICING,
    alive,
    claim,
    compute_modes,
    daemon_pid,
    daemon_state,
    device_state,
    fake_backend,
    gpu_config,
    intervals,
    ref,
    share,
    spec_env,
    uid,
)

COMPUTE = "compute"
COMPUTE_POLICY = {"default": "0", "validRange": {"min": "0", "max": "100", "step": "1"}}
PLAIN_MPS = gpu_config({"strategy": "MPS"})
THREADS = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
PINNED = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"


async def _stored_slice(tmp_path: Path, release: str, gates: dict[str, bool], shares: str) -> dict[str, Any]:
    """This node's slice with `shares`, as the API server of `release` stored it."""
    backend = fake_backend(tmp_path, shares=shares)
    body = build_slice(
        driver=backend.driver_name,
        node_name=NODE,
        node_uid="",
        entries=[device_to_api(d) for d in await backend.discover()],
        generation=1,
        slice_count=1,
    )
    body["metadata"] = {"name": f"{NODE}-{backend.driver_name}"}
    async with KubeApiEmulator(version=release, feature_gates=gates) as emu:
        return emu.create("resourceslices", body)


RELEASES = [
    ("1.34", {"DRAConsumableCapacity": True}),
    ("1.35", {"DRAConsumableCapacity": True}),
    ("1.36", {}),
]


@pytest.mark.parametrize(("release", "gates"), RELEASES, ids=[r for r, _ in RELEASES])
async def test_compute_is_published_next_to_memory_and_the_server_keeps_it(
    tmp_path: Path, release: str, gates: dict[str, bool]
) -> None:
    devices = (await _stored_slice(tmp_path, release, gates, "memory"))["spec"]["devices"]
    assert devices and all(
        d["capacity"][COMPUTE] == {"value": "100", **{"requestPolicy": COMPUTE_POLICY}} for d in devices
    )
    assert {d["attributes"]["type"]["string"] for d in devices} == {"gpu", "mig"}, "MIG devices too"
    assert all("memory" in d["capacity"] for d in devices)


@pytest.mark.parametrize(("release", "gates"), RELEASES, ids=[r for r, _ in RELEASES])
async def test_two_claims_of_30_and_60_percent_fit_a_third_of_20_does_not(
    tmp_path: Path, release: str, gates: dict[str, bool]
) -> None:
    gpu = (await _stored_slice(tmp_path, release, gates, "memory"))["spec"]["devices"][0]
    assert allocate(
        gpu,
        [
            {COMPUTE: "30", "memory": "20Gi"},
            {COMPUTE: "60", "memory": "30Gi"},
            {COMPUTE: "20", "memory": "1Gi"},  # 31Gi of memory left, 10 % of the SMs
            {COMPUTE: "10", "memory": "1Gi"},  # what is left still fits
        ],
    ) == [True, True, False, True]
    assert allocate(gpu, [{COMPUTE: "0.5"}, {COMPUTE: "99"}, {COMPUTE: "1"}]) == [True, True, False], (
        "a fraction is rounded up to a whole percent"
    )
    assert allocate(gpu, [{COMPUTE: "101"}]) == [False]


async def test_claims_without_a_compute_request_still_pack_by_memory(tmp_path: Path) -> None:
    """The policy's default is 0: memory-only claims (what users ran before compute shares) reserve
    no SMs and still share a GPU; claims that ask for compute get it kept for them."""
    gpu = (await _stored_slice(tmp_path, "1.36", {}, "memory"))["spec"]["devices"][0]
    assert allocate(gpu, [{"memory": "20Gi"}, {"memory": "20Gi"}, {COMPUTE: "100", "memory": "1Gi"}]) == [
        True,
        True,
        True,
    ]
    assert allocate(gpu, [{COMPUTE: "100"}, {"memory": "20Gi"}, {COMPUTE: "1"}]) == [True, True, False]


@pytest.mark.parametrize("shares", ["unlimited", "4", "disabled"])
async def test_compute_only_with_memory_shares(tmp_path: Path, shares: str) -> None:
    devices = (await _stored_slice(tmp_path, "1.36", {}, shares))["spec"]["devices"]
    assert all(COMPUTE not in d["capacity"] for d in devices)


@pytest.mark.parametrize(
    ("attributes", "published"),
    [({"cudaComputeCapability": "8.0.0"}, True), ({"cudaComputeCapability": "6.1.0"}, False), ({}, False)],
    ids=["ampere", "pascal-no-mps-limits", "not-cuda"],
)
def test_compute_only_where_mps_can_limit_threads(attributes: dict[str, Any], published: bool) -> None:
    attrs = {k: Version(v) for k, v in attributes.items()}
    gpu = Device(
        name="gpu-0", driver="gpu.example.com", attributes=attrs, capacity={"memory": Quantity.parse("16Gi")}
    )
    assert (COMPUTE in ConsumableShares.parse("memory", "x").apply(gpu).capacity) is published


async def test_compute_and_memory_shares_become_each_clients_mps_limits(tmp_path: Path) -> None:
    c1 = claim(1, share_id=share(1), memory="20Gi", compute="30", config=PLAIN_MPS)
    c2 = claim(2, share_id=share(2), memory="30Gi", compute="60", config=PLAIN_MPS)
    state = device_state(tmp_path, FakeClaimSource([c1, c2]), fake_backend(tmp_path))
    await state.start()
    results = await state.prepare([ref(c1), ref(c2)])
    assert [r.error for r in results.values()] == ["", ""]
    for n, threads, pinned in ((1, 30, 20480), (2, 60, 30720)):
        env = spec_env(tmp_path, uid(n))
        assert f"{THREADS}={threads}" in env
        assert f"{PINNED}={GPU0_UUID}={pinned}M" in env
    recorded = daemon_state(tmp_path)
    assert recorded is not None and recorded["defaultActiveThreadPercentage"] is None
    assert compute_modes(tmp_path) == {GPU0_UUID: "EXCLUSIVE_PROCESS"}
    assert await state.unprepare([ref(c1), ref(c2)]) == {uid(1): "", uid(2): ""}
    assert daemon_state(tmp_path) is None
    assert compute_modes(tmp_path) == {GPU0_UUID: "DEFAULT"}


@pytest.mark.parametrize(
    ("mps_config", "threads", "pinned"),
    [
        ({"defaultActiveThreadPercentage": 50}, None, f"{GPU0_UUID}=20480M"),
        ({"defaultPinnedDeviceMemoryLimit": "10Gi"}, "30", None),
        ({"defaultPerDevicePinnedMemoryLimit": {GPU0_UUID: "8Gi"}}, "30", None),
        ({"defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "10Gi"}, None, None),
    ],
    ids=["config-threads", "config-pinned", "config-per-device-pinned", "config-both"],
)
async def test_the_claims_own_mps_defaults_win(
    tmp_path: Path, mps_config: dict[str, Any], threads: str | None, pinned: str | None
) -> None:
    """Where the GpuConfig sets a daemon default itself, it applies to every client of the device and
    the share's consumed value is not set; the other variable still comes from the share."""
    config = gpu_config({"strategy": "MPS", "mpsConfig": mps_config})
    c1 = claim(1, share_id=share(1), memory="20Gi", compute="30", config=config)
    state = device_state(tmp_path, FakeClaimSource([c1]), fake_backend(tmp_path))
    await state.start()
    assert (await state.prepare([ref(c1)]))[uid(1)].error == ""
    env = dict(e.split("=", 1) for e in spec_env(tmp_path, uid(1)))
    assert env.get(THREADS) == threads
    assert env.get(PINNED) == pinned
    recorded = daemon_state(tmp_path)
    assert recorded is not None
    assert recorded["defaultActiveThreadPercentage"] == mps_config.get("defaultActiveThreadPercentage")
    await state.unprepare([ref(c1)])


COMPUTE_ACCEPTED = "a whole percentage of the device's SMs from 0 to 100"
BAD: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
    (
        "compute 150",
        {"compute": "150", "config": PLAIN_MPS},
        ("consumedCapacity.compute '150'", COMPUTE_ACCEPTED),
    ),
    (
        "compute 30.5",
        {"compute": "30500m", "config": PLAIN_MPS},
        ("consumedCapacity.compute '30500m'", COMPUTE_ACCEPTED),
    ),
    ("compute -30", {"compute": "-30", "config": PLAIN_MPS}, ("consumedCapacity[compute]", "negative")),
    (
        "compute with time-slicing",
        {"compute": "30", "config": TIME_SLICING},
        ("sharing.strategy 'TimeSlicing'", "MPS for a compute share", "compute 30"),
    ),
    (
        "compute without a config",
        {"compute": "30"},
        ("no entry of this driver applies", "sharing.strategy None", "MPS for a compute share"),
    ),
    (
        "compute with sharing off",
        {"compute": "30", "config": gpu_config()},
        ("sharing.strategy None", "MPS for a compute share"),
    ),
    (
        "memory under 1Mi",
        {"memory": "512Ki", "config": PLAIN_MPS},
        ("consumedCapacity.memory '512Ki'", "at least 1Mi"),
    ),
]


@pytest.mark.parametrize(("case", "expected"), [(c, e) for _, c, e in BAD], ids=[n for n, _, _ in BAD])
async def test_bad_share_fails_the_claim_and_changes_nothing(
    tmp_path: Path, case: dict[str, Any], expected: tuple[str, ...]
) -> None:
    bad = claim(1, share_id=share(1), **case)
    state = device_state(tmp_path, FakeClaimSource([bad]), fake_backend(tmp_path))
    await state.start()
    error = (await state.prepare([ref(bad)]))[uid(1)].error
    assert "claim default/claim-1" in error
    for part in expected:
        assert part in error
    assert state.store.entries() == {}
    assert not (tmp_path / "cdi" / f"k8s.{NVIDIA}-claim_{uid(1)}.yaml").exists()
    assert daemon_state(tmp_path) is None
    assert compute_modes(tmp_path) == {}, "the compute mode was touched"
    assert intervals(tmp_path) == {}


async def test_a_bad_share_next_to_a_running_one_leaves_its_daemon_alone(tmp_path: Path) -> None:
    good = claim(1, share_id=share(1), memory="20Gi", compute="30", config=PLAIN_MPS)
    bad = claim(2, share_id=share(2), memory="20Gi", compute="150", config=PLAIN_MPS)
    state = device_state(tmp_path, FakeClaimSource([good, bad]), fake_backend(tmp_path))
    await state.start()
    assert (await state.prepare([ref(good)]))[uid(1)].error == ""
    pid = daemon_pid(tmp_path)
    assert pid is not None
    error = (await state.prepare([ref(bad)]))[uid(2)].error
    assert "claim default/claim-2" in error and "consumedCapacity.compute '150'" in error
    assert daemon_pid(tmp_path) == pid and alive(pid)
    assert compute_modes(tmp_path) == {GPU0_UUID: "EXCLUSIVE_PROCESS"}
    assert f"{THREADS}=30" in spec_env(tmp_path, uid(1))
    assert await state.unprepare([ref(good)]) == {uid(1): ""}
    assert not alive(pid)
    assert compute_modes(tmp_path) == {GPU0_UUID: "DEFAULT"}


@pytest.mark.parametrize("compute", ["100", "0"], ids=["whole-gpu", "none-reserved"])
async def test_a_whole_or_unreserved_compute_share_needs_no_mps(tmp_path: Path, compute: str) -> None:
    """100 % or 0 % (a claim that asked no compute: the policy's default) needs no cap: with
    time-slicing or no config it is prepared, and no client gets a thread percentage."""
    c1 = claim(1, share_id=share(1), memory="20Gi", compute=compute, config=TIME_SLICING)
    c2 = claim(2, share_id=share(2), memory="20Gi", compute=compute, device="gpu-1")
    state = device_state(tmp_path, FakeClaimSource([c1, c2]), fake_backend(tmp_path))
    await state.start()
    results = await state.prepare([ref(c1), ref(c2)])
    assert [r.error for r in results.values()] == ["", ""]
    assert not any(e.startswith(THREADS) for e in spec_env(tmp_path, uid(1)) + spec_env(tmp_path, uid(2)))
    await state.unprepare([ref(c1), ref(c2)])


async def test_a_share_that_reserved_no_memory_gets_no_pinned_limit(tmp_path: Path) -> None:
    """``consumable-shares=unlimited``: an omitted memory request consumes 0, which is no limit (not 0M)."""
    c1 = claim(1, share_id=share(1), memory="0", config=PLAIN_MPS)
    state = device_state(tmp_path, FakeClaimSource([c1]), fake_backend(tmp_path, shares="unlimited"))
    await state.start()
    assert (await state.prepare([ref(c1)]))[uid(1)].error == ""
    assert not any(e.startswith(PINNED) for e in spec_env(tmp_path, uid(1)))
    await state.unprepare([ref(c1)])
