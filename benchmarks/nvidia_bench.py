"""NVIDIA backend benchmark (pynvml on a stand-in libnvidia-ml): discovery time and telemetry read
time per GPU.

The stand-in answers each NVML call in microseconds, so these figures are the backend's own cost
(Python, attribute building, validation, worker-thread hops); a real driver adds its call latency
(to be measured on a GPU machine). Nodes: H100s without MIG, A100s with four MIG devices each.

Run: ``python -m benchmarks.nvidia_bench`` (``--quick`` for fewer rounds).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Awaitable, Callable

import anyio

from agent.core.backend import BackendOptions
from backends.nvidia import NvidiaBackend
from tests.fakes.libnvml import FakeGpu, LibNvml, a100_mig, h100


def node(kind: str, count: int) -> list[FakeGpu]:
    make = h100 if kind == "h100" else a100_mig
    return [make(i, f"00000000:{0x10 + i:02x}:00.0") for i in range(count)]


async def timed(rounds: int, call: Callable[[], Awaitable[object]]) -> tuple[float, float]:
    """Median and p99 of `rounds` calls, in seconds."""
    samples: list[float] = []
    for _ in range(rounds):
        started = time.perf_counter()
        await call()
        samples.append(time.perf_counter() - started)
    samples.sort()
    return statistics.median(samples), samples[min(len(samples) - 1, int(len(samples) * 0.99))]


async def measure(kind: str, count: int, rounds: int) -> tuple[str, int, int, float, float, float, float]:
    fake = LibNvml(node(kind, count))
    backend = NvidiaBackend(BackendOptions("bench-node"), nvml_module=fake.module)
    await backend.start()
    devices = await backend.discover()
    discover_p50, discover_p99 = await timed(rounds, backend.discover)
    telemetry_p50, telemetry_p99 = await timed(rounds, backend.telemetry)
    await backend.stop()
    return kind, count, len(devices), discover_p50, discover_p99, telemetry_p50, telemetry_p99


async def main(quick: bool) -> None:
    rounds = 20 if quick else 200
    rows = [await measure(kind, count, rounds) for kind in ("h100", "a100-mig") for count in (1, 8, 64)]
    header = (
        f"{'node':<10} {'GPUs':>4} {'devices':>7} {'discover p50':>12} {'p99':>8} {'per GPU':>8}"
        f" {'telemetry p50':>13} {'p99':>8} {'per GPU':>8}"
    )
    print(header)
    print("-" * len(header))
    for kind, count, devices, d50, d99, t50, t99 in rows:
        print(
            f"{kind:<10} {count:>4} {devices:>7} {d50 * 1e3:>10.2f}ms {d99 * 1e3:>6.2f}ms"
            f" {d50 / count * 1e6:>6.0f}us {t50 * 1e3:>11.2f}ms {t99 * 1e3:>6.2f}ms"
            f" {t50 / count * 1e6:>6.0f}us"
        )
    print(f"\n({rounds} rounds each; pynvml on a stand-in libnvidia-ml: no driver call latency)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="NVIDIA backend benchmark (stand-in libnvidia-ml)")
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    anyio.run(main, parser.parse_args().quick)
