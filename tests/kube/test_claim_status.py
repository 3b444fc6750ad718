"""Per-device claim status (issue 25; KEP-4817 ``status.devices``, GA in 1.37): after a prepare the
claim says which physical GPU it holds and whether it is healthy; an unprepare removes our entry;
a write that fails never fails the prepare and is retried.

Upstream: the list-map keys of ``status.devices`` (driver, device, pool) and its ``data`` /
``conditions`` (staging/src/k8s.io/api/resource/v1/types.go, AllocatedDeviceStatus), its validation
(pkg/apis/resource/validation/validation.go, validateDeviceStatus: only allocated devices), and
server-side apply ownership per field manager (staging/src/k8s.io/apimachinery/pkg/util/managedfields).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.emulator import KubeApiEmulator
from agent.kubelet.plugin import socket_paths
from tests.fakes.libnvml import XID_CRITICAL, LibNvml, h100
from tests.kubelet.grpc_support import V1, grpcio_protos, grpcio_unary, short_tmp_dir
from tests.lifecycle.harness import until
from tests.test_agent_e2e import NODE, nvidia_backend, running_agent

DRIVER = "gpu.nvidia.com"


@pytest.fixture
def root() -> Iterator[Path]:
    yield from short_tmp_dir()


def allocate(emu: KubeApiEmulator, name: str, device: str) -> dict[str, Any]:
    claim = emu.create(
        "resourceclaims",
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu"}}]}},
        },
    )
    claim["status"] = {
        "allocation": {
            "devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device}]},
            "nodeSelector": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [NODE]}]}
                ]
            },
        }
    }
    return emu.update("resourceclaims", claim, subresource="status")


def status_devices(emu: KubeApiEmulator, name: str) -> list[dict[str, Any]]:
    claim = emu.get("resourceclaims", name, namespace="default") or {}
    return list((claim.get("status") or {}).get("devices") or [])


async def call(root: Path, run: Any, method: str, name: str, uid: str) -> Any:
    pb = grpcio_protos().v1
    dra_socket, _ = socket_paths(DRIVER, run.config.plugins_dir, run.config.registry_dir)
    claims = [pb.Claim(namespace="default", name=name, uid=uid)]
    if method == "prepare":
        request = pb.NodePrepareResourcesRequest(claims=claims)
        return await grpcio_unary(
            dra_socket, V1 + "NodePrepareResources", request, pb.NodePrepareResourcesResponse
        )
    request = pb.NodeUnprepareResourcesRequest(claims=claims)
    return await grpcio_unary(
        dra_socket, V1 + "NodeUnprepareResources", request, pb.NodeUnprepareResourcesResponse
    )


async def test_a_prepared_claim_names_its_gpu_and_follows_its_health(root: Path) -> None:
    nvml = LibNvml([h100(0)])
    async with running_agent(root, [nvidia_backend(root, nvml)]) as run:
        emu = run.emu
        uid = allocate(emu, "train", "gpu-0")["metadata"]["uid"]
        answer = await call(root, run, "prepare", "train", uid)
        assert answer.claims[uid].error == ""
        (entry,) = await until(lambda: status_devices(emu, "train"), "the claim's device status")
        assert (entry["driver"], entry["pool"], entry["device"]) == (DRIVER, NODE, "gpu-0")
        assert entry["data"]["uuid"] == nvml.gpus[0].uuid and entry["data"]["pciBusID"]
        assert [(c["type"], c["status"], c["reason"]) for c in entry["conditions"]] == [
            ("Ready", "True", "Prepared")
        ]

        nvml.emit(nvml.gpus[0].uuid, XID_CRITICAL, data=79)

        def unhealthy() -> bool:
            devices = status_devices(emu, "train")
            return bool(devices) and devices[0]["conditions"][0]["status"] == "False"

        await until(unhealthy, "Ready=False after XID 79")
        (entry,) = status_devices(emu, "train")
        assert entry["conditions"][0]["reason"] == "Unhealthy" and "xid" in entry["conditions"][0]["message"]

        assert (await call(root, run, "unprepare", "train", uid)).claims[uid].error == ""
        await until(lambda: not status_devices(emu, "train"), "our entry removed at unprepare")


async def test_a_failing_status_write_never_fails_the_prepare_and_is_retried(root: Path) -> None:
    nvml = LibNvml([h100(0)])
    async with running_agent(root, [nvidia_backend(root, nvml)]) as run:
        emu = run.emu
        uid = allocate(emu, "infer", "gpu-0")["metadata"]["uid"]
        emu.faults.fail_next(2, status=500, verbs=["patch"], resource="resourceclaims")
        answer = await call(root, run, "prepare", "infer", uid)
        assert answer.claims[uid].error == "" and answer.claims[uid].devices[0].device_name == "gpu-0"
        await until(lambda: status_devices(emu, "infer"), "the entry written after the failures", 20)
        metrics = run.parts.metrics.registry
        errors = metrics.get_sample_value(
            "dra_agent_claim_status_writes_total", {"driver": DRIVER, "result": "error"}
        )
        assert errors == 2


async def test_other_writers_entries_are_kept(root: Path) -> None:
    """Server-side apply with our own field manager touches only our entries."""
    nvml = LibNvml([h100(0)])
    async with running_agent(root, [nvidia_backend(root, nvml)]) as run:
        emu = run.emu
        claim = allocate(emu, "mixed", "gpu-0")
        uid = claim["metadata"]["uid"]
        assert (await call(root, run, "prepare", "mixed", uid)).claims[uid].error == ""
        await until(lambda: status_devices(emu, "mixed"), "our entry")
        assert (await call(root, run, "unprepare", "mixed", uid)).claims[uid].error == ""
        await until(lambda: not status_devices(emu, "mixed"), "our entry removed")
        stored = emu.get("resourceclaims", "mixed", namespace="default") or {}
        assert stored["status"]["allocation"]["devices"]["results"][0]["device"] == "gpu-0"  # untouched
