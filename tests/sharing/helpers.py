"""Claims with shares and opaque configs, and a DeviceState over the real fake backend."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from agent.claims.state.machine import DeviceState
from agent.core.backend import BackendOptions, ClaimRef
from backends.fake import create_backend
from backends.fake.backend import FakeBackend
from backends.fake.mpsdaemon import STATE_FILE
from tests.kubelet.fakes import FakeClaimSource

NODE = "node-a"
NVIDIA = "gpu.nvidia.com"
AMD = "gpu.amd.com"
GPU0_UUID = "GPU-b54643b5-70da-1b9e-82ba-3151f1124f17"


def uid(n: int) -> str:
    return f"00000000-0000-4000-8000-{n:012d}"


def share(n: int) -> str:
    return f"11111111-0000-4000-8000-{n:012d}"


def gpu_config(sharing: Mapping[str, Any] | None = None, kind: str = "GpuConfig") -> dict[str, Any]:
    """NVIDIA's opaque parameters, as a user writes them."""
    params: dict[str, Any] = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": kind}
    if sharing is not None:
        params["sharing"] = dict(sharing)
    return params


TIME_SLICING = gpu_config({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}})
MPS = gpu_config({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}})


def claim(
    n: int,
    *,
    device: str = "gpu-0",
    driver: str = NVIDIA,
    share_id: str | None = None,
    memory: str | None = None,
    compute: str | None = None,
    config: Mapping[str, Any] | None = None,
    class_config: Mapping[str, Any] | None = None,
    config_requests: Sequence[str] = (),
) -> dict[str, Any]:
    """An allocated v1 claim of request ``gpu`` on `device`, with an optional share and configs."""
    result: dict[str, Any] = {"request": "gpu", "driver": driver, "pool": NODE, "device": device}
    if share_id:
        result["shareID"] = share_id
    consumed = {k: v for k, v in (("memory", memory), ("compute", compute)) if v is not None}
    if consumed:
        result["consumedCapacity"] = consumed
    configs = []
    spec: dict[str, Any] = {
        "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": driver}}]}
    }
    if class_config is not None:
        configs.append(
            {
                "source": "FromClass",
                "requests": ["gpu"],
                "opaque": {"driver": driver, "parameters": class_config},
            }
        )
    if config is not None:
        entry: dict[str, Any] = {"opaque": {"driver": driver, "parameters": config}}
        if config_requests:
            entry["requests"] = list(config_requests)
        spec["devices"]["config"] = [entry]
        configs.append({"source": "FromClaim", **entry})
    allocation: dict[str, Any] = {"devices": {"results": [result]}}
    if configs:
        allocation["devices"]["config"] = configs
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": "default", "name": f"claim-{n}", "uid": uid(n)},
        "spec": spec,
        "status": {"allocation": allocation},
    }


def ref(claim_obj: Mapping[str, Any]) -> ClaimRef:
    meta = claim_obj["metadata"]
    return ClaimRef(meta["namespace"], meta["name"], meta["uid"])


def fake_backend(root: Path, profile: str = "nvidia-a100-8x", shares: str = "memory") -> FakeBackend:
    (backend,) = create_backend(
        BackendOptions(
            NODE,
            settings={"profile": profile, "control": "off", "consumable-shares": shares},
            state_dir=root / "state",
        )
    )
    assert isinstance(backend, FakeBackend)
    return backend


def device_state(root: Path, source: FakeClaimSource, backend: FakeBackend) -> DeviceState:
    return DeviceState(
        backend.driver_name,
        backend,
        source,
        node_name=NODE,
        cdi_root=root / "cdi",
        state_dir=root / "state",
        boot_id="boot-1",
    )


def mps_dir(root: Path, device: str = "gpu-0") -> Path:
    return root / "state" / "fake-sharing" / NVIDIA / "mps" / device


def daemon_state(root: Path, device: str = "gpu-0") -> dict[str, Any] | None:
    """What the fake MPS daemon of `device` recorded (None when there is no record)."""
    path = mps_dir(root, device) / "log" / STATE_FILE
    return json.loads(path.read_text()) if path.exists() else None


def daemon_pid(root: Path, device: str = "gpu-0") -> int | None:
    path = mps_dir(root, device) / "daemon.json"
    return int(json.loads(path.read_text())["pid"]) if path.exists() else None


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def kill_quietly(pid: int | None) -> None:
    if pid is not None and alive(pid):
        os.kill(pid, 9)


def compute_modes(root: Path) -> dict[str, str]:
    """UUID -> compute mode as the fake GPU policy last set it (empty: never changed)."""
    path = root / "state" / "fake-sharing" / NVIDIA / "compute-mode.json"
    return json.loads(path.read_text()) if path.exists() else {}


def intervals(root: Path) -> dict[str, int]:
    path = root / "state" / "fake-sharing" / NVIDIA / "timeslice.json"
    return json.loads(path.read_text()) if path.exists() else {}


def spec_env(root: Path, claim_uid: str, driver: str = NVIDIA) -> list[str]:
    import yaml

    spec = yaml.safe_load((root / "cdi" / f"k8s.{driver}-claim_{claim_uid}.yaml").read_text())
    env: list[str] = []
    for device in spec["devices"]:
        env += device["containerEdits"].get("env", [])
    return env


def daemons_of(root: Path) -> list[int]:
    """Live stand-in MPS daemons started under `root` (found by their pipe directory), leaked or not."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if b"backends.fake.mpsdaemon" in cmdline and str(root).encode() in environ and alive(int(entry.name)):
            found.append(int(entry.name))
    return found
