"""Fault -> published taint, end to end, for an event and for polled checks (issue 23).

The whole agent (`agent.demo.agent_running`: backends, health tracker, slice publisher, kubelet
sockets) runs the NVIDIA backend through pynvml on a stand-in libnvidia-ml (8 H100s) against the
API emulator, with the
default ``--health-interval`` (5 s) and a 1 s hold. Each round faults one GPU and times how long
until its taint is in the emulator's ResourceSlice: an XID event (the event wait wakes), an
uncorrectable ECC counter rise with no event (the next health pass), and a GPU lost with no event
(the next pass). The fault is injected at a random moment of the pass cycle, as real faults are.

Run: ``python -m benchmarks.health_latency_bench`` (``--rounds N``, default 8 per kind;
``--quick``: 2).
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio

from agent.demo import DemoOptions, agent_running, demo_config
from agent.emulator import KubeApiEmulator
from backends.nvidia import NvidiaBackend
from tests.fakes.libnvml import XID_CRITICAL, LibNvml, h100
from tests.test_agent_e2e import NODE, nvidia_backend

DRIVER = "gpu.nvidia.com"
GPUS = 8


def taint_keys(emu: KubeApiEmulator, device: str) -> set[str]:
    keys: set[str] = set()
    for item in emu.list("resourceslices"):
        for entry in item["spec"].get("devices", []):
            if entry["name"] == device:
                keys.update(t["key"] for t in entry.get("taints", []))
    return keys


def untainted(emu: KubeApiEmulator, device: str) -> bool:
    return not taint_keys(emu, device)


def tainted(emu: KubeApiEmulator, device: str, key: str) -> bool:
    return key in taint_keys(emu, device)


async def wait_for(check: Callable[[], Any], limit: float = 30.0) -> None:
    with anyio.fail_after(limit):
        while not check():  # noqa: ASYNC110 (the emulator's store has no event to wait on)
            await anyio.sleep(0.005)


async def measure(rounds: int) -> dict[str, list[float]]:
    nvml = LibNvml([h100(i, f"00000000:{0x10 + i:02x}:00.0") for i in range(GPUS)])
    kinds = ("XID event", "ECC counter rise (pass)", "GPU lost, no event (pass)")
    results: dict[str, list[float]] = {kind: [] for kind in kinds}
    with tempfile.TemporaryDirectory(prefix="hl-", dir="/tmp") as tmp:
        root = Path(tmp)
        backend: NvidiaBackend = nvidia_backend(root, nvml)
        async with KubeApiEmulator(version="1.34", feature_gates={"DRADeviceTaints": True}) as emu:
            emu.add_node(NODE)
            config = replace(
                demo_config(root, emu.write_kubeconfig(root / "kubeconfig"), DemoOptions()),
                node_name=NODE,
                taint_hold_seconds=1.0,
            )
            async with agent_running(config, [backend]):
                await wait_for(lambda: emu.list("resourceslices"))
                for round_ in range(rounds):
                    for kind, key in (
                        ("XID event", "xid"),
                        ("ECC counter rise (pass)", "ecc-uncorrectable"),
                        ("GPU lost, no event (pass)", "gpu-lost"),
                    ):
                        index = (round_ * 3 + len(results[kind])) % GPUS
                        gpu, device = nvml.gpus[index], f"gpu-{index}"
                        await wait_for(functools.partial(untainted, emu, device))
                        await anyio.sleep(random.uniform(0, 5.0))  # a random moment of the pass cycle
                        started = time.monotonic()
                        if key == "xid":
                            nvml.emit(gpu.uuid, XID_CRITICAL, data=79)
                        elif key == "ecc-uncorrectable":
                            nvml.raise_ecc(gpu.uuid, uncorrected=1)
                        else:
                            nvml.lose(gpu.uuid, event=False)
                        full = f"{DRIVER}/{key}"
                        await wait_for(functools.partial(tainted, emu, device, full))
                        results[kind].append(time.monotonic() - started)
                        if key == "gpu-lost":
                            gpu.lost = False  # back after a reset: asked again every recovery-interval
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="2 rounds")
    args = parser.parse_args()
    results = anyio.run(measure, 2 if args.quick else args.rounds)
    print(f"{'fault -> taint in the API server':34} {'n':>3} {'p50':>9} {'mean':>9} {'max':>9}")
    print("-" * 68)
    for kind, samples in results.items():
        print(
            f"{kind:34} {len(samples):>3} {statistics.median(samples) * 1000:>7.0f}ms "
            f"{statistics.mean(samples) * 1000:>7.0f}ms {max(samples) * 1000:>7.0f}ms"
        )
    print(
        "(8 stand-in H100s, --health-interval 5, hold 1 s, API emulator; "
        "faults at random moments of the cycle)"
    )


if __name__ == "__main__":
    main()
