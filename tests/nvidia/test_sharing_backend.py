"""The NVIDIA backend's sharing on the stand-in libnvidia-ml: shareable devices, MPS and
time-slicing wired in."""

from __future__ import annotations

from pathlib import Path

from agent.core.backend import BackendOptions, ClaimRef
from agent.core.sharing import DeviceShare, OpaqueConfig
from backends.fake.sharing import FakeGpuPolicy, FakeMpsProgram
from backends.nvidia import NvidiaBackend
from backends.nvidia.mps import NoMounter
from tests.fakes.libnvml import LibNvml, h100
from tests.nvidia.conftest import build_sysfs
from tests.support.clock import FakeClock

CONFIG = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"}


def backend(tmp_path: Path) -> NvidiaBackend:
    for node in ("nvidia0", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset"):
        (tmp_path / "dev").mkdir(exist_ok=True)
        (tmp_path / "dev" / node).touch()
    options = BackendOptions(
        "node-1",
        settings={"consumable-shares": "memory", "host-root": str(tmp_path / "host")},
        state_dir=tmp_path / "state",
    )
    return NvidiaBackend(
        options,
        nvml_module=LibNvml([h100(0)]).module,
        clock=FakeClock(),
        sysfs_root=build_sysfs(tmp_path / "sys"),
        proc_root=tmp_path / "proc",
        dev_root=tmp_path / "dev",
        policy=FakeGpuPolicy(tmp_path / "ts"),
        mps_program=FakeMpsProgram(),
        mps_shm=NoMounter(),
    )


async def test_shareable_devices_mps_and_time_slicing(tmp_path: Path) -> None:
    nv = backend(tmp_path)
    await nv.start()
    try:
        (gpu,) = [d for d in await nv.discover() if d.name == "gpu-0"]
        assert gpu.allow_multiple_allocations and "memory" in gpu.request_policies
        mps = OpaqueConfig("gpu.nvidia.com", {**CONFIG, "sharing": {"strategy": "MPS"}})
        share = DeviceShare("gpu-0", ClaimRef("default", "a", "uid-a"), share_id="s-a", config=mps)
        edits = await nv.prepare_share(share, [])
        assert edits.env["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"
        daemon_dir = tmp_path / "state" / "mps" / "gpu.nvidia.com" / "gpu-0"
        assert (daemon_dir / "daemon.json").exists()
        slicer = FakeGpuPolicy(tmp_path / "ts")
        assert list(slicer.modes().values()) == ["EXCLUSIVE_PROCESS"]  # as NVIDIA's driver sets it for MPS
        await nv.unprepare_share(share, [])
        assert not daemon_dir.exists()
        assert list(slicer.modes().values()) == ["DEFAULT"]

        timesliced = OpaqueConfig("gpu.nvidia.com", {**CONFIG, "sharing": {"strategy": "TimeSlicing"}})
        ts_share = DeviceShare("gpu-0", ClaimRef("default", "b", "uid-b"), config=timesliced)
        await nv.prepare_share(ts_share, [])
        assert list(slicer.intervals().values()) == [0]  # Default interval, set through the seam
        await nv.unprepare_share(ts_share, [])
    finally:
        await nv.stop()
