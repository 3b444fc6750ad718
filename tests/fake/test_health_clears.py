"""The fake backend's faults clear too, across rediscovery, and its monitor reports alive (issue 13)."""

from __future__ import annotations

import anyio

from agent.core.backend import HealthEvent
from agent.core.inventory import Inventory
from agent.core.model import HealthStatus
from agent.health.tracker import HealthTracker
from tests.fake.helpers import make_backends
from tests.support.clock import FakeClock


class LiveSink:
    """A sink that also counts `report_alive` calls."""

    def __init__(self, tracker: HealthTracker) -> None:
        self.tracker = tracker
        self.alive_reports = 0

    async def __call__(self, event: HealthEvent) -> None:
        await self.tracker.handle(event)

    def alive(self) -> None:
        self.alive_reports += 1


async def test_lost_dropped_recovered_and_back_is_healthy_after_the_hold(fake_clock: FakeClock) -> None:
    (backend,), injector = make_backends("nvidia-a100-8x", clock=fake_clock)
    inventory = Inventory(backend.driver_name)
    inventory.set_devices(await backend.discover())
    tracker = HealthTracker(inventory, fake_clock, hold_seconds=60)
    sink = LiveSink(tracker)
    async with anyio.create_task_group() as tg:
        tg.start_soon(backend.monitor_health, sink)
        with anyio.fail_after(5):
            while sink.alive_reports == 0:  # noqa: ASYNC110 - no event for an alive report
                await anyio.sleep(0.005)
        await injector.lose("gpu-0")
        with anyio.fail_after(5):
            while "gpu-0" not in inventory.health():  # noqa: ASYNC110
                await anyio.sleep(0.005)
        inventory.set_devices(await backend.discover())  # fell off the bus
        assert "gpu-0" not in inventory.device_names()
        await injector.recover("gpu-0")
        inventory.set_devices(await backend.discover())  # back
        with anyio.fail_after(5):
            while not all(a.lifts_at is not None for a in tracker.active()):  # noqa: ASYNC110
                await anyio.sleep(0.005)
        fake_clock.advance(3600)
        tracker.expire()
        tg.cancel_scope.cancel()
    assert {d.name: d.health.status for d in inventory.devices()}["gpu-0"] is HealthStatus.HEALTHY
