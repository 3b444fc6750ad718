"""The AMD backend through AMD's real amdsmi binding over the stand-in libamd_smi.so.

Run: ``python -m benchmarks.amd_bench``. The stand-in answers at once, so the figures are the
backend's and the binding's own cost (ctypes, thread hops, parsing, devices), not the driver's:

- discovery, telemetry and one health pass (ms, median and max over `ROUNDS`);
- per health pass: library calls and CPU (process time of every thread), on 8 MI300X in SPX and
  in CPX (64 partitions);
- latency from a GPU reset event to the device's taint (the tracker marking it unhealthy), and
  from a GPU falling off to ``gpu-lost`` (with ``poll-interval`` 1 s: a pass every second).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Awaitable, Callable

import anyio

from agent.core.backend import BackendOptions, HealthEvent
from agent.core.clock import SystemClock
from agent.core.inventory import Inventory
from agent.core.model import HealthStatus
from agent.health.tracker import HealthTracker
from backends.amd.backend import AmdBackend
from backends.amd.health import HealthMonitor, HealthSettings
from tests.fakes.amd_standin import GpuSpec, StandIn, load, mi250x, mi300x
from tests.support.clock import FakeClock

ROUNDS = 50
LATENCY_ROUNDS = 10


async def _time(work: Callable[[], Awaitable[object]]) -> tuple[float, float]:
    samples = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        await work()
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples), max(samples)


async def _costs(standin: StandIn, label: str, gpus: list[GpuSpec]) -> str:
    standin.configure(gpus)
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
    await monitor.poll_once(sink)  # the ECC baseline
    calls, cpu = standin.calls("*"), time.process_time()
    poll = await _time(lambda: monitor.poll_once(sink))
    per_pass_calls = (standin.calls("*") - calls) / ROUNDS
    per_pass_cpu = (time.process_time() - cpu) * 1000 / ROUNDS
    await backend.stop()
    return (
        f"{label:<20} {len(devices):>7} {disc[0]:>9.2f} {disc[1]:>8.2f} {tele[0]:>9.2f} {tele[1]:>8.2f}"
        f" {poll[0]:>9.2f} {poll[1]:>8.2f} {per_pass_calls:>10.0f} {per_pass_cpu:>11.2f}"
    )


async def _latency(standin: StandIn, what: str) -> tuple[float, float]:
    """Median and max seconds from the fault to the tracker's verdict, over `LATENCY_ROUNDS`."""
    samples: list[float] = []
    for _ in range(LATENCY_ROUNDS):
        gpus = standin.configure(mi300x(count=8)).gpus
        settings = {"sysfs-root": "/dev/null", "poll-interval": "1"}
        backend = AmdBackend(BackendOptions("bench", None, settings), clock=SystemClock())
        await backend.start()
        inventory = Inventory(backend.driver_name)
        inventory.set_devices(await backend.discover())
        tracker = HealthTracker(inventory, SystemClock(), hold_seconds=60)
        async with anyio.create_task_group() as tg:
            tg.start_soon(backend.monitor_health, tracker.handle)
            while standin.event_mask(7) == 0:  # noqa: ASYNC110 (the readers open in a worker thread)
                await anyio.sleep(0.01)
            await anyio.sleep(0.3)  # mid-interval: the fault lands between passes
            start = time.perf_counter()
            if what == "reset":
                standin.push_event(7, "GPU_PRE_RESET")
            else:
                gpus[7].lost = True
            seen = inventory.version
            while inventory.devices()[7].health.status is not HealthStatus.UNHEALTHY:
                seen = await inventory.wait_changed(seen)
            samples.append(time.perf_counter() - start)
            tg.cancel_scope.cancel()
        await backend.stop()
    return statistics.median(samples), max(samples)


async def main() -> None:
    standin = load()
    print(f"AMD backend over the real amdsmi {standin.module.__version__} and the stand-in library")
    print(f"rounds={ROUNDS}; times in ms (median / max); calls and CPU per health pass")
    print(
        f"{'fixture':<20} {'devices':>7} {'discover':>9} {'max':>8} {'telemetry':>9} {'max':>8}"
        f" {'pass':>9} {'max':>8} {'calls/pass':>10} {'cpu-ms/pass':>11}"
    )
    for label, gpus in (
        ("8x MI300X spx_nps1", mi300x("spx_nps1")),
        ("8x MI300X cpx_nps4", mi300x("cpx_nps4")),
        ("8x MI250X GCD", mi250x()),
    ):
        print(await _costs(standin, label, gpus))
    print()
    print(f"latency over {LATENCY_ROUNDS} rounds, 8 MI300X, event-timeout-ms 200, poll-interval 1 s")
    print(f"{'fault -> verdict':<34} {'median s':>9} {'max s':>7}")
    for label, what in (("GPU reset event -> taint", "reset"), ("GPU falls off -> gpu-lost", "lost")):
        median, worst = await _latency(standin, what)
        print(f"{label:<34} {median:>9.3f} {worst:>7.3f}")


if __name__ == "__main__":
    anyio.run(main)
