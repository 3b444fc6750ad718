"""NVIDIA health pass benchmark through pynvml on a stand-in libnvidia-ml (issue 23).

Prints, per node: the NVML calls and the CPU time (all threads of the process: the event loop
and the worker thread the pass runs in) of one health pass, and the fault -> condition latency of
a polled check (an uncorrectable ECC counter rise, seen by the next pass) next to an XID event
(woken in the event wait), at the default ``--health-interval`` (5 s) on the real clock.

The stand-in answers each NVML call in microseconds: the CPU figures are the backend's own cost; a
real driver adds its call latency per call (multiply the calls by it).

Run: ``python -m benchmarks.health_pass_bench`` (``--quick``: fewer passes and latency samples).
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import time
from collections.abc import Collection, Sequence

import anyio

from agent.core.backend import DEFAULT_HEALTH_INTERVAL, BackendOptions, HealthEvent
from agent.core.clock import SystemClock
from backends.nvidia import NvidiaBackend
from backends.nvidia.health import HealthMonitor
from tests.fakes.libnvml import XID_CRITICAL, FakeGpu, FakeMig, LibNvml, a100_mig, h100


def h100_node(count: int) -> list[FakeGpu]:
    return [h100(i, f"00000000:{0x10 + i:02x}:00.0") for i in range(count)]


def mig_node(count: int) -> list[FakeGpu]:
    """A100-80GB GPUs in MIG mode, each with seven 1g.10gb MIG devices."""
    gpus = []
    for i in range(count):
        gpu = a100_mig(i, f"00000000:{0x10 + i:02x}:00.0")
        gpu.migs = [
            FakeMig(f"MIG-a100{i:04d}-{start:04d}-0000-0000-000000000000", 7 + start, 0, 19, start, 1)
            for start in range(7)
        ]
        gpus.append(gpu)
    return gpus


class _Quiet:
    """A sink that drops events (the pass's cost without the core's)."""

    async def __call__(self, event: HealthEvent) -> None:
        return None


async def per_pass(gpus: Sequence[FakeGpu], passes: int) -> tuple[int, int, float, float]:
    """Devices, NVML calls per pass, CPU ms per pass (median), wall ms per pass (median)."""
    fake = LibNvml(gpus)
    backend = NvidiaBackend(BackendOptions("bench-node"), nvml_module=fake.module)
    await backend.start()
    devices = await backend.discover()
    nvml = backend._lib()
    monitor = HealthMonitor(nvml, backend._discovery.devices, SystemClock())
    sink = _Quiet()
    await monitor.run_pass(sink)  # the first pass: baselines, unsupported checks found
    calls_before = len(fake.calls)
    cpu: list[float] = []
    wall: list[float] = []
    for _ in range(passes):
        started_cpu, started = time.process_time(), time.perf_counter()
        await monitor.run_pass(sink)
        cpu.append(time.process_time() - started_cpu)
        wall.append(time.perf_counter() - started)
    calls = (len(fake.calls) - calls_before) // passes
    await backend.stop()
    return len(devices), calls, statistics.median(cpu) * 1e3, statistics.median(wall) * 1e3


class _Watch:
    """A sink that signals the first health pass and each event of one condition."""

    def __init__(self, condition: str) -> None:
        self.condition = condition
        self.first_pass = anyio.Event()
        self.seen = anyio.Event()

    async def __call__(self, event: HealthEvent) -> None:
        if event.condition == self.condition:
            self.seen.set()

    def pass_completed(self, devices: Collection[str], failed_checks: Collection[str] = ()) -> None:
        self.first_pass.set()


async def latency(kind: str, samples: int, interval: float) -> list[float]:
    """Seconds from a fault in the stand-in libnvidia-ml to its condition at the sink, on the real clock."""
    gpu = h100(0)
    fake = LibNvml([gpu])
    backend = NvidiaBackend(BackendOptions("bench-node", health_interval=interval), nvml_module=fake.module)
    await backend.start()
    watch = _Watch("xid" if kind == "xid" else "ecc-uncorrectable")
    results: list[float] = []
    # Faults at evenly spread offsets after a pass (shuffled): the interval's whole range, sampled.
    offsets = [(k + 0.5) / samples * interval for k in range(samples)]
    random.Random(23).shuffle(offsets)
    async with anyio.create_task_group() as tg:
        tg.start_soon(backend.monitor_health, watch)
        await watch.first_pass.wait()  # registered for events, ECC baseline read
        for offset in offsets:
            await anyio.sleep(offset)  # each sample starts just after a pass or an event
            watch.seen = anyio.Event()
            started = time.perf_counter()
            if kind == "xid":
                fake.emit(gpu.uuid, XID_CRITICAL, 48)
            else:
                fake.raise_ecc(gpu.uuid, uncorrected=1)
            await watch.seen.wait()
            results.append(time.perf_counter() - started)
        tg.cancel_scope.cancel()
    await backend.stop()
    return results


async def main(quick: bool) -> None:
    logging.disable(logging.CRITICAL)  # the backend's logs of the faults injected here
    passes = 20 if quick else 200
    rows = [
        ("8x H100", await per_pass(h100_node(8), passes)),
        ("8x A100 MIG", await per_pass(mig_node(8), passes)),
    ]
    header = f"{'node':<12} {'devices':>7} {'NVML calls/pass':>15} {'CPU ms/pass':>11} {'wall ms/pass':>12}"
    print(header)
    print("-" * len(header))
    for name, (devices, calls, cpu_ms, wall_ms) in rows:
        print(f"{name:<12} {devices:>7} {calls:>15} {cpu_ms:>11.2f} {wall_ms:>12.2f}")
    print(
        f"({passes} passes each after the first; pynvml on a stand-in libnvidia-ml, "
        "so driver call latency is not included)\n"
    )

    interval = DEFAULT_HEALTH_INTERVAL
    samples = 3 if quick else 8
    header = f"{'fault -> condition':<34} {'samples':>7} {'mean':>9} {'max':>9}"
    print(header)
    print("-" * len(header))
    for label, kind in (
        ("XID event (event wait)", "xid"),
        (f"ECC counter rise (pass, {interval:g} s)", "ecc"),
    ):
        values = await latency(kind, samples, interval)
        mean_ms, max_ms = statistics.mean(values) * 1e3, max(values) * 1e3
        print(f"{label:<34} {len(values):>7} {mean_ms:>7.1f}ms {max_ms:>7.1f}ms")
    print(f"(a polled check is seen by the next pass: within one interval, {interval:g} s; half on average)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description="NVIDIA health pass benchmark (pynvml on a stand-in libnvidia-ml)"
    )
    parser.add_argument("--quick", action="store_true", help="fewer passes and latency samples")
    anyio.run(main, parser.parse_args().quick)
