"""Cost of one /metrics scrape with 16 devices, and whether telemetry reads delay prepare calls.

Run: ``python -m benchmarks.scrape_bench``.

Part 1 fills a `Metrics` registry the way a busy node does (16 devices with every telemetry
gauge, claim histograms, gRPC counters) and times the encoding alone and a full HTTP scrape of
`MetricsServer` (aiohttp, encoding in a worker thread), with the body size plain and gzipped.

Part 2 runs a dummy prepare call (an ``anyio.sleep(1 ms)`` standing in for a real prepare's
awaits) in a loop and reports how much longer than 1 ms it takes while, at the same time:
nothing else runs; a `TelemetryPoller` reads a slow backend (200 ms per read, in a worker thread
as the real backends do) every 50 ms; the same plus /metrics scrapes every 10 ms; and, for
contrast, a badly written backend that blocks the event loop for 200 ms per read.
"""

from __future__ import annotations

import gzip
import statistics
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import aiohttp
import anyio
from prometheus_client import generate_latest

from agent.core.backend import ClaimRef, ContainerEdits, DeviceTelemetry, HealthSink
from agent.core.clock import SystemClock
from agent.core.inventory import Inventory
from agent.core.model import Device
from agent.observe.httpserver import MetricsServer
from agent.observe.metrics import Metrics
from agent.observe.readiness import Readiness
from agent.observe.telemetry import TelemetryPoller

DRIVER = "gpu.nvidia.com"
NODE = "gpu-node-1"
DEVICES = 16
ENCODE_ROUNDS = 300
SCRAPE_ROUNDS = 200
PREPARE_SECONDS = 0.001
LOAD_SECONDS = 3.0

Load = Callable[[], Coroutine[Any, Any, None]]


def devices(count: int = DEVICES) -> list[Device]:
    return [
        Device(
            name=f"gpu-{i}",
            driver=DRIVER,
            uuid=f"GPU-{i:08x}-1111-2222-3333-444455556666",
            pci_bus_id=f"0000:{i + 0x10:02x}:00.0",
            product="NVIDIA H100 80GB HBM3",
        )
        for i in range(count)
    ]


def readings(count: int = DEVICES) -> list[DeviceTelemetry]:
    return [
        DeviceTelemetry(
            device=f"gpu-{i}",
            utilization_ratio=0.73,
            memory_used_bytes=41 * 2**30,
            memory_total_bytes=80 * 2**30,
            temperature_celsius=64.0,
            power_watts=512.25,
            ecc_corrected_total=3,
            ecc_uncorrected_total=0,
            last_error_code=0,
        )
        for i in range(count)
    ]


class SlowBackend:
    """Telemetry-only backend: each read takes `seconds`, in a worker thread or (bad) on the loop."""

    def __init__(self, seconds: float, *, block_loop: bool = False) -> None:
        self.seconds = seconds
        self.block_loop = block_loop

    @property
    def driver_name(self) -> str:
        return DRIVER

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def discover(self) -> Sequence[Device]:
        return devices()

    async def monitor_health(self, sink: HealthSink) -> None:
        return None

    async def prepare(self, device: str, claim: ClaimRef) -> ContainerEdits:
        return ContainerEdits()

    async def unprepare(self, device: str, claim: ClaimRef) -> None:
        return None

    async def telemetry(self) -> Sequence[DeviceTelemetry]:
        if self.block_loop:
            time.sleep(self.seconds)  # noqa: ASYNC251 - what a backend must never do
        else:
            await anyio.to_thread.run_sync(time.sleep, self.seconds)
        return readings()


