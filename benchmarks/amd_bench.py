"""AMD backend overhead against the fake amdsmi: discovery, telemetry and one RAS poll.

Run: ``python -m benchmarks.amd_bench``. The fake answers instantly, so the figures are the
backend's own cost (thread hops, parsing, building and validating devices), not ROCm's.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Awaitable, Callable

import anyio

from agent.core.backend import BackendOptions, HealthEvent
from backends.amd.backend import AmdBackend
from backends.amd.health import HealthMonitor, HealthSettings
from tests.fakes.fake_amdsmi import FakeAmdSmi, FakeGpu, mi250x, mi300x
from tests.support.clock import FakeClock

ROUNDS = 50


async def _time(work: Callable[[], Awaitable[object]]) -> tuple[float, float]:
    samples = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        await work()
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples), max(samples)


async def _bench(label: str, gpus: list[FakeGpu]) -> list[str]:
    fake = FakeAmdSmi(gpus)
    sys.modules["amdsmi"] = fake
    backend = AmdBackend(BackendOptions("bench", None, {"sysfs-root": "/dev/null"}), clock=FakeClock())
    await backend.start()
    devices = await backend.discover()
    disc = await _time(backend.discover)
    tele = await _time(backend.telemetry)

    async def sink(event: HealthEvent) -> None:
        pass

    monitor = HealthMonitor(
        backend._library(), list(backend._discovery.entries.values()), FakeClock(), HealthSettings()
    )
    poll = await _time(lambda: monitor.poll_once(sink))
    await backend.stop()
    return [
        f"{label:<22} {len(devices):>7} {disc[0]:>10.2f} {disc[1]:>9.2f} {tele[0]:>10.2f} {tele[1]:>9.2f}"
        f" {poll[0]:>10.2f} {poll[1]:>9.2f}"
    ]


async def main() -> None:
    print(f"rounds={ROUNDS}; times in ms (median / max)")
    print(
        f"{'fixture':<22} {'devices':>7} {'discover':>10} {'max':>9} {'telemetry':>10} {'max':>9}"
        f" {'ras-poll':>10} {'max':>9}"
    )
    for label, gpus in (
        ("8x MI300X spx_nps1", mi300x("spx_nps1")),
        ("8x MI300X cpx_nps4", mi300x("cpx_nps4")),
        ("8x MI250X GCD", mi250x()),
    ):
        for line in await _bench(label, gpus):
            print(line)


if __name__ == "__main__":
    anyio.run(main)
