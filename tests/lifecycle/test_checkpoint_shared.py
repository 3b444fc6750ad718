"""Two agent pods of a rollout share the checkpoint: whole snapshots while both serve, a journal alone.

A surge rollout (or a rollback) runs the new pod next to the old one on the same host paths
(pkg/controller/daemon/update.go, rollingUpdate with maxSurge); both serve the kubelet, serialized
by ``<plugins-dir>/<driver>/serialize.lock`` as the Go helper's ``RollingUpdate`` option does
(k8s.io/dynamic-resource-allocation/kubeletplugin/draplugin.go, ``Serialize``), and the kubelet
sends each call to the most recently registered endpoint it is connected to
(pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go). An agent of a release before the journal reads
only a snapshot, so while another pod's DRA socket accepts connections every write is one; once
the other pod is gone, changes are appended again. Whichever pod serves a call, every claim
prepared by either stays in the checkpoint.
"""

from __future__ import annotations

import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio

from agent.claims.checkpoint.format import decode
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


def claim_ref(emu: KubeApiEmulator, name: str, device: str) -> Any:
    """The kubelet's reference to a claim the scheduler allocated `device` of this node to."""
    claim = allocated_claim(emu, name, device)
    return grpcio_protos().v1.Claim(namespace="default", name=name, uid=claim["metadata"]["uid"])


async def call(socket: Path, method: str, claim: Any) -> str:
    """Prepare or unprepare one claim through `socket`; the claim's error ("" for success)."""
    pb = grpcio_protos().v1
    request, answer = (
        (pb.NodePrepareResourcesRequest, pb.NodePrepareResourcesResponse)
        if method == "NodePrepareResources"
        else (pb.NodeUnprepareResourcesRequest, pb.NodeUnprepareResourcesResponse)
    )
    reply = await grpcio_unary(socket, V1 + method, request(claims=[claim]), answer, 20.0)
    return str(reply.claims[claim.uid].error)


async def test_pods_side_by_side_write_snapshots_and_a_pod_alone_appends(
    root: Path, emu: KubeApiEmulator
) -> None:
    kubeconfig = emu.write_kubeconfig(root / "kubeconfig")
    values = fake_values()
    node = root / "node"

    def pod(uid: str, name: str) -> AgentPod:
        return AgentPod(chart_pod(values, node, kubeconfig=kubeconfig, pod_uid=uid), root / f"{name}.log")

    old = pod("00000d", "old").start()
    pods = [old]
    try:
        await until(lambda: pool_slices(emu, NVIDIA), "the pool")
        old_socket = Path(await old.register(NVIDIA))
        checkpoint = old.spec.path("DRA_AGENT_STATE_DIR") / NVIDIA / "checkpoint.json"

        def lines() -> int:
            return checkpoint.read_bytes().count(b"\n")

        def claims() -> set[str]:
            return set(decode(checkpoint.read_bytes()).entries)

        first = claim_ref(emu, "first", "gpu-0")
        assert await call(old_socket, "NodePrepareResources", first) == ""
        assert lines() > 1  # alone: the snapshot written at start and the prepare's records

        new = pod("00000e", "new").start()
        pods.append(new)
        new_socket = Path(await new.register(NVIDIA))
        second, third = claim_ref(emu, "second", "gpu-1"), claim_ref(emu, "third", "gpu-2")
        assert await call(new_socket, "NodePrepareResources", second) == ""
        assert lines() == 1 and claims() == {first.uid, second.uid}
        assert await call(old_socket, "NodePrepareResources", third) == ""
        assert lines() == 1 and claims() == {first.uid, second.uid, third.uid}
        assert await call(old_socket, "NodeUnprepareResources", second) == ""
        assert lines() == 1 and claims() == {first.uid, third.uid}

        # The old pod exits; alone again, the new one appends (once its last look at the peer is old).
        assert await old.stop(signal.SIGTERM) == 0, old.log()
        spare = claim_ref(emu, "spare", "gpu-3")

        async def prepared_and_appended() -> bool:
            assert await call(new_socket, "NodePrepareResources", spare) == ""
            appended = lines() > 1
            assert await call(new_socket, "NodeUnprepareResources", spare) == ""
            return appended

        await until_async(prepared_and_appended, "appends once the other pod is gone")
        assert claims() == {first.uid, third.uid}
        for claim in (first, third):
            assert await call(new_socket, "NodeUnprepareResources", claim) == ""
        assert claims() == set()
        for agent in pods:
            assert "Traceback" not in agent.log(), agent.log()
    finally:
        for agent in pods:
            agent.kill()


async def until_async(check: Callable[[], Awaitable[bool]], what: str, limit: float = 30.0) -> None:
    """`until` for a check that makes calls of its own."""
    with anyio.move_on_after(limit):
        while not await check():  # noqa: ASYNC110 - the check makes gRPC calls; no event to wait on
            await anyio.sleep(0.05)
        return
    raise AssertionError(f"timed out after {limit:.0f} s waiting for {what}")
