"""Kubelet gRPC benchmark: the plugin's sockets as the kubelet sees them.

Serves one driver with `KubeletPlugin` over `DeviceState` (fake backend, nvidia-a100-8x profile,
in-memory claims) and times, through a grpclib client on the unix sockets: ``GetInfo`` on the
registration socket (the kubelet's timeout is 1 s) and a v1 ``NodePrepareResources`` +
``NodeUnprepareResources`` of a 1-device claim, end to end (CDI spec and checkpoint included).

Run: ``python -m benchmarks.grpc_bench`` (``--quick`` for fewer rounds).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import anyio
from grpclib.client import Channel

from agent.claims.state.machine import DeviceState
from agent.core.backend import BackendOptions
from agent.core.inventory import Inventory
from agent.kubelet._protos.k8s.io.kubelet.pkg.apis.dra import v1 as dra_v1
from agent.kubelet._protos.pluginregistration import InfoRequest, RegistrationStub
from agent.kubelet.plugin import KubeletPlugin
from backends.fake import create_backend
from benchmarks.prepare_bench import NODE, MemoryClaims, claim, ms


async def main(rounds: int) -> None:
    backend = create_backend(BackendOptions(NODE, None, {"profile": "nvidia-a100-8x", "control": ""}))[0]
    await backend.start()
    devices = [d.name for d in await backend.discover()]
    claims = MemoryClaims()
    with tempfile.TemporaryDirectory(prefix="dra-grpc-", dir="/tmp") as tmp:
        root = Path(tmp)
        state = DeviceState(
            backend.driver_name,
            backend,
            claims,
            node_name=NODE,
            cdi_root=root / "cdi",
            state_dir=root / "state",
        )
        await state.start()
        plugin = KubeletPlugin(
            backend.driver_name,
            state,
            Inventory(backend.driver_name),
            plugins_dir=root / "plugins",
            registry_dir=root / "registry",
            pool=NODE,
        )
        info: list[float] = []
        prepare: list[float] = []
        unprepare: list[float] = []
        async with anyio.create_task_group() as tg:
            await tg.start(plugin.run)
            async with Channel(path=str(plugin.registration_socket)) as reg_channel:
                registration = RegistrationStub(reg_channel)
                for _ in range(rounds):
                    start = time.perf_counter()
                    await registration.get_info(InfoRequest())
                    info.append(time.perf_counter() - start)
            async with Channel(path=str(plugin.dra_socket)) as channel:
                dra = dra_v1.DraPluginStub(channel)
                for i in range(rounds):
                    obj = claim(i, backend.driver_name, devices[i % len(devices)])
                    await claims.add(obj)
                    meta = obj["metadata"]
                    ref = dra_v1.Claim(namespace=meta["namespace"], uid=meta["uid"], name=meta["name"])
                    start = time.perf_counter()
                    answer = await dra.node_prepare_resources(
                        dra_v1.NodePrepareResourcesRequest(claims=[ref])
                    )
                    prepare.append(time.perf_counter() - start)
                    assert not answer.claims[meta["uid"]].error, answer
                    start = time.perf_counter()
                    await dra.node_unprepare_resources(dra_v1.NodeUnprepareResourcesRequest(claims=[ref]))
                    unprepare.append(time.perf_counter() - start)
            tg.cancel_scope.cancel()
    await backend.stop()
    rows = [
        ("GetInfo, p50", ms(info, 0.5)),
        ("GetInfo, p99", ms(info, 0.99)),
        ("NodePrepareResources (1 claim, 1 device), p50", ms(prepare, 0.5)),
        ("NodePrepareResources (1 claim, 1 device), p99", ms(prepare, 0.99)),
        ("NodeUnprepareResources (1 claim), p50", ms(unprepare, 0.5)),
        ("NodeUnprepareResources (1 claim), p99", ms(unprepare, 0.99)),
    ]
    width = max(len(name) for name, _ in rows)
    print(f"{'measure'.ljust(width)}  value")
    for name, value in rows:
        print(f"{name.ljust(width)}  {value}")
    print(f"({rounds} rounds, grpclib client on the unix sockets, checkpoint fsync included)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="kubelet gRPC benchmark")
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    anyio.run(main, 100 if parser.parse_args().quick else 1000)
