"""AMD faults that clear across a rediscovery, and a hung amdsmi call (issue 13, point 1)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import anyio
import pytest

from agent.core.backend import BackendOptions
from agent.core.inventory import Inventory
from agent.core.model import HealthStatus
from agent.core.vendorcall import VendorCallTimeoutError
from agent.health.tracker import HealthTracker
from backends.amd.backend import AmdBackend
from tests.amd.conftest import MakeBackend
from tests.amd.test_health import SETTINGS, Sink, eventually, monitoring, next_poll
from tests.fakes.amd_standin import STATUS_NO_PERM, StandIn, mi210
from tests.support.clock import FakeClock


async def test_lost_gpu_stays_published_and_is_cleared_when_back(
    make_backend: MakeBackend, fake_clock: FakeClock
) -> None:
    """Lost, kept through a rediscovery (tainted ``gpu-lost``), back: a later pass clears it."""
    gpus = mi210(2)
    async with monitoring(make_backend, gpus) as (backend, _, sink):
        inventory = Inventory(backend.driver_name)
        inventory.set_devices(await backend.discover())
        tracker = HealthTracker(inventory, fake_clock, hold_seconds=60)
        gpus[1].lost = True
        await next_poll(sink, fake_clock)
        for event in sink.events:
            tracker.record(event)
        assert inventory.health()["gpu-2-129"].status is HealthStatus.UNHEALTHY
        devices = await backend.discover()  # the lost GPU answers NOT_FOUND: it stays published
        assert [d.name for d in devices] == ["gpu-1-128", "gpu-2-129"]
        inventory.set_devices(devices)
        gpus[1].lost = False
        await next_poll(sink, fake_clock)  # the rediscovery's lost status: still lost at this pass
        assert [e.cleared for e in sink.of("gpu-lost")] == [False]
        await next_poll(sink, fake_clock)  # answers again
    for event in sink.events[1:]:
        tracker.record(event)
    fake_clock.advance(3600)
    tracker.expire()
    assert "gpu-2-129" not in inventory.health()
    assert [(e.device, e.cleared) for e in sink.of("gpu-lost")] == [("gpu-2-129", False), ("gpu-2-129", True)]


async def test_events_unmonitored_is_cleared_by_the_next_monitor(make_backend: MakeBackend) -> None:
    gpus = mi210(2)
    gpus[1].lost = True  # absent at the first discovery
    async with monitoring(make_backend, gpus, events_status=STATUS_NO_PERM) as (backend, fake, sink):
        await eventually(lambda: len(sink.of("unmonitored")) == 1)
        fake.set_behaviour(events_status=0)
        gpus[1].lost = False
        assert len(await backend.discover()) == 2  # a new GPU: a new monitor, whose readers open
        await eventually(lambda: len(sink.of("unmonitored")) == 3)
    assert [(e.device, e.value, e.cleared) for e in sink.of("unmonitored")] == [
        ("gpu-1-128", "events", False),
        ("gpu-1-128", "events", True),
        ("gpu-2-129", "events", True),
    ]


@pytest.fixture
def wedge() -> Iterator[threading.Event]:
    released = threading.Event()
    yield released
    released.set()


async def test_hung_telemetry_holds_up_neither_health_nor_stop(
    standin: StandIn, fake_clock: FakeClock
) -> None:
    fake = standin.configure(mi210(1))
    backend = AmdBackend(BackendOptions("node-1", None, dict(SETTINGS)), clock=fake_clock, call_timeout=0.2)
    await backend.start()
    await backend.discover()
    fake.set_behaviour(hang="amdsmi_get_gpu_activity")  # a wedged driver: the call never returns
    with pytest.raises(VendorCallTimeoutError, match="read_telemetry did not return"):
        await backend.telemetry()
    sink = Sink()
    async with anyio.create_task_group() as tg:
        tg.start_soon(backend.monitor_health, sink)
        await eventually(lambda: fake.calls("amdsmi_get_gpu_ecc_enabled") >= 1)  # RAS polled
        fake.push_event(0, "GPU_PRE_RESET")
        await eventually(lambda: len(sink.of("gpu-reset")) == 1)
        tg.cancel_scope.cancel()
    with anyio.fail_after(5):
        await backend.stop()
    assert fake.calls("amdsmi_shut_down") == 1


async def test_hung_shutdown_is_left_behind(
    make_backend: MakeBackend, wedge: threading.Event, caplog: pytest.LogCaptureFixture
) -> None:
    backend, fake = make_backend(mi210(1), settings=dict(SETTINGS))
    await backend.start()
    fake.set_behaviour(hang="amdsmi_shut_down")
    with anyio.fail_after(5):
        await backend.stop()
    assert "amdsmi shutdown did not finish" in caplog.text
