"""Fake backend edits run in a real container runtime without GPUs: environment and a mounted file
describing the device, never a host device node (a runtime stats every node a CDI spec names).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from agent.claims.cdi import CdiDevice, build_claim_spec, cdi_device_name
from agent.core.backend import BackendOptions, ClaimRef, Mount
from agent.core.errors import BackendError, ConfigError
from backends.fake import create_backend
from backends.fake.backend import FakeBackend
from backends.fake.devicefile import device_env_name
from tests.fake.helpers import make_backends
from tests.support.cdi_check import cdi_problems

CLAIM = ClaimRef("default", "claim-a", "uid-a")
RO = ("ro", "nosuid", "nodev", "bind")


async def test_nvidia_gpu_and_mig_get_environment_and_a_device_file(tmp_path: Path) -> None:
    (backend,), _ = make_backends("nvidia-a100-8x", device_files=str(tmp_path))
    edits = await backend.prepare("gpu-3", CLAIM)
    assert await backend.prepare("gpu-3", CLAIM) is edits  # idempotent
    assert edits.device_nodes == ()
    # A variable of its own for the device, and the real NVIDIA backend's "void": no device list.
    assert dict(edits.env) == {
        device_env_name("gpu.nvidia.com", "gpu-3"): "gpu.nvidia.com/gpu-3",
        "NVIDIA_VISIBLE_DEVICES": "void",
    }
    assert edits.list_env == frozenset()
    path = tmp_path / "gpu.nvidia.com" / "uid-a-gpu-3.json"
    assert edits.mounts == (Mount(str(path), "/run/dra-fake/gpu.nvidia.com/gpu-3.json", RO),)
    described = json.loads(path.read_text())
    assert described["device"] == "gpu-3" and described["driver"] == "gpu.nvidia.com"
    assert described["uuid"].startswith("GPU-")
    assert described["claim"] == {"namespace": "default", "name": "claim-a", "uid": "uid-a"}
    assert described["realDeviceNodes"][:2] == ["/dev/nvidia3", "/dev/nvidiactl"]
    assert described["attributes"]["type"] == "gpu"
    assert path.stat().st_mode & 0o777 == 0o644
    mig = await backend.prepare("gpu-7-mig-1g10gb-19-2", CLAIM)
    assert mig.device_nodes == () and mig.env["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert mig.env[device_env_name("gpu.nvidia.com", "gpu-7-mig-1g10gb-19-2")] == (
        "gpu.nvidia.com/gpu-7-mig-1g10gb-19-2"
    )
    mig_described = json.loads((tmp_path / "gpu.nvidia.com" / "uid-a-gpu-7-mig-1g10gb-19-2.json").read_text())
    assert mig_described["uuid"].startswith("MIG-")
    assert any(n.startswith("/dev/nvidia-caps/") for n in mig_described["realDeviceNodes"])
    await backend.unprepare("gpu-3", CLAIM)
    await backend.unprepare("gpu-3", CLAIM)  # idempotent
    assert not path.exists() and ("uid-a", "gpu-3") not in backend.prepared
    await backend.unprepare("gpu-7-mig-1g10gb-19-2", CLAIM)
    assert list((tmp_path / "gpu.nvidia.com").iterdir()) == []


async def test_files_an_older_agent_wrote_in_a_directory_per_claim_are_removed(tmp_path: Path) -> None:
    (backend,), _ = make_backends("nvidia-a100-8x", device_files=str(tmp_path))
    legacy = tmp_path / "gpu.nvidia.com" / "uid-a"
    legacy.mkdir(parents=True)
    (legacy / "gpu-3.json").write_text("{}")
    (legacy / "gpu-4.json").write_text("{}")
    await backend.unprepare("gpu-3", CLAIM)  # prepared before the upgrade: the agent has no record of it
    assert [p.name for p in legacy.iterdir()] == ["gpu-4.json"]
    await backend.unprepare("gpu-4", CLAIM)
    assert not legacy.exists()


async def test_amd_partition_describes_its_nodes_without_injecting_them(tmp_path: Path) -> None:
    (backend,), _ = make_backends("amd-mi300x-8x-cpx", device_files=str(tmp_path))
    edits = await backend.prepare("gpu-9-136", CLAIM)
    assert edits.device_nodes == ()
    assert dict(edits.env) == {device_env_name("gpu.amd.com", "gpu-9-136"): "gpu.amd.com/gpu-9-136"}
    described = json.loads((tmp_path / "gpu.amd.com" / "uid-a-gpu-9-136.json").read_text())
    assert described["realDeviceNodes"] == ["/dev/kfd", "/dev/dri/renderD136", "/dev/dri/card9"]


async def test_a_claims_spec_has_no_device_nodes_and_passes_the_cdi_schema(tmp_path: Path) -> None:
    (backend,), _ = make_backends("nvidia-a100-8x", device_files=str(tmp_path))
    devices = [
        CdiDevice(cdi_device_name(CLAIM.uid, name), await backend.prepare(name, CLAIM))
        for name in ("gpu-0", "gpu-1")
    ]
    spec = build_claim_spec(backend.driver_name, devices)
    assert cdi_problems(spec) == []
    edits = [d["containerEdits"] for d in spec["devices"]]
    assert all("deviceNodes" not in e for e in edits)
    # Every device of the claim carries every device's variable (the core merges a claim's env).
    names = [f"{device_env_name('gpu.nvidia.com', n)}=gpu.nvidia.com/{n}" for n in ("gpu-0", "gpu-1")]
    assert all(set(names) <= set(e["env"]) for e in edits)
    assert not any(v.startswith("FAKE_VISIBLE_DEVICES=") for e in edits for v in e["env"])
    assert [e["mounts"][0]["containerPath"] for e in edits] == [
        "/run/dra-fake/gpu.nvidia.com/gpu-0.json",
        "/run/dra-fake/gpu.nvidia.com/gpu-1.json",
    ]
    assert all(map(os.path.isfile, [e["mounts"][0]["hostPath"] for e in edits]))


async def test_files_go_under_the_agents_state_dir_by_default(tmp_path: Path) -> None:
    options = BackendOptions("n", settings={"profile": "mixed", "control": "off"}, state_dir=tmp_path)
    backends = [b for b in create_backend(options) if isinstance(b, FakeBackend)]
    assert len(backends) == 2
    for backend in backends:
        device = (await backend.discover())[0].name
        edits = await backend.prepare(device, CLAIM)
        assert edits.mounts[0].host_path == str(
            tmp_path / "fake-devices" / backend.driver_name / f"uid-a-{device}.json"
        )
    # No state directory (a library user) or device_files=off: the environment only.
    for settings, state_dir in (({}, None), ({"device_files": "off"}, tmp_path)):
        options = BackendOptions("n", settings={"control": "off", **settings}, state_dir=state_dir)
        edits = await create_backend(options)[0].prepare("gpu-0", CLAIM)
        assert edits.mounts == () and edits.device_nodes == () and edits.env


def test_device_files_must_be_absolute() -> None:
    with pytest.raises(ConfigError, match="device_files: expected an absolute directory or off"):
        make_backends(device_files="state/fake")


async def test_a_device_file_that_cannot_be_written_or_removed_fails_clearly(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("in the way")
    (backend, _), _ = make_backends(device_files=str(blocker))
    with pytest.raises(BackendError, match=r"cannot write the device file .*gpu-0\.json: .*device_files"):
        await backend.prepare("gpu-0", CLAIM)
    assert ("uid-a", "gpu-0") not in backend.prepared
    with pytest.raises(BackendError, match=r"cannot remove the device file .*gpu-0\.json: "):
        await backend.unprepare("gpu-0", CLAIM)


def test_device_variable_names_are_shell_names_of_their_own_per_driver_and_device() -> None:
    names = {
        device_env_name(driver, device)
        for driver in ("gpu.nvidia.com", "gpu.amd.com")
        for device in ("gpu-0", "gpu-1", "gpu-7-mig-1g10gb-19-2", "gpu-9-136")
    }
    assert len(names) == 8
    assert all(re.fullmatch(r"FAKE_DEVICE_[A-Z0-9_]+_[0-9A-F]{8}", n) for n in names)
    assert device_env_name("gpu.nvidia.com", "gpu-0").startswith("FAKE_DEVICE_GPU_0_")
