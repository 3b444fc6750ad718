"""Registration first, with the whole agent: a slow API server does not hold back the kubelet sockets.

After a crash the kubelet waits for the plugin's registration socket, then retries its prepares
(pkg/kubelet/pluginmanager/ watches the registry directory; pkg/kubelet/cm/dra/manager.go retries
NodePrepareResources). The start-up reconcile reads every checkpointed claim from the API server,
so the sockets must not wait for those reads: `GetInfo` answers while they are in flight, and a
prepare of the already prepared claim is answered once they are done.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import pytest

from agent import cli
from agent.app import Agent
from agent.config import AgentConfig
from agent.core.clock import SystemClock
from agent.demo import DemoOptions, agent_running, demo_config
from agent.emulator import KubeApiEmulator
from agent.health.taints import TaintPolicy
from agent.kube.client import KubeClient
from agent.kubelet.plugin import socket_paths
from agent.observe.metrics import Metrics
from agent.observe.readiness import Readiness
from agent.runner import AgentParts
from tests.kube.harness import eventually
from tests.kubelet.grpc_support import GET_INFO, V1, grpcio_protos, grpcio_unary, short_tmp_dir

NODE = "node-1"
DRIVER = "gpu.nvidia.com"
API_LATENCY = 3.0
"""Each API request's delay in the second start: far longer than serving the sockets takes."""


@pytest.fixture
def root() -> Iterator[Path]:
    yield from short_tmp_dir()


def allocated_claim(emu: KubeApiEmulator, name: str, device: str) -> str:
    claim = emu.create(
        "resourceclaims",
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu"}}]}},
        },
    )
    result = {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device}
    claim["status"] = {"allocation": {"devices": {"results": [result]}}}
    emu.update("resourceclaims", claim, subresource="status")
    return str(claim["metadata"]["uid"])


async def prepare(dra_socket: Path, name: str, uid: str) -> Any:
    pb = grpcio_protos().v1
    request = pb.NodePrepareResourcesRequest(claims=[pb.Claim(namespace="default", name=name, uid=uid)])
    return await grpcio_unary(
        dra_socket, V1 + "NodePrepareResources", request, pb.NodePrepareResourcesResponse, seconds=30
    )


async def wait_for(path: Path) -> None:
    with anyio.fail_after(20):
        while not await anyio.Path(path).exists():  # noqa: ASYNC110 - a file appearing has no event
            await anyio.sleep(0.005)


async def first_run(emu: KubeApiEmulator, root: Path) -> tuple[AgentConfig, Path, Path, str]:
    """The agent's first run: claim ``train`` prepared and checkpointed; its config, DRA and
    registration sockets and the claim's UID."""
    emu.add_node(NODE)
    config = demo_config(root, emu.write_kubeconfig(root / "kubeconfig"), DemoOptions())
    config = replace(config, node_name=NODE)
    dra_socket, registration = socket_paths(DRIVER, config.plugins_dir, config.registry_dir)
    uid = allocated_claim(emu, "train", "gpu-0")
    async with agent_running(config):
        await wait_for(registration)
        assert (await prepare(dra_socket, "train", uid)).claims[uid].error == ""
    return config, dra_socket, registration, uid


async def test_sockets_serve_while_the_start_up_reconcile_waits_for_the_api(root: Path) -> None:
    protos = grpcio_protos()
    async with KubeApiEmulator(version="1.34") as emu:
        config, dra_socket, registration, uid = await first_run(emu, root)

        # Restart with a slow API server: the reconcile's read of the claim takes API_LATENCY.
        async with agent_running(config) as parts:
            emu.faults.latency = API_LATENCY
            await wait_for(registration)
            info = await grpcio_unary(
                registration, GET_INFO, protos.registration.InfoRequest(), protos.registration.PluginInfo
            )
            assert info.endpoint == str(dra_socket)
            # Served before the claim state is ready: the reconcile is still waiting for the API.
            assert not parts.plugins[DRIVER].dra.preparer_ready()
            emu.faults.latency = 0.0
            answer = await prepare(dra_socket, "train", uid)
            assert answer.claims[uid].error == ""
            assert [d.device_name for d in answer.claims[uid].devices] == ["gpu-0"]


async def test_a_prepare_before_the_api_client_is_connected_waits_for_it(root: Path) -> None:
    """``dra-agent run`` connects the API client only once the kubelet sockets serve.

    A prepare that the kubelet sends in between (it calls NodePrepareResources as soon as the
    plugin is registered: pkg/kubelet/cm/dra/manager.go) is answered once the client is
    connected, not failed for the missing client.
    """
    protos = grpcio_protos()
    async with KubeApiEmulator(version="1.34") as emu:
        emu.add_node(NODE)
        config = replace(
            demo_config(root, emu.write_kubeconfig(root / "kubeconfig"), DemoOptions()), node_name=NODE
        )
        dra_socket, registration = socket_paths(DRIVER, config.plugins_dir, config.registry_dir)
        uid = allocated_claim(emu, "train", "gpu-0")
        gate = anyio.Event()
        clients: list[KubeClient] = []

        async def connect() -> KubeClient:
            await gate.wait()
            clients.append(await KubeClient.connect(config.kube_mode, config.kubeconfig))
            return clients[0]

        metrics, readiness = Metrics(), Readiness()
        parts = AgentParts(
            config,
            kube=None,
            connect=connect,
            metrics=metrics,
            readiness=readiness,
            clock=SystemClock(),
            policy=TaintPolicy.default(),
        )
        agent = Agent(config, metrics=metrics, clock=SystemClock(), parts=parts, readiness=readiness)
        answers: list[Any] = []

        async def kubelet() -> None:
            answers.append(await prepare(dra_socket, "train", uid))

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(agent.run)
                tg.start_soon(parts.connect_api)
                await wait_for(registration)
                info = await grpcio_unary(
                    registration, GET_INFO, protos.registration.InfoRequest(), protos.registration.PluginInfo
                )
                assert info.endpoint == str(dra_socket)
                tg.start_soon(kubelet)
                assert parts.api is not None
                await eventually(lambda: parts.api is not None and parts.api.reads_waiting > 0)
                assert not answers and parts.kube is None
                gate.set()
                await eventually(lambda: bool(answers), within=20)
                assert answers[0].claims[uid].error == ""
                assert [d.device_name for d in answers[0].claims[uid].devices] == ["gpu-0"]
                tg.cancel_scope.cancel()
        finally:
            for client in clients:
                await client.close()


def test_a_bad_kubeconfig_still_ends_the_agent_with_one_line(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The client connects after the kubelet sockets serve, but a bad kubeconfig file still ends
    ``dra-agent run`` before anything starts: one line on stderr, no logs of started parts."""
    kubeconfig = root / "kubeconfig"
    kubeconfig.write_text("garbage: [\n")
    # fmt: off
    code = cli.main([
        "run", "--node-name", NODE, "--kube", "kubeconfig", "--kubeconfig", str(kubeconfig),
        "--backend", "fake:profile=nvidia-a100-8x,control=off",
        "--registry-dir", str(root / "registry"), "--plugins-dir", str(root / "plugins"),
        "--cdi-root", str(root / "cdi"), "--state-dir", str(root / "state"),
        "--metrics-address", "127.0.0.1:0",
    ])
    # fmt: on
    assert code == cli.EXIT_USAGE
    assert capsys.readouterr().err.splitlines() == [
        f"dra-agent: error: invalid value '{kubeconfig}' for --kubeconfig: expected a kubeconfig YAML file; "
        "it is not valid YAML at line 2 (did not find expected node content)"
    ]
