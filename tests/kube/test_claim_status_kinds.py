"""Every kind of claim gets a ``status.devices`` entry the API server accepts (issue 31), driven as
the kubelet drives the agent: NodePrepareResources over the plugin's gRPC socket, with the agent
authenticated as the chart's ServiceAccount (its ClusterRole, its token bound to the node) against
the emulator serving 1.36 (consumable capacity, granular status authorization).

Upstream: ``pkg/apis/resource/validation/validation.go`` (``validateDeviceStatus``: an entry must be
an allocated device with its ``shareID``), ``pkg/registry/resource/authz.go``
(``AuthorizedForDeviceStatus``: ``associated-node:patch`` on ``resourceclaims/driver`` for claims
allocated on the writer's node), ``staging/src/k8s.io/api/resource/v1/types.go``
(``AllocatedDeviceStatus``; ``status.devices`` a list-map keyed by driver, device, pool, shareID).

Kinds: memory shares (two claims on one GPU, and two shares of one GPU in one claim), MPS compute
shares, a plain claim on a shareable GPU, static MIG, dynamic MIG (the MIG device's UUID, GPU and
compute instance IDs and parent UUID, known only once created), an AMD partition. A write the
API server refuses (a claim whose allocation names no single node: only ``arbitrary-node`` could
write it) is sent once and never again, health changes included.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from agent.core.backend import Backend, BackendOptions
from agent.demo import DemoOptions, agent_running, demo_config
from agent.emulator import KubeApiEmulator
from agent.kubelet.plugin import socket_paths
from agent.runner import AgentParts
from backends.fake import create_backend
from backends.fake.backend import FakeBackend
from tests.emulator.test_claim_device_status import agent_identity
from tests.kubelet.grpc_support import V1, grpcio_protos, grpcio_unary, short_tmp_dir
from tests.lifecycle.harness import until
from tests.sharing.helpers import gpu_config

NODE = "gpu-node-1"
NVIDIA, AMD = "gpu.nvidia.com", "gpu.amd.com"
TOKEN = "dra-agent-sa-token"
A100_GPU0 = "GPU-b54643b5-70da-1b9e-82ba-3151f1124f17"


@pytest.fixture
def root() -> Iterator[Path]:
    yield from short_tmp_dir()


@dataclass
class Node:
    emu: KubeApiEmulator
    parts: AgentParts
    backend: FakeBackend
    root: Path

    @property
    def driver(self) -> str:
        return self.backend.driver_name

    def writes(self, result: str) -> float:
        value = self.parts.metrics.registry.get_sample_value(
            "dra_agent_claim_status_writes_total", {"driver": self.driver, "result": result}
        )
        return value or 0.0


@asynccontextmanager
async def agent_node(root: Path, profile: str, **settings: str) -> AsyncIterator[Node]:
    """One fake backend's agent on `NODE`, as the chart's ServiceAccount, against a 1.36 API server."""
    async with KubeApiEmulator(version="1.36") as emu:
        emu.add_node(NODE)
        (backend,) = create_backend(
            BackendOptions(
                NODE, settings={"profile": profile, "control": "off", **settings}, state_dir=root / "state"
            )
        )
        assert isinstance(backend, FakeBackend)
        emu.add_identity(TOKEN, agent_identity(NODE, drivers=(backend.driver_name,)))
        kubeconfig = emu.write_kubeconfig(root / "kubeconfig", token=TOKEN)
        config = replace(demo_config(root, kubeconfig, DemoOptions()), node_name=NODE)
        backends: list[Backend] = [backend]
        async with agent_running(config, backends) as parts:
            await until(
                lambda: parts.readiness.ready()[1].get(f"published/{backend.driver_name}", (0,))[0], "slices"
            )
            yield Node(emu, parts, backend, root)


def allocate(
    node: Node,
    name: str,
    results: list[dict[str, Any]],
    *,
    count: int = 1,
    config: Mapping[str, Any] | None = None,
    single_node: bool = True,
) -> str:
    """A claim the scheduler allocated `results` (request ``gpu``) to; returns its UID."""
    exactly: dict[str, Any] = {"deviceClassName": node.driver, "allocationMode": "ExactCount", "count": count}
    devices: dict[str, Any] = {"requests": [{"name": "gpu", "exactly": exactly}]}
    allocation: dict[str, Any] = {
        "devices": {"results": [{"request": "gpu", "pool": NODE, **r} for r in results]}
    }
    if config is not None:
        opaque = {"driver": node.driver, "parameters": dict(config)}
        devices["config"] = [{"opaque": opaque}]
        allocation["devices"]["config"] = [{"source": "FromClaim", "opaque": opaque}]
    if single_node:
        term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [NODE]}]}
        allocation["nodeSelector"] = {"nodeSelectorTerms": [term]}
    claim = node.emu.create(
        "resourceclaims",
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"devices": devices},
        },
    )
    claim["status"] = {"allocation": allocation}
    stored = node.emu.update("resourceclaims", claim, subresource="status")
    return str(stored["metadata"]["uid"])


def result(driver: str, device: str, *, share: bool = False, **consumed: str) -> dict[str, Any]:
    out: dict[str, Any] = {"driver": driver, "device": device}
    if share:
        out["shareID"] = str(uuid.uuid4())
    if consumed:
        out["consumedCapacity"] = consumed
    return out


async def prepare(node: Node, *names: str) -> None:
    """NodePrepareResources for the claims, as the kubelet sends it; every claim must succeed."""
    pb = grpcio_protos().v1
    config = node.parts.config
    dra_socket, _ = socket_paths(node.driver, config.plugins_dir, config.registry_dir)
    claims = []
    for name in names:
        stored = node.emu.get("resourceclaims", name, namespace="default")
        assert stored is not None
        claims.append(pb.Claim(namespace="default", name=name, uid=stored["metadata"]["uid"]))
    request = pb.NodePrepareResourcesRequest(claims=claims)
    answer = await grpcio_unary(
        dra_socket, V1 + "NodePrepareResources", request, pb.NodePrepareResourcesResponse
    )
    errors = {uid: c.error for uid, c in answer.claims.items() if c.error}
    assert not errors, errors


def entries(node: Node, name: str) -> list[dict[str, Any]]:
    claim = node.emu.get("resourceclaims", name, namespace="default") or {}
    return list((claim.get("status") or {}).get("devices") or [])


def results_of(node: Node, name: str) -> list[dict[str, Any]]:
    claim = node.emu.get("resourceclaims", name, namespace="default") or {}
    return list(claim["status"]["allocation"]["devices"]["results"])


async def written(node: Node, name: str, count: int = 1) -> list[dict[str, Any]]:
    """The claim's entries once all `count` are there, each matching one allocation result."""
    found: list[dict[str, Any]] = await until(
        lambda: len(entries(node, name)) == count and entries(node, name), name
    )
    keys = {(r["driver"], r["pool"], r["device"], r.get("shareID")) for r in results_of(node, name)}
    assert {(e["driver"], e["pool"], e["device"], e.get("shareID")) for e in found} == keys
    for entry in found:
        assert [(c["type"], c["status"], c["reason"]) for c in entry["conditions"]] == [
            ("Ready", "True", "Prepared")
        ]
    return found


