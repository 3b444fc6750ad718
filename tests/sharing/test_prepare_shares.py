"""Shares of one device through DeviceState and the fake backend: share IDs, MPS, time-slicing, counting.

The shapes (``shareID``, ``consumedCapacity`` in allocation results; class configs copied into
``status.allocation.devices.config`` with source FromClass) are those of
``K/staging/src/k8s.io/dynamic-resource-allocation/structured/internal/experimental/allocator.go``
and ``../shared/reference/dra-1.36-verified-shapes.md``.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import anyio

from agent.claims.cdi import qualified_device_id
from backends.amd.sharingconfig import API_VERSION as AMD_API_VERSION
from tests.kubelet.fakes import FakeClaimSource
from tests.sharing.helpers import (
    GPU0_UUID,
    MPS,
    NVIDIA,
    TIME_SLICING,
    alive,
    claim,
    daemon_pid,
    daemon_state,
    device_state,
    fake_backend,
    gpu_config,
    intervals,
    mps_dir,
    ref,
    share,
    spec_env,
    uid,
)


async def test_two_memory_shares_on_one_gpu_share_one_mps_daemon(tmp_path: Path) -> None:
    c1 = claim(1, share_id=share(1), memory="20Gi", config=MPS)
    c2 = claim(2, share_id=share(2), memory="30Gi", config=MPS)
    state = device_state(tmp_path, FakeClaimSource([c1, c2]), fake_backend(tmp_path))
    await state.start()
    results = await state.prepare([ref(c1), ref(c2)])  # concurrently: one daemon all the same
    assert [r.error for r in results.values()] == ["", ""]
    for n in (1, 2):
        (device,) = results[uid(n)].devices
        assert device.share_id == share(n)
        assert device.cdi_device_ids == (qualified_device_id(NVIDIA, f"{uid(n)}-gpu-0-{share(n)}"),)
    recorded = daemon_state(tmp_path)
    assert recorded is not None
    assert recorded["device"] == GPU0_UUID
    assert recorded["defaultActiveThreadPercentage"] == 50
    pid = daemon_pid(tmp_path)
    assert pid is not None and alive(pid)
    assert f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={GPU0_UUID}=20480M" in spec_env(tmp_path, uid(1))
    assert f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={GPU0_UUID}=30720M" in spec_env(tmp_path, uid(2))
    assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in spec_env(tmp_path, uid(1))

    assert await state.unprepare([ref(c1)]) == {uid(1): ""}
    assert daemon_pid(tmp_path) == pid and alive(pid), "stopped while a share still uses it"
    assert await state.unprepare([ref(c2)]) == {uid(2): ""}
    assert not alive(pid)
    assert not mps_dir(tmp_path).exists()


async def test_time_slicing_is_set_by_the_first_share_and_restored_by_the_last(tmp_path: Path) -> None:
    c1 = claim(1, share_id=share(1), config=TIME_SLICING)
    c2 = claim(2, share_id=share(2), class_config=TIME_SLICING)  # the same, from the DeviceClass
    state = device_state(tmp_path, FakeClaimSource([c1, c2]), fake_backend(tmp_path))
    await state.start()
    assert (await state.prepare([ref(c1)]))[uid(1)].error == ""
    assert intervals(tmp_path) == {GPU0_UUID: 3}
    assert (await state.prepare([ref(c2)]))[uid(2)].error == ""
    await state.unprepare([ref(c1)])
    assert intervals(tmp_path) == {GPU0_UUID: 3}
    await state.unprepare([ref(c2)])
    assert intervals(tmp_path) == {GPU0_UUID: 0}


async def test_claim_config_wins_over_class_config(tmp_path: Path) -> None:
    c1 = claim(1, config=MPS, class_config=TIME_SLICING)
    state = device_state(tmp_path, FakeClaimSource([c1]), fake_backend(tmp_path, shares="disabled"))
    await state.start()
    assert (await state.prepare([ref(c1)]))[uid(1)].error == ""
    assert daemon_state(tmp_path) is not None
    assert intervals(tmp_path) == {}
    await state.unprepare([ref(c1)])
    assert daemon_state(tmp_path) is None


async def test_conflicting_share_fails_naming_the_other_claim_and_applies_nothing(tmp_path: Path) -> None:
    c1 = claim(1, share_id=share(1), config=TIME_SLICING)
    c2 = claim(2, share_id=share(2), config=MPS)
    state = device_state(tmp_path, FakeClaimSource([c1, c2]), fake_backend(tmp_path))
    await state.start()
    await state.prepare([ref(c1)])
    error = (await state.prepare([ref(c2)]))[uid(2)].error
    assert "claim default/claim-2" in error and "claim default/claim-1" in error
    assert "TimeSlicing (interval Long)" in error and "MPS" in error
    assert daemon_state(tmp_path) is None
    assert intervals(tmp_path) == {GPU0_UUID: 3}
    assert uid(2) not in state.store.entries()
    assert not (tmp_path / "cdi" / f"k8s.{NVIDIA}-claim_{uid(2)}.yaml").exists()


async def test_restart_re_adopts_the_running_daemon(tmp_path: Path) -> None:
    c1 = claim(1, share_id=share(1), memory="8Gi", config=MPS)
    source = FakeClaimSource([c1])
    state = device_state(tmp_path, source, fake_backend(tmp_path))
    await state.start()
    await state.prepare([ref(c1)])
    pid = daemon_pid(tmp_path)
    assert pid is not None
    again = device_state(tmp_path, source, fake_backend(tmp_path))  # a new agent process
    await again.start()
    assert daemon_pid(tmp_path) == pid and alive(pid), "not re-adopted"
    await again.unprepare([ref(c1)])
    assert not alive(pid)


async def test_restart_replaces_a_dead_daemon_and_stops_unneeded_ones(tmp_path: Path) -> None:
    c1 = claim(1, config=MPS, device="gpu-0")
    c2 = claim(2, config=MPS, device="gpu-1")
    source = FakeClaimSource([c1, c2])
    state = device_state(tmp_path, source, fake_backend(tmp_path, shares="disabled"))
    await state.start()
    await state.prepare([ref(c1), ref(c2)])
    dead, unneeded = daemon_pid(tmp_path, "gpu-0"), daemon_pid(tmp_path, "gpu-1")
    assert dead is not None and unneeded is not None
    os.kill(dead, signal.SIGKILL)
    while alive(dead):  # noqa: ASYNC110 - a kill lands asynchronously; a restart before it re-adopts
        await anyio.sleep(0.01)
    source.delete("default", "claim-2")  # deleted while the agent was down
    again = device_state(tmp_path, source, fake_backend(tmp_path, shares="disabled"))
    await again.start()
    replacement = daemon_pid(tmp_path, "gpu-0")
    assert replacement is not None and replacement != dead and alive(replacement)
    assert not alive(unneeded)
    assert not mps_dir(tmp_path, "gpu-1").exists()


async def test_guide_claims_translated_to_v1_prepare(tmp_path: Path) -> None:
    """The guides' sharing claims in v1: a claim shared by pods, and ``mode: shared, memoryLimit: 4Gi``.

    ``dra-ga-nvidia-amd.md``'s ``shared-gpu-claim`` (one claim, several pods) needs nothing of
    the driver; ``dra-for-gpus-howto.md``'s v1alpha2 ``GpuClaimParameters {mode: shared,
    memoryLimit: 4Gi}`` becomes a 4Gi memory capacity request (the scheduler writes
    ``consumedCapacity``) with NVIDIA's MPS config, so the limit is enforced.
    """
    shared_by_pods = claim(1, device="gpu-1")
    memory_limited = claim(2, share_id=share(2), memory="4Gi", config=gpu_config({"strategy": "MPS"}))
    state = device_state(tmp_path, FakeClaimSource([shared_by_pods, memory_limited]), fake_backend(tmp_path))
    await state.start()
    results = await state.prepare([ref(shared_by_pods), ref(memory_limited)])
    assert [r.error for r in results.values()] == ["", ""]
    assert f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={GPU0_UUID}=4096M" in spec_env(tmp_path, uid(2))
    await state.unprepare([ref(shared_by_pods), ref(memory_limited)])
    assert daemon_state(tmp_path) is None


async def test_amd_shares_with_and_without_a_config_share_a_device(tmp_path: Path) -> None:
    """AMD's GpuConfig sets nothing up (``backends.amd.sharingconfig``): shares never conflict."""
    amd = {"apiVersion": AMD_API_VERSION, "kind": "GpuConfig"}
    c1 = claim(1, driver="gpu.amd.com", device="gpu-1-128", share_id=share(1), memory="16Gi")
    c2 = claim(2, driver="gpu.amd.com", device="gpu-1-128", share_id=share(2), memory="16Gi", config=amd)
    backend = fake_backend(tmp_path, profile="amd-mi300x-8x")
    state = device_state(tmp_path, FakeClaimSource([c1, c2]), backend)
    await state.start()
    assert (await state.prepare([ref(c1)]))[uid(1)].error == ""
    assert (await state.prepare([ref(c2)]))[uid(2)].error == ""
