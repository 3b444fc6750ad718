"""Issue 30's "done when", in real time: the AMD backend through AMD's real amdsmi over the stand-in.

Run: ``python -m benchmarks.amd_soak [quiet-seconds]`` (default 60). Two MI300X, amdsmi 7.0.x
behaviour (NO_DATA on quiet event reads, FILE_ERROR on an empty CPER ring), the health pass every
5 s and a rediscovery every 10 s, as the agent runs them; then, in turn: a reset event, a fatal
CPER record, a GPU falling off, and a change from SPX to CPX. Prints each check, its limit, what was
measured, and whether it holds.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable

import anyio

from agent.core.backend import BackendOptions, HealthEvent
from agent.core.clock import SystemClock
from agent.core.inventory import Inventory
from agent.core.model import Device, HealthStatus
from agent.health.tracker import HealthTracker
from backends.amd.backend import AmdBackend
from tests.fakes.amd_standin import cper_record, load, mi300x

POLL = 5.0
REDISCOVERY = 10.0


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


async def _until(check: Callable[[], bool], limit: float) -> float | None:
    """Seconds until `check()` holds (polled every 10 ms), or None after `limit`."""
    start = time.perf_counter()
    with anyio.move_on_after(limit):
        while not check():  # noqa: ASYNC110 (the state changes in other tasks and threads)
            await anyio.sleep(0.01)
        return time.perf_counter() - start
    return None


async def main(quiet: float) -> None:
    standin = load()
    gpus = standin.configure(mi300x("spx_nps1", count=2)).gpus
    warnings = _Warnings()
    logging.getLogger("agent.backends.amd").addHandler(warnings)
    settings = {"sysfs-root": "/dev/null", "poll-interval": str(POLL)}
    backend = AmdBackend(BackendOptions("soak", None, settings), clock=SystemClock())
    await backend.start()
    inventory = Inventory(backend.driver_name)
    inventory.set_devices(await backend.discover())
    tracker = HealthTracker(inventory, SystemClock(), hold_seconds=3600)
    events: list[HealthEvent] = []
    published: list[list[Device]] = []

    async def sink(event: HealthEvent) -> None:
        events.append(event)
        await tracker.handle(event)

    async def rediscover() -> None:
        while True:
            await anyio.sleep(REDISCOVERY)
            devices = list(await backend.discover())
            published.append(devices)
            inventory.set_devices(devices)

    def of(condition: str) -> list[HealthEvent]:
        return [e for e in events if e.condition == condition and not e.cleared]

    rows: list[tuple[str, str, str, bool]] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(backend.monitor_health, sink)
        tg.start_soon(rediscover)
        await anyio.sleep(quiet)
        reads = standin.calls("amdsmi_get_gpu_event_notification")
        quiet_ok = not of("unmonitored") and not warnings.records
        rows.append(
            (
                f"{quiet:g} s quiet: no unmonitored, no warning",
                "0 / 0",
                f"{len(of('unmonitored'))} / {len(warnings.records)} ({reads} NO_DATA reads)",
                quiet_ok,
            )
        )

        standin.push_event(0, "GPU_PRE_RESET")
        took = await _until(lambda: inventory.devices()[0].health.status is HealthStatus.UNHEALTHY, 5)
        rows.append(
            ("reset event -> taint", "1 s", f"{took:.3f} s" if took else "none", bool(took and took < 1))
        )

        stamp = time.strftime("%Y/%m/%d %H:%M:%S", time.gmtime(time.time() - 1))
        gpus[1].cper = [cper_record(stamp, record_id="42")]
        took = await _until(lambda: bool(of("cper-fatal")), 3 * POLL)
        rows.append(
            (
                "empty CPER ring, then fatal record -> cper-fatal",
                f"{2 * POLL:g} s",
                f"{took:.3f} s" if took else "none",
                bool(took and took <= 2 * POLL),
            )
        )

        before = {d.name: d for d in inventory.devices()}["gpu-2-129"]
        gpus[1].lost = True
        took = await _until(lambda: any(e.device == "gpu-2-129" for e in of("gpu-lost")), 3 * POLL)
        seen = len(published)
        await _until(lambda: len(published) > seen, 2 * REDISCOVERY)
        kept = {d.name: d for d in published[-1]}.get("gpu-2-129")
        same = kept is not None and kept.attributes == before.attributes
        rows.append(
            (
                "lost GPU: gpu-lost, name and attributes kept",
                f"{2 * POLL:g} s",
                f"{took:.3f} s, kept={same}" if took else "none",
                bool(took and took <= 2 * POLL and same),
            )
        )

        standin.remove(0)
        for spec in mi300x("cpx_nps4", count=1):
            standin.add(spec)
        seen = len(published)

        def cpx() -> bool:
            return any(d.attributes.get("partitionProfile") == "cpx_nps4" for d in inventory.devices())

        took = await _until(cpx, 3 * REDISCOVERY)
        partitions = sum(1 for d in inventory.devices() if d.parent)
        rows.append(
            (
                "SPX -> CPX without a restart",
                f"{2 * REDISCOVERY:g} s",
                f"{took:.3f} s, {partitions} partitions" if took else "none",
                bool(took and took <= 2 * REDISCOVERY and partitions == 8),
            )
        )
        tg.cancel_scope.cancel()
    await backend.stop()
    version = standin.module.__version__
    print(f"amdsmi {version} over the stand-in; poll-interval {POLL:g} s, rediscovery {REDISCOVERY:g} s")
    print(f"{'check':<48} {'limit':>7}  {'measured':<40} ok")
    for check, limit, measured, ok in rows:
        print(f"{check:<48} {limit:>7}  {measured:<40} {'yes' if ok else 'NO'}")


if __name__ == "__main__":
    anyio.run(main, float(sys.argv[1]) if len(sys.argv) > 1 else 60.0)
