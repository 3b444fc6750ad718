"""Shared-device prepare benchmark: DeviceState, fake backend (nvidia-a100-8x, consumable-shares=memory).

In one run, the prepare latency (claim GET from memory, checkpoint, backend, CDI spec; p50/p99)
of an exclusive claim and of a share that joins a device another claim already holds: a plain
consumable share, a time-sliced share (the interval already set), and an MPS memory share (the
control daemon already running). Each sample is prepared then unprepared (unprepare not timed).
Separately, the MPS daemon's start cost: prepare of the first MPS share of a GPU (starting the
fake backend's stand-in daemon, a Python process, and waiting for its control pipe), and the
unprepare that stops it. The real ``nvidia-cuda-mps-control`` starts in its own time; the agent's
part (spawn, readiness poll, record) is what this measures.

Run: ``python -m benchmarks.sharing_bench`` (``--quick`` for a shorter run).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio

from agent.claims.state.machine import DeviceState
from agent.core.backend import BackendOptions
from backends.fake import create_backend
from benchmarks.prepare_bench import CDI_PARENT, MemoryClaims, ms, ref

NODE = "bench-node"
DRIVER = "gpu.nvidia.com"
NVIDIA_CONFIG = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"}
TIME_SLICING = {
    **NVIDIA_CONFIG,
    "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}},
}
MPS = {**NVIDIA_CONFIG, "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}}}


def make_claim(
    index: int, device: str, *, shared: bool, config: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    result: dict[str, Any] = {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device}
    if shared:
        result["shareID"] = f"{index:08d}-1111-4000-8000-000000000000"
        result["consumedCapacity"] = {"memory": "8Gi"}
    allocation: dict[str, Any] = {"devices": {"results": [result]}}
    if config is not None:
        allocation["devices"]["config"] = [
            {"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": config}}
        ]
    return {
        "metadata": {
            "namespace": "default",
            "name": f"claim-{index}",
            "uid": f"{index:08d}-0000-4000-8000-000000000000",
        },
        "spec": {"devices": {"requests": [{"name": "gpu"}]}},
        "status": {"allocation": allocation},
    }


async def run(iterations: int) -> list[tuple[str, str, str]]:
    rows: list[tuple[str, str, str]] = []
    with tempfile.TemporaryDirectory() as state_dir, tempfile.TemporaryDirectory(dir=CDI_PARENT) as cdi:
        (backend,) = create_backend(
            BackendOptions(
                NODE,
                settings={"profile": "nvidia-a100-8x", "control": "off", "consumable-shares": "memory"},
                state_dir=Path(state_dir),
            )
        )
        claims = MemoryClaims()
        state = DeviceState(
            DRIVER,
            backend,
            claims,
            node_name=NODE,
            cdi_root=Path(cdi),
            state_dir=Path(state_dir),
            boot_id="bench",
        )
        await state.start()
        index = 0

        async def prepare_unprepare(obj: dict[str, Any]) -> tuple[float, float]:
            await claims.add(obj)
            start = time.perf_counter()
            result = (await state.prepare([ref(obj)]))[obj["metadata"]["uid"]]
            prepared = time.perf_counter()
            if result.error:
                raise RuntimeError(result.error)
            await state.unprepare([ref(obj)])
            return prepared - start, time.perf_counter() - prepared

        cases = [
            ("exclusive claim", "gpu-0", False, None),
            ("consumable share (device already shared)", "gpu-1", True, None),
            ("time-slicing share (interval already set)", "gpu-2", True, TIME_SLICING),
            ("MPS memory share (daemon running)", "gpu-3", True, MPS),
        ]
        holders = []
        for name, device, shared, config in cases:
            if shared:  # a first share holds the device (and its interval or daemon) throughout
                index += 1
                holder = make_claim(index, device, shared=True, config=config)
                await claims.add(holder)
                await state.prepare([ref(holder)])
                holders.append(ref(holder))
            samples = []
            for _ in range(iterations):
                index += 1
                samples.append(
                    (await prepare_unprepare(make_claim(index, device, shared=shared, config=config)))[0]
                )
            rows.append((name, ms(samples, 0.5), ms(samples, 0.99)))
        await state.unprepare(holders)  # stops the daemon of the MPS case
        starts, stops = [], []
        for _ in range(max(5, iterations // 10)):
            index += 1
            start, stop = await prepare_unprepare(make_claim(index, "gpu-4", shared=True, config=MPS))
            starts.append(start)
            stops.append(stop)
        rows.append(("first MPS share: prepare incl. daemon start", ms(starts, 0.5), ms(starts, 0.99)))
        rows.append(("last MPS share: unprepare incl. daemon stop", ms(stops, 0.5), ms(stops, 0.99)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rows = anyio.run(run, 50 if args.quick else 300)
    print("| prepare (fake backend, nvidia-a100-8x) | p50 | p99 |")
    print("|---|---|---|")
    for name, p50, p99 in rows:
        print(f"| {name} | {p50} | {p99} |")


if __name__ == "__main__":
    main()
