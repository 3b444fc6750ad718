"""Dynamic MIG benchmark: publishing partitionable GPUs and creating MIG devices (pynvml on a
stand-in libnvidia-ml).

For 8 A100-80GB and 8 H100-80GB in MIG mode: the NVIDIA backend's start and discovery (profiles
and placements read through pynvml on a stand-in libnvidia-ml), and the ResourceSlices built
from that for 1.36 and 1.34. Then prepare/unprepare of one dynamic MIG device (GPU instance + compute instance
creation, four journal writes with fsync to a disk directory, the own-mode CDI edits of the new
MIG device; then destruction). The
stand-in answers at once: the driver's own create/destroy time on real hardware is not included.

Run: ``python -m benchmarks.dynamic_mig_bench`` (``--quick`` for fewer rounds).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

from agent.core.backend import BackendOptions, ClaimRef
from agent.kube.pool import build_pool
from backends.nvidia import NvidiaBackend
from tests.fakes.libnvml import MigLibNvml, dynamic_gpu

DISK_DIR = "/var/tmp" if os.path.isdir("/var/tmp") else None
MODELS = {"A100-SXM4-80GB": "NVIDIA A100-SXM4-80GB", "H100 80GB HBM3": "NVIDIA H100 80GB HBM3"}


def backend(fake: MigLibNvml, root: Path) -> NvidiaBackend:
    settings = {
        "cdi-mode": "own",
        "host-root": str(root / "host"),
        "dynamic-mig": "true",
        "dynamic-mig-dir": str(root / "state"),
    }
    return NvidiaBackend(
        BackendOptions("bench-node", None, settings),
        nvml_module=fake.module,
        sysfs_root=root / "sys",
        proc_root=root / "proc",
        dev_root=root / "dev",
    )


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


async def publish_row(model: str, product: str, root: Path, rounds: int) -> list[str]:
    starts, discovers, builds_136, builds_134 = [], [], [], []
    slices: list[dict[str, Any]] = []
    old: list[dict[str, Any]] = []
    devices: Any = ()
    for i in range(rounds):
        fake = MigLibNvml([dynamic_gpu(product, minor) for minor in range(8)])
        nv = backend(fake, root / f"{model[:4]}-{i}")
        t0 = time.perf_counter()
        await nv.start()
        t1 = time.perf_counter()
        devices = await nv.discover()
        t2 = time.perf_counter()
        slices = build_pool(driver=nv.driver_name, node_name="n", node_uid="", devices=devices, taints={})
        t3 = time.perf_counter()
        old = build_pool(
            driver=nv.driver_name,
            node_name="n",
            node_uid="",
            devices=devices,
            taints={},
            minor=34,
            max_devices=128,
        )
        t4 = time.perf_counter()
        await nv.stop()
        starts.append(t1 - t0)
        discovers.append(t2 - t1)
        builds_136.append(t3 - t2)
        builds_134.append(t4 - t3)
    size = len(json.dumps(slices))
    return [
        f"8x {model}",
        str(len(devices)),
        f"{len(slices)} / {len(old)}",
        ms(statistics.median(starts)),
        ms(statistics.median(discovers)),
        ms(statistics.median(builds_136)),
        ms(statistics.median(builds_134)),
        f"{size / 1024:.0f} KiB",
    ]


async def prepare_rows(root: Path, rounds: int) -> list[list[str]]:
    where = root / "prepare"
    (where / "dev").mkdir(parents=True)
    for node in ("nvidiactl", "nvidia0"):
        (where / "dev" / node).touch()
    # The stand-in driver writes the new MIG device's capability file and node, which the edits read.
    fake = MigLibNvml(
        [dynamic_gpu(MODELS["A100-SXM4-80GB"], 0)], proc_root=where / "proc", dev_root=where / "dev"
    )
    nv = backend(fake, where)
    await nv.start()
    await nv.discover()
    prepares, unprepares = [], []
    for i in range(rounds):
        claim = ClaimRef("default", f"c-{i}", f"uid-{i}")
        t0 = time.perf_counter()
        await nv.prepare("gpu-0-mig-3g40gb-9-4", claim)
        t1 = time.perf_counter()
        await nv.unprepare("gpu-0-mig-3g40gb-9-4", claim)
        unprepares.append(time.perf_counter() - t1)
        prepares.append(t1 - t0)
    await nv.stop()
    out = []
    for name, values in (
        ("prepare (create GI + CI, 4 journal writes)", prepares),
        ("unprepare (destroy CI + GI)", unprepares),
    ):
        values.sort()
        out.append(
            [name, ms(values[len(values) // 2]), ms(values[int(len(values) * 0.99) - 1]), str(len(values))]
        )
    return out


async def main(quick: bool) -> None:
    # The test trees have no driver libraries: the backend's warnings about that are not the point.
    logging.getLogger("agent.backends.nvidia").setLevel(logging.ERROR)
    rounds = 3 if quick else 10
    # A disk directory, as /var/lib/dra-agent is on a node: the journal's fsyncs count.
    with tempfile.TemporaryDirectory(prefix="dynmig-bench-", dir=DISK_DIR) as tmp:
        root = Path(tmp)
        print("| GPUs | devices | slices 1.36 / 1.34 | start | discover | build 1.36 | build 1.34 | JSON |")
        print("|---|---|---|---|---|---|---|---|")
        for model, product in MODELS.items():
            print("| " + " | ".join(await publish_row(model, product, root, rounds)) + " |")
        print()
        print("| dynamic MIG device, stand-in libnvidia-ml | p50 | p99 | rounds |")
        print("|---|---|---|---|")
        for row in await prepare_rows(root, 20 if quick else 200):
            print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    anyio.run(main, parser.parse_args().quick)
