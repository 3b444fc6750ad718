"""The whole agent, end to end: real backends on fake vendor libraries, the API emulator, the kubelet.

These tests run `agent.app.Agent` with the same `AgentParts` as ``dra-agent run``; only the vendor
libraries (fake ``pynvml``; AMD's real ``amdsmi`` over the stand-in libamd_smi.so) and the API
server (the emulator over HTTP) are stand-ins.
The kubelet is played with the official grpcio client over the real unix sockets.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import anyio
import kubernetes_validate
import pytest

from agent.config import AgentConfig
from agent.core.backend import Backend, BackendOptions
from agent.core.clock import SystemClock
from agent.demo import DemoOptions, agent_running, demo_config, run_demo
from agent.emulator import KubeApiEmulator
from agent.health.taints import ClusterTaintSupport
from agent.kube.validation import check_device_entry, check_slice_spec
from agent.kubelet.plugin import socket_paths
from agent.runner import AgentParts
from backends.amd.backend import AmdBackend
from backends.nvidia import NvidiaBackend
from tests.amd.conftest import make_sysfs
from tests.fakes.amd_standin import load, mi300x
from tests.fakes.libnvml import XID_CRITICAL, LibNvml, h100
from tests.kubelet.grpc_support import V1, grpcio_protos, grpcio_unary, short_tmp_dir
from tests.nvidia.conftest import build_sysfs

NODE = "node-1"
KUBE_VERSION = "1.34.0"


@pytest.fixture
def root() -> Any:
    yield from short_tmp_dir()


async def until(check: Callable[[], Any], what: str, limit: float = 10.0) -> Any:
    """Poll the emulator's store (it has no change events for tests) until `check` holds."""
    with anyio.move_on_after(limit):
        while not (result := check()):  # noqa: ASYNC110
            await anyio.sleep(0.01)
        return result
    raise AssertionError(f"timed out waiting for {what}")


def device_taints(emu: KubeApiEmulator, driver: str) -> dict[str, list[dict[str, Any]]]:
    """Taints per device name in the driver's published slices."""
    return {
        d["name"]: d.get("taints", [])
        for s in emu.list("resourceslices", field_selector=f"spec.driver={driver}")
        for d in s["spec"]["devices"]
    }


# --- the demo -----------------------------------------------------------------------------------


async def test_demo_shows_slices_taint_and_prepare(capsys: pytest.CaptureFixture[str]) -> None:
    import io

    out = io.StringIO()
    report = await run_demo(out, DemoOptions(hold_seconds=1.5))
    assert {s["spec"]["driver"] for s in report.slices} == {"gpu.nvidia.com", "gpu.amd.com"}
    for item in report.slices:
        # What the demo publishes is valid for a real 1.34 API server: the published schema checks
        # the shape, our own rules (those of the API server's validation) the names, values and semver.
        kubernetes_validate.validate(item, KUBE_VERSION, strict=True)
        spec = item["spec"]
        assert item["metadata"]["ownerReferences"][0]["kind"] == "Node"
        assert not check_slice_spec(
            driver=spec["driver"],
            node_name=spec["nodeName"],
            pool_name=spec["pool"]["name"],
            device_count=len(spec["devices"]),
        )
        assert [check_device_entry(d, ClusterTaintSupport()) for d in spec["devices"]] == [None] * len(
            spec["devices"]
        )
    assert report.taint["key"] == "gpu.nvidia.com/xid" and report.taint["value"] == "79"
    assert report.taint["effect"] == "NoSchedule"
    assert report.lift_seconds >= 1.5
    assert report.plugin_info["gpu.nvidia.com"]["supportedVersions"] == [
        "v1.DRAPlugin",
        "v1beta1.DRAPlugin",
        "v1.DRAResourceHealth",
        "v1alpha1.DRAResourceHealth",
    ]
    ((uid, answer),) = report.prepare["claims"].items()
    assert answer["devices"][0]["cdiDeviceIds"] == [f"k8s.gpu.nvidia.com/claim={uid}-gpu-1"]
    assert report.cdi_spec["kind"] == "k8s.gpu.nvidia.com/claim"
    assert report.cdi_removed
    assert report.unprepare == {"claims": {uid: {}}}
    text = out.getvalue()
    assert "kubectl get resourceslices -o yaml" in text and "NodePrepareResources" in text


