"""Per-device claim status (issue 25; KEP-4817 ``status.devices``, GA in 1.37): after a prepare the
claim says which physical GPU it holds and whether it is healthy; an unprepare removes our entry;
a write that fails never fails the prepare and is retried, unless the API server refused it for
good (issue 31: 4xx but 401, 404, 408, 409, 429), which is counted and not sent again.

Upstream: the list-map keys of ``status.devices`` (driver, device, pool, shareID) and its ``data`` /
``conditions`` (staging/src/k8s.io/api/resource/v1/types.go, AllocatedDeviceStatus), its validation
(pkg/apis/resource/validation/validation.go, validateDeviceStatus: only allocated devices, with
their shareID), and
server-side apply ownership per field manager (staging/src/k8s.io/apimachinery/pkg/util/managedfields).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from agent.core.backend import ClaimRef
from agent.core.clock import SystemClock
from agent.core.errors import KubeApiError
from agent.core.inventory import Inventory
from agent.core.model import Device
from agent.emulator import KubeApiEmulator
from agent.kube.claimstatus import ClaimStatusWriter, StatusTarget
from agent.kubelet.plugin import socket_paths
from agent.observe.metrics import Metrics
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


async def test_the_prepare_answers_while_its_status_write_hangs(root: Path) -> None:
    """The write is not part of the call: the answer comes with the write still in flight."""
    nvml = LibNvml([h100(0)])
    async with running_agent(root, [nvidia_backend(root, nvml)]) as run:
        emu = run.emu
        emu.faults.slow["resourceclaims/status"] = 3600.0
        uid = allocate(emu, "stuck", "gpu-0")["metadata"]["uid"]
        answer = await call(root, run, "prepare", "stuck", uid)
        assert answer.claims[uid].error == "" and answer.claims[uid].devices[0].device_name == "gpu-0"
        await until(lambda: emu.requests[("patch", "resourceclaims/status")] == 1, "the write sent, hanging")
        assert status_devices(emu, "stuck") == []


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


# -- the writer alone: what it does with each answer -------------------------------------------------

REF = ClaimRef("default", "c", "00000000-0000-4000-8000-000000000001")


class Answers:
    """The API as the writer sees it: each call answered by the next error (or accepted)."""

    def __init__(self, *errors: KubeApiError | None) -> None:
        self.errors = list(errors)
        self.bodies: list[Mapping[str, Any]] = []

    async def apply_claim_status(
        self, namespace: str, name: str, body: Mapping[str, Any], *, field_manager: str
    ) -> dict[str, Any]:
        self.bodies.append(body)
        error = self.errors.pop(0) if self.errors else None
        if error is not None:
            raise error
        return {}


def writer_for(answers: Answers, metrics: Metrics) -> ClaimStatusWriter:
    inventory = Inventory(DRIVER)
    inventory.set_devices([Device("gpu-0", DRIVER, uuid="GPU-1")])

    async def api() -> Answers:
        return answers

    targets = {REF: [StatusTarget(NODE, "gpu-0", "9b1f0f7e-6c1b-4a53-8f0e-2f8a3c1f2d4e")]}
    return ClaimStatusWriter(
        DRIVER, NODE, inventory, api, clock=SystemClock(), metrics=metrics, targets=lambda r: targets[r]
    )


def count(metrics: Metrics, result: str) -> float:
    value = metrics.registry.get_sample_value(
        "dra_agent_claim_status_writes_total", {"driver": DRIVER, "result": result}
    )
    return value or 0.0


@pytest.mark.parametrize("status", [400, 403, 422])
async def test_a_refusal_is_logged_once_counted_and_not_sent_again_until_prepared_again(
    status: int, caplog: pytest.LogCaptureFixture
) -> None:
    message = f"{status} Invalid: status.devices[0]: must be an allocated device in the claim"
    answers, metrics = Answers(KubeApiError(message, status)), Metrics()
    writer = writer_for(answers, metrics)
    writer.prepared_changed(DRIVER, {REF: ("gpu-0",)}, ())
    assert await writer.write(REF)  # done with: no retry
    assert await writer.write(REF)
    assert len(answers.bodies) == 1 and count(metrics, "rejected") == 1 and count(metrics, "error") == 0
    assert answers.bodies[0]["status"]["devices"][0]["shareID"] == "9b1f0f7e-6c1b-4a53-8f0e-2f8a3c1f2d4e"
    assert [r.message for r in caplog.records if message in str(getattr(r, "fields", ""))] == [
        "the API server refused the claim's device status; not retrying until the claim is prepared "
        "again or the agent restarts (the claim stays prepared)"
    ]

    writer.prepared_changed(DRIVER, {REF: ("gpu-0",)}, ())  # the claim prepared again: one more try
    assert await writer.write(REF)
    assert len(answers.bodies) == 2 and count(metrics, "success") == 1
    writer.prepared_changed(DRIVER, {}, (REF,))
    assert await writer.write(REF)
    assert answers.bodies[-1]["status"]["devices"] == []  # removed at unprepare as before


@pytest.mark.parametrize("status", [0, 401, 408, 429, 500, 503])
async def test_other_failures_are_retried(status: int) -> None:
    answers, metrics = Answers(KubeApiError("failed", status)), Metrics()
    writer = writer_for(answers, metrics)
    writer.prepared_changed(DRIVER, {REF: ("gpu-0",)}, ())
    assert not await writer.write(REF)  # the run loop retries with backoff
    assert await writer.write(REF)
    assert (count(metrics, "error"), count(metrics, "success"), count(metrics, "rejected")) == (1, 1, 0)


@pytest.mark.parametrize("status", [404, 409])
async def test_a_claim_gone_is_forgotten(status: int) -> None:
    answers, metrics = Answers(KubeApiError("gone", status)), Metrics()
    writer = writer_for(answers, metrics)
    writer.prepared_changed(DRIVER, {REF: ("gpu-0",)}, ())
    assert await writer.write(REF)
    assert count(metrics, "gone") == 1 and count(metrics, "error") == 0


async def test_a_claim_unprepared_before_its_first_write_costs_no_write() -> None:
    answers, metrics = Answers(), Metrics()
    writer = writer_for(answers, metrics)
    writer.prepared_changed(DRIVER, {REF: ("gpu-0",)}, ())
    writer.prepared_changed(DRIVER, {}, (REF,))  # within the writer's settle time
    assert await writer.write(REF)
    assert answers.bodies == []