def allocation_series(node: Node, device: str) -> dict[str, str]:
    for family in node.parts.metrics.registry.collect():
        for sample in family.samples:
            if sample.name == "dra_agent_device_allocation_info" and sample.labels["device"] == device:
                return dict(sample.labels)
    return {}


async def test_shares_a_plain_claim_on_a_shareable_gpu_and_a_refusal_written_once(root: Path) -> None:
    async with agent_node(root, "nvidia-a100-8x", **{"consumable-shares": "memory"}) as node:
        allocate(node, "mem-a", [result(NVIDIA, "gpu-0", share=True, memory="20Gi")])
        allocate(node, "mem-b", [result(NVIDIA, "gpu-0", share=True, memory="20Gi")])
        two = [result(NVIDIA, "gpu-3", share=True, memory="20Gi") for _ in range(2)]
        allocate(node, "two-in-one", two, count=2)
        mps = gpu_config({"strategy": "MPS"})
        allocate(
            node, "cmp-a", [result(NVIDIA, "gpu-1", share=True, memory="20Gi", compute="30")], config=mps
        )
        allocate(
            node, "cmp-b", [result(NVIDIA, "gpu-1", share=True, memory="30Gi", compute="60")], config=mps
        )
        allocate(node, "plain", [result(NVIDIA, "gpu-2", share=True, memory="1Gi", compute="0")])
        allocate(node, "refused", [result(NVIDIA, "gpu-4", share=True, memory="1Gi")], single_node=False)
        await prepare(node, "mem-a", "mem-b", "two-in-one", "cmp-a", "cmp-b", "plain", "refused")

        gpu0 = A100_GPU0
        for name in ("mem-a", "mem-b", "cmp-a", "cmp-b", "plain"):
            (entry,) = await written(node, name)
            assert entry["data"]["productName"] == "NVIDIA A100-SXM4-80GB" and entry["data"][
                "uuid"
            ].startswith("GPU-")
        assert [e["data"]["uuid"] for e in entries(node, "mem-a")] == [gpu0]
        assert len(await written(node, "two-in-one", 2)) == 2

        await until(lambda: node.writes("rejected") == 1, "the refusal counted")
        assert entries(node, "refused") == []
        # A health change rewrites the others' entries, never the refused one's.
        node.backend.injector.inject_now("gpu-4", "xid", "79", driver=NVIDIA)
        node.backend.injector.inject_now("gpu-0", "xid", "79", driver=NVIDIA)

        def unhealthy() -> bool:
            return all(
                e["conditions"][0]["status"] == "False"
                for e in entries(node, "mem-a") + entries(node, "mem-b")
            )

        await until(unhealthy, "gpu-0's shares Ready=False")
        patches = node.emu.requests[("patch", "resourceclaims/status")]
        assert node.writes("rejected") == 1 and node.writes("error") == 0
        assert patches == node.writes("success") + 1  # the refused claim: one write, no retry