async def busy_metrics() -> tuple[Metrics, Inventory]:
    """A registry as a busy 16-GPU node has it."""
    metrics = Metrics()
    inventory = Inventory(DRIVER)
    inventory.set_devices(devices())
    poller = TelemetryPoller(SlowBackend(0.0), inventory, metrics, node_name=NODE, interval=10.0)
    await poller.poll_once()
    for i in range(200):
        for operation in ("prepare", "unprepare"):
            metrics.claim_latency.labels(DRIVER, operation).observe(0.002 * (i % 50 + 1))
            metrics.claim_operations.labels(DRIVER, operation, "ok").inc()
        metrics.grpc_requests.labels(DRIVER, "v1.NodePrepareResources", "ok").inc()
        metrics.api_writes.labels("resourceslices", "update", "ok").inc()
    metrics.registration_status.labels(DRIVER).set(1)
    metrics.slices_published.labels(DRIVER).set(1)
    return metrics, inventory


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def scrape_cost() -> list[str]:
    metrics, _ = await busy_metrics()
    body = generate_latest(metrics.registry)
    encode = []
    for _ in range(ENCODE_ROUNDS):
        start = time.perf_counter()
        generate_latest(metrics.registry)
        encode.append((time.perf_counter() - start) * 1000)
    server = MetricsServer("127.0.0.1:0", metrics, Readiness())
    http = []
    async with anyio.create_task_group() as tg:
        port = await tg.start(server.run)
        async with aiohttp.ClientSession() as session:
            for _ in range(SCRAPE_ROUNDS):
                start = time.perf_counter()
                async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
                    await response.read()
                http.append((time.perf_counter() - start) * 1000)
        tg.cancel_scope.cancel()
    series = sum(1 for line in body.decode().splitlines() if line and not line.startswith("#"))
    return [
        f"## One scrape, {DEVICES} devices ({series} samples)",
        "",
        "| measure | median | p99 |",
        "|---|---|---|",
        f"| encode (generate_latest) | {statistics.median(encode):.2f} ms "
        f"| {percentile(encode, 0.99):.2f} ms |",
        f"| HTTP GET /metrics (aiohttp, gzip, encode in thread) | {statistics.median(http):.2f} ms "
        f"| {percentile(http, 0.99):.2f} ms |",
        f"| body | {len(body):,} bytes | gzip {len(gzip.compress(body)):,} bytes |",
        "",
    ]


async def prepare_latency(load: Load | None) -> tuple[list[float], int]:
    """Dummy prepare latencies (ms beyond the 1 ms it sleeps) while `load` runs."""
    extra: list[float] = []
    async with anyio.create_task_group() as tg:
        if load is not None:
            tg.start_soon(load)
        await anyio.sleep(0.05)
        deadline = time.perf_counter() + LOAD_SECONDS
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            await anyio.sleep(PREPARE_SECONDS)
            extra.append((time.perf_counter() - start - PREPARE_SECONDS) * 1000)
        tg.cancel_scope.cancel()
    return extra, len(extra)


def poller_load(block_loop: bool, reads: list[int]) -> Load:
    async def load() -> None:
        inventory = Inventory(DRIVER)
        inventory.set_devices(devices())
        poller = TelemetryPoller(
            SlowBackend(0.2, block_loop=block_loop),
            inventory,
            Metrics(),
            node_name=NODE,
            interval=0.05,
            clock=SystemClock(),
        )
        while True:
            await poller.poll_once()
            reads[0] += 1
            await anyio.sleep(poller.interval)

    return load


def with_scrapes(inner: Load, scrapes: list[int]) -> Load:
    async def load() -> None:
        metrics, _ = await busy_metrics()
        server = MetricsServer("127.0.0.1:0", metrics, Readiness())
        async with anyio.create_task_group() as tg:
            tg.start_soon(inner)
            port = await tg.start(server.run)
            async with aiohttp.ClientSession() as session:
                while True:
                    async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
                        await response.read()
                    scrapes[0] += 1
                    await anyio.sleep(0.01)

    return load


async def prepare_delay() -> list[str]:
    rows = [
        f"## Dummy prepare ({PREPARE_SECONDS * 1000:.0f} ms of awaits) during telemetry, "
        f"{LOAD_SECONDS:.0f} s each",
        "",
        "| concurrent load | prepares | extra p50 | extra p99 | extra max | telemetry reads | scrapes |",
        "|---|---|---|---|---|---|---|",
    ]
    cases: list[tuple[str, bool | None, bool]] = [
        ("none", None, False),
        ("telemetry: 200 ms read in a worker thread, every 50 ms", False, False),
        ("same + /metrics scrape every 10 ms", False, True),
        ("contrast: backend blocking the loop 200 ms per read", True, False),
    ]
    for label, block, scrape in cases:
        reads, scrapes = [0], [0]
        load = None if block is None else poller_load(block, reads)
        if load is not None and scrape:
            load = with_scrapes(load, scrapes)
        extra, count = await prepare_latency(load)
        rows.append(
            f"| {label} | {count} | {statistics.median(extra):.3f} ms | {percentile(extra, 0.99):.3f} ms "
            f"| {max(extra):.1f} ms | {reads[0]} | {scrapes[0]} |"
        )
    return rows


async def main() -> None:
    lines = ["# scrape_bench: python -m benchmarks.scrape_bench", ""]
    lines += await scrape_cost()
    lines += await prepare_delay()
    print("\n".join(lines))


if __name__ == "__main__":
    anyio.run(main)