# --- real backends on fake vendor libraries ---------------------------------------------------------


@dataclass
class Running:
    emu: KubeApiEmulator
    config: AgentConfig
    parts: AgentParts


@asynccontextmanager
async def running_agent(root: Path, backends: list[Backend]) -> AsyncIterator[Running]:
    """The agent with `backends`, publishing to an emulator and serving the kubelet under `root`."""
    async with KubeApiEmulator(version="1.34") as emu:
        emu.add_node(NODE)
        config = replace(
            demo_config(root, emu.write_kubeconfig(root / "kubeconfig"), DemoOptions()),
            node_name=NODE,
            taint_hold_seconds=1.0,
        )
        async with agent_running(config, backends) as parts:

            def published() -> bool:
                checks = parts.readiness.ready()[1]
                return all(checks.get(f"published/{b.driver_name}", (False, ""))[0] for b in backends)

            await until(published, "every driver's first slices")
            yield Running(emu, config, parts)


def nvidia_backend(root: Path, nvml: LibNvml) -> NvidiaBackend:
    dev = root / "dev"
    dev.mkdir(exist_ok=True)
    for node in ("nvidia0", "nvidiactl"):  # the device nodes the driver would have created
        (dev / node).touch()
    return NvidiaBackend(
        BackendOptions(NODE, None, {"health-wait-ms": "20", "host-root": str(root / "host")}),
        nvml_module=nvml.module,
        clock=SystemClock(),
        sysfs_root=build_sysfs(root / "sys", {"0000:18:00.0": "pci0000:10"}),
        proc_root=root / "proc",
        dev_root=dev,
    )


async def test_nvidia_xid_becomes_a_taint_and_a_claim_is_prepared_over_grpcio(root: Path) -> None:
    nvml = LibNvml([h100(0)])
    backend = nvidia_backend(root, nvml)
    async with running_agent(root, [backend]) as run:
        emu = run.emu
        assert device_taints(emu, "gpu.nvidia.com") == {"gpu-0": []}

        nvml.emit(nvml.gpus[0].uuid, XID_CRITICAL, data=79)
        taints = await until(lambda: device_taints(emu, "gpu.nvidia.com")["gpu-0"], "the XID taint")
        assert [(t["key"], t["value"], t["effect"]) for t in taints] == [
            ("gpu.nvidia.com/xid", "79", "NoSchedule")
        ]
        await until(lambda: not device_taints(emu, "gpu.nvidia.com")["gpu-0"], "the taint to be lifted")

        # The scheduler allocates gpu-0; the kubelet (grpcio) prepares and unprepares the claim.
        claim = emu.create(
            "resourceclaims",
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": "train", "namespace": "default"},
                "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu"}}]}},
            },
        )
        claim["status"] = {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": "gpu", "driver": "gpu.nvidia.com", "pool": NODE, "device": "gpu-0"}
                    ]
                }
            }
        }
        emu.update("resourceclaims", claim, subresource="status")
        uid = claim["metadata"]["uid"]
        pb = grpcio_protos().v1
        dra_socket, _ = socket_paths("gpu.nvidia.com", run.config.plugins_dir, run.config.registry_dir)
        request = pb.NodePrepareResourcesRequest(
            claims=[pb.Claim(namespace="default", name="train", uid=uid)]
        )
        answer = await grpcio_unary(
            dra_socket, V1 + "NodePrepareResources", request, pb.NodePrepareResourcesResponse
        )
        result = answer.claims[uid]
        assert result.error == ""
        assert [d.device_name for d in result.devices] == ["gpu-0"]
        assert list(result.devices[0].cdi_device_ids) == [f"k8s.gpu.nvidia.com/claim={uid}-gpu-0"]
        spec = run.config.cdi_root / f"k8s.gpu.nvidia.com-claim_{uid}.yaml"
        assert "/dev/nvidia0" in spec.read_text()

        unprepare = pb.NodeUnprepareResourcesRequest(
            claims=[pb.Claim(namespace="default", name="train", uid=uid)]
        )
        undone = await grpcio_unary(
            dra_socket, V1 + "NodeUnprepareResources", unprepare, pb.NodeUnprepareResourcesResponse
        )
        assert undone.claims[uid].error == ""
        assert not spec.exists()