async def test_static_mig_names_its_mig_device_and_parent_gpu(root: Path) -> None:
    async with agent_node(root, "nvidia-a100-8x") as node:
        allocate(node, "mig", [result(NVIDIA, "gpu-6-mig-3g40gb-9-0")])
        await prepare(node, "mig")
        (entry,) = await written(node, "mig")
        assert entry["data"] == {
            "uuid": "MIG-bef259f9-ed9c-8984-ea91-351b63810089",
            "pciBusID": "0000:b7:00.0",
            "productName": "NVIDIA A100-SXM4-80GB",
            "parent": "gpu-6",
            "parentUUID": "GPU-1ca71cfc-ee9f-cc24-4889-a129ec3b11a1",
            "gpuInstanceID": 1,
            "computeInstanceID": 0,
            "profile": "3g.40gb",
        }
        series = await until(
            lambda: allocation_series(node, "gpu-6-mig-3g40gb-9-0").get("GPU_I_ID"), "series"
        )
        assert series == "1"
        labels = allocation_series(node, "gpu-6-mig-3g40gb-9-0")
        assert (
            labels["UUID"] == entry["data"]["uuid"] and labels["parent_UUID"] == entry["data"]["parentUUID"]
        )


async def test_dynamic_mig_names_the_mig_device_created_for_the_claim(root: Path) -> None:
    async with agent_node(root, "nvidia-a100-8x", **{"dynamic-mig": "true"}) as node:
        placement = next(
            d.name for d in await node.backend.discover() if d.name.startswith("gpu-0-mig-3g40gb")
        )
        allocate(node, "dyn", [result(NVIDIA, placement)])
        await prepare(node, "dyn")
        (entry,) = await written(node, "dyn")
        data = entry["data"]
        assert data["uuid"].startswith("MIG-") and data["parentUUID"] == A100_GPU0
        assert data["profile"] == "3g.40gb" and data["computeInstanceID"] == 0
        assert isinstance(data["gpuInstanceID"], int) and data["parent"] == "gpu-0"
        labels = await until(
            lambda: allocation_series(node, placement).get("GPU_I_ID") and allocation_series(node, placement),
            "series",
        )
        assert (labels["UUID"], labels["parent_UUID"], labels["GPU_I_ID"]) == (
            data["uuid"],
            A100_GPU0,
            str(data["gpuInstanceID"]),
        )


async def test_an_amd_partition_names_itself_and_its_gpu(root: Path) -> None:
    async with agent_node(root, "amd-mi300x-8x-cpx") as node:
        allocate(node, "part", [result(AMD, "gpu-2-129")])
        await prepare(node, "part")
        (entry,) = await written(node, "part")
        assert entry["data"] == {
            "uuid": "GPU-1668a8f6-e122-299a-24d1-c4d3526ef1e2",
            "pciBusID": "0000:0c:00.1",
            "productName": "AMD_Instinct_MI300X_OAM",
            "parent": "gpu-1-128",
            "pciAddr": "0000:0c:00.1",
            "partitionProfile": "cpx_nps4",
            "parentDeviceID": "147608652460448346",
            "parentPciAddr": "0000:0c:00.0",
        }
