"""``kill -9`` in the middle of a prepare, then the kubelet's retry (issue 12 point 6e).

The kubelet retries NodePrepareResources when a call fails (the pod's sync retries, see
kubernetes/kubernetes pkg/kubelet/cm/dra/manager.go, PrepareResources); after the agent container
restarts (same pod UID) the retry must succeed, and after unprepare no CDI spec is left behind.
tests/kubelet/test_crash.py kills at every step of one DeviceState; this kills the whole process
as the chart runs it, while the backend is preparing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import grpc
import pytest

from agent.emulator import KubeApiEmulator
from tests.kubelet.grpc_support import V1, grpcio_protos, grpcio_unary
from tests.lifecycle.harness import (
    NVIDIA,
    AgentPod,
    allocated_claim,
    chart_pod,
    fake_values,
    pool_slices,
    until,
)

DEVICE = "gpu-1"


def checkpoints(state: Path) -> str:
    return "".join(p.read_text() for p in state.rglob("checkpoint.json"))


async def test_kill_9_during_prepare_then_the_kubelet_retry_succeeds(
    root: Path, emu: KubeApiEmulator
) -> None:
    kubeconfig = emu.write_kubeconfig(root / "kubeconfig")
    values = fake_values(prepare_latency="2")  # a slow device prepare: the process is killed while it runs
    spec = chart_pod(values, root / "node", kubeconfig=kubeconfig, pod_uid="00000c")
    cdi_root, state = spec.path("CDI_ROOT"), spec.path("DRA_AGENT_STATE_DIR")
    pods = [AgentPod(spec, root / "first.log").start()]
    try:
        await until(lambda: pool_slices(emu, NVIDIA), "the pool")
        dra_socket = Path(await pods[0].register(NVIDIA))
        uid = allocated_claim(emu, "train", DEVICE)["metadata"]["uid"]
        pb = grpcio_protos().v1
        ref = pb.Claim(namespace="default", name="train", uid=uid)

        async def prepare() -> Any:
            request = pb.NodePrepareResourcesRequest(claims=[ref])
            return await grpcio_unary(
                dra_socket, V1 + "NodePrepareResources", request, pb.NodePrepareResourcesResponse, 20.0
            )

        async def interrupted_prepare() -> None:
            with pytest.raises(grpc.aio.AioRpcError):  # the agent died under the call
                await prepare()

        async with anyio.create_task_group() as tg:
            tg.start_soon(interrupted_prepare)
            # The checkpoint records PrepareStarted before the backend is called.
            await until(lambda: uid in checkpoints(state), "PrepareStarted in the checkpoint")
            pods[0].kill()

        # The kubelet restarts the container (same pod UID) and retries the prepare.
        pods.append(AgentPod(spec, root / "second.log").start())
        await pods[1].register(NVIDIA)
        result = (await prepare()).claims[uid]
        assert result.error == "", result.error
        assert list(result.devices[0].cdi_device_ids) == [f"k8s.{NVIDIA}/claim={uid}-{DEVICE}"]
        assert [p.name for p in cdi_root.iterdir()] == [f"k8s.{NVIDIA}-claim_{uid}.yaml"]

        unprepare = pb.NodeUnprepareResourcesRequest(claims=[ref])
        undone = await grpcio_unary(
            dra_socket, V1 + "NodeUnprepareResources", unprepare, pb.NodeUnprepareResourcesResponse
        )
        assert undone.claims[uid].error == ""
        assert list(cdi_root.iterdir()) == [], "an orphaned CDI spec"
        assert "Traceback" not in pods[1].log()
    finally:
        for pod in pods:
            pod.kill()