async def test_amd_reset_taints_the_gpu_and_a_lost_nvidia_gpu_taints_gpu_lost(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpus = mi300x("spx_nps1", count=2)
    amdsmi = load().configure(gpus)
    amd = AmdBackend(
        BackendOptions(
            NODE, None, {"sysfs-root": str(make_sysfs(root / "amdsys", gpus)), "event-timeout-ms": "20"}
        ),
        clock=SystemClock(),
    )
    nvml = LibNvml([h100(0)])
    nvidia = nvidia_backend(root, nvml)
    async with running_agent(root, [nvidia, amd]) as run:
        emu = run.emu
        amd_devices = sorted(device_taints(emu, "gpu.amd.com"))
        assert len(amd_devices) == 2

        amdsmi.push_event(0, "GPU_PRE_RESET")
        taints = await until(
            lambda: {n: t for n, t in device_taints(emu, "gpu.amd.com").items() if t}, "the reset taint"
        )
        ((_, device_taint),) = taints.items()
        assert device_taint[0]["key"] == "gpu.amd.com/gpu-reset"
        assert device_taint[0]["effect"] == "NoSchedule"
        assert device_taints(emu, "gpu.nvidia.com") == {"gpu-0": []}  # the other driver is untouched

        nvml.lose(nvml.gpus[0].uuid)
        lost = await until(lambda: device_taints(emu, "gpu.nvidia.com")["gpu-0"], "the gpu-lost taint")
        assert lost[0]["key"] == "gpu.nvidia.com/gpu-lost"
        assert run.parts.readiness.ready()[1]["published/gpu.amd.com"][0]


# --- the process: `dra-agent run` until SIGTERM --------------------------------------------------


def test_run_shuts_down_cleanly_on_sigterm(root: Path) -> None:
    control = root / "fake.sock"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    args = [
        sys.executable,
        "-m",
        "agent.cli",
        "run",
        "--kube",
        "none",
        "--node-name",
        NODE,
        "--backend",
        f"fake:profile=nvidia-a100-8x,control={control}",
        "--registry-dir",
        str(root / "registry"),
        "--plugins-dir",
        str(root / "plugins"),
        "--cdi-root",
        str(root / "cdi"),
        "--state-dir",
        str(root / "state"),
        "--metrics-address",
        "127.0.0.1:0",
    ]
    _, reg_socket = socket_paths("gpu.nvidia.com", root / "plugins", root / "registry")
    with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True) as proc:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # the --kube none printer starts each pool with '---'
        assert first.strip() == "---", first
        for _ in range(500):
            if reg_socket.exists() and control.exists():
                break
            anyio.run(anyio.sleep, 0.02)
        assert reg_socket.exists() and control.exists()
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=20)
    assert proc.returncode == 0, stderr
    assert "shutting down" in stderr and "signal=SIGTERM" in stderr
    assert "Traceback" not in stderr
    # Every socket of ours is gone; nothing is left half-written.
    assert not reg_socket.exists() and not control.exists()
    assert not list((root / "plugins").rglob("*.sock"))


async def test_demo_sharing_shows_two_mps_shares_of_one_gpu(caplog: pytest.LogCaptureFixture) -> None:
    import io
    import logging

    out = io.StringIO()
    report = await run_demo(out, DemoOptions(hold_seconds=1.5, kube_version="1.36", sharing=True))
    shares = report.shares
    answers = shares["prepare"]["claims"]
    share_ids = {d["shareId"] for a in answers.values() for d in a["devices"]}
    assert len(answers) == 2 and len(share_ids) == 2
    # Issue 31: the API server takes both claims' status, each entry with its share's ID; no warning.
    assert {e["shareID"] for entries in shares["status"].values() for e in entries} == share_ids
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "warning" not in out.getvalue().lower()
    limits = sorted(line for lines in shares["env"].values() for line in lines if "PINNED" in line)
    assert [line.rsplit("=", 1)[1] for line in limits] == ["20480M", "30720M"]
    assert shares["daemons"] == 1 and shares["daemon"]["defaultActiveThreadPercentage"] == 50
    assert shares["daemons_after"] == 0
    nvidia = next(s for s in report.slices if s["spec"]["driver"] == "gpu.nvidia.com")
    assert all(d["allowMultipleAllocations"] is True for d in nvidia["spec"]["devices"])
