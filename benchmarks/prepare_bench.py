"""Claim preparation benchmark: DeviceState with the fake backend (nvidia-a100-8x profile).

Measures prepare latency of a 1-device claim including the claim GET (p50/p99), unprepare
latency, and 100 claims prepared concurrently (one call with 100 claims, and 100 concurrent
one-claim calls as 100 pods would make), with an in-memory ClaimSource and, when the API
emulator is installed, through the emulator over HTTP. The checkpoint goes to a disk directory
(fsync included); the CDI root is on a tmpfs (``/dev/shm``) as ``/var/run/cdi`` is on a node.

Run: ``python -m benchmarks.prepare_bench`` (``--quick`` for a shorter run).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio

from agent.claims.preparer import ClaimSource
from agent.claims.state.machine import DeviceState
from agent.core.backend import Backend, BackendOptions, ClaimRef
from agent.core.errors import KubeApiError
from backends.fake import create_backend

NODE = "bench-node"
NAMESPACE = "default"
# The CDI root of a node (/var/run/cdi) is a tmpfs.
CDI_PARENT = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"


class MemoryClaims:
    """An in-memory ClaimSource."""

    def __init__(self) -> None:
        self.claims: dict[tuple[str, str], Mapping[str, Any]] = {}

    async def add(self, claim: Mapping[str, Any]) -> None:
        self.claims[(claim["metadata"]["namespace"], claim["metadata"]["name"])] = claim

    async def get_resource_claim(self, namespace: str, name: str) -> Mapping[str, Any]:
        try:
            return self.claims[(namespace, name)]
        except KeyError:
            raise KubeApiError(f"{name} not found", status=404) from None


def claim(index: int, driver: str, device: str) -> dict[str, Any]:
    uid = f"{index:08d}-0000-4000-8000-000000000000"
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": NAMESPACE, "name": f"claim-{index}", "uid": uid},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu"}}]}},
        "status": {
            "allocation": {
                "devices": {"results": [{"request": "gpu", "driver": driver, "pool": NODE, "device": device}]}
            }
        },
    }


def ref(obj: Mapping[str, Any]) -> ClaimRef:
    meta = obj["metadata"]
    return ClaimRef(meta["namespace"], meta["name"], meta["uid"])


def ms(values: Sequence[float], q: float) -> str:
    ordered = sorted(values)
    return f"{ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000:.2f} ms"


async def timed(call: Callable[[], Awaitable[object]]) -> float:
    start = time.perf_counter()
    await call()
    return time.perf_counter() - start


AddClaim = Callable[[Mapping[str, Any]], Awaitable[None]]


async def measure(
    label: str,
    source: ClaimSource,
    add: AddClaim,
    iterations: int,
    out: list[tuple[str, str]],
    *,
    state_parent: str,
) -> None:
    backend: Backend = create_backend(
        BackendOptions(NODE, settings={"profile": "nvidia-a100-8x", "control": "off"})
    )[0]
    devices = [d.name for d in await backend.discover()]
    driver = backend.driver_name
    with (
        tempfile.TemporaryDirectory(dir=state_parent) as state_dir,
        tempfile.TemporaryDirectory(dir=CDI_PARENT) as cdi,
    ):
        state = DeviceState(
            driver, backend, source, node_name=NODE, cdi_root=Path(cdi), state_dir=Path(state_dir)
        )
        await state.start()
        prepare: list[float] = []
        unprepare: list[float] = []
        for i in range(iterations):
            obj = claim(i, driver, devices[i % len(devices)])
            await add(obj)
            prepare.append(await timed(lambda o=obj: state.prepare([ref(o)])))  # type: ignore[misc]
            unprepare.append(await timed(lambda o=obj: state.unprepare([ref(o)])))  # type: ignore[misc]
        out.append((f"{label}: prepare 1-device claim incl. GET, p50", ms(prepare, 0.5)))
        out.append((f"{label}: prepare 1-device claim incl. GET, p99", ms(prepare, 0.99)))
        out.append((f"{label}: unprepare 1 claim, p50", ms(unprepare, 0.5)))
        out.append((f"{label}: unprepare 1 claim, p99", ms(unprepare, 0.99)))

        batch = [claim(100_000 + i, driver, devices[i % len(devices)]) for i in range(100)]
        for obj in batch:
            await add(obj)
        one_call = await timed(lambda: state.prepare([ref(o) for o in batch]))
        undo = await timed(lambda: state.unprepare([ref(o) for o in batch]))
        out.append((f"{label}: 100 claims in one prepare call (total)", f"{one_call * 1000:.1f} ms"))
        out.append((f"{label}: 100 claims in one unprepare call (total)", f"{undo * 1000:.1f} ms"))

        async def hundred_calls() -> None:
            async with anyio.create_task_group() as tg:
                for obj in batch:
                    tg.start_soon(state.prepare, [ref(obj)])

        concurrent = await timed(hundred_calls)
        out.append((f"{label}: 100 concurrent 1-claim prepare calls (total)", f"{concurrent * 1000:.1f} ms"))
        assert len(state.prepared_claims()) == 100
        await state.unprepare([ref(o) for o in batch])


async def with_emulator(iterations: int, out: list[tuple[str, str]], state_parent: str) -> None:
    try:
        from agent.emulator import KubeApiEmulator
        from agent.kube.client import KubeClient
    except ImportError as error:
        out.append(("emulator over HTTP", f"skipped ({error})"))
        return
    async with AsyncExitStack() as stack:
        emu: Any = await stack.enter_async_context(KubeApiEmulator(version="1.34"))
        kube = KubeClient.from_configuration(emu.configuration())
        stack.push_async_callback(kube.close)
        await kube.discover()
        base = f"/apis/resource.k8s.io/{kube.slice_version}/namespaces/{NAMESPACE}/resourceclaims"

        async def add(obj: Mapping[str, Any]) -> None:
            body = {k: v for k, v in obj.items() if k != "status"}
            body["metadata"] = {"name": obj["metadata"]["name"], "namespace": NAMESPACE}
            created = await kube.request("POST", base, body=body)
            created["status"] = obj["status"]
            await kube.request("PUT", f"{base}/{obj['metadata']['name']}/status", body=created)
            obj["metadata"]["uid"] = created["metadata"]["uid"]  # the server assigns the UID

        await measure("emulator (HTTP)", kube, add, iterations, out, state_parent=state_parent)


async def main(quick: bool, state_parent: str) -> None:
    iterations = 100 if quick else 1000
    out: list[tuple[str, str]] = []
    memory = MemoryClaims()
    await measure("in-memory source", memory, memory.add, iterations, out, state_parent=state_parent)
    try:
        await with_emulator(iterations // 2, out, state_parent)
    except Exception as error:  # the emulator is optional here; report why it did not run
        out.append(("emulator over HTTP", f"failed: {type(error).__name__}: {error}"))
    width = max(len(k) for k, _ in out)
    print(f"{'measurement':<{width}}  value")
    print("-" * (width + 14))
    for key, value in out:
        print(f"{key:<{width}}  {value}")
    print(
        f"\n({iterations} sequential prepare+unprepare iterations in memory, {iterations // 2} via the "
        f"emulator; checkpoint under {state_parent}, fsync included)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Claim preparation benchmark")
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    parser.add_argument(
        "--state-parent", default="/tmp", help="directory for the checkpoint (a disk, as /var/lib/kubelet is)"
    )
    args = parser.parse_args()
    anyio.run(main, args.quick, args.state_parent)
