"""Faults that clear: a lost GPU back, a GPU watched again, GPUs found later (issue 13, point 1).

Upstream, kubernetes-sigs/dra-driver-nvidia-gpu ``cmd/gpu-kubelet-plugin/device_health.go`` sends
``gpu-lost`` and ``unmonitored`` health events and registers its event set once, for the GPUs of
its start-up discovery; nothing there clears them. Ours are STATE conditions that last until the
backend clears them, so the backend clears them once the GPU answers (or is watched) again, and
watches the GPUs of each new discovery.
"""

from __future__ import annotations

import anyio
import pynvml as real

from agent.core.backend import ConditionKind
from agent.core.inventory import Inventory
from agent.core.model import HealthStatus
from agent.health.tracker import HealthTracker
from tests.fakes.libnvml import ALL_HEALTH_EVENTS, XID_CRITICAL, LibNvml, h100, l4
from tests.nvidia.conftest import BackendFactory, Sink, until
from tests.support.clock import FakeClock

GPU0 = "GPU-h1000000-0000-0000-0000-000000000000"
L4 = "GPU-0l400003-0000-0000-0000-000000000000"


def status(inventory: Inventory, device: str) -> HealthStatus:
    return {d.name: d.health.status for d in inventory.devices()}[device]


def gpu_lost_cleared(tracker: HealthTracker, device: str) -> bool:
    """The tracker holds `device`'s gpu-lost only as a hold (cleared), or not at all."""
    return all(a.lifts_at is not None for a in tracker.active() if a.device == device)


async def test_lost_gpu_dropped_and_back_is_healthy_after_the_hold(
    make_backend: BackendFactory, fake_clock: FakeClock
) -> None:
    """The reproduction of the issue: lost, kept by rediscovery (issue 23), back: healthy an hour later."""
    fake = LibNvml([h100(0), l4(3)])
    backend = make_backend(fake, health_wait_ms="20")
    await backend.start()
    inventory = Inventory(backend.driver_name)
    inventory.set_devices(await backend.discover())
    tracker = HealthTracker(inventory, fake_clock, hold_seconds=60)
    async with anyio.create_task_group() as tg:
        tg.start_soon(backend.monitor_health, tracker.handle)
        await until(lambda: fake.event_sets and fake.event_sets[-1].waits > 0)
        fake.lose(GPU0)
        await until(lambda: status(inventory, "gpu-0") is HealthStatus.UNHEALTHY)
        inventory.set_devices(await backend.discover())
        assert "gpu-0" in inventory.device_names()  # kept while lost, never dropped without a word
        fake.gpu(GPU0).lost = False
        inventory.set_devices(await backend.discover())
        tracker.expire()
        assert status(inventory, "gpu-0") is HealthStatus.UNHEALTHY  # back, held until cleared
        await until(lambda: gpu_lost_cleared(tracker, "gpu-0"))
        fake_clock.advance(3600)
        tracker.expire()
        assert status(inventory, "gpu-0") is HealthStatus.HEALTHY
        # Watched again: a new fault of the GPU is seen.
        fake.emit(GPU0, XID_CRITICAL, 79)
        await until(lambda: status(inventory, "gpu-0") is HealthStatus.UNHEALTHY)
        tg.cancel_scope.cancel()
    await backend.stop()


async def test_lost_gpu_that_answers_again_is_cleared_and_watched(
    make_backend: BackendFactory, fake_clock: FakeClock
) -> None:
    """No rediscovery needed: the monitor asks a lost GPU again (through a fresh handle)."""
    fake = LibNvml([h100(0), l4(3)])
    sink = Sink()
    backend = make_backend(fake, health_wait_ms="20", recovery_interval="5")
    await backend.start()
    async with anyio.create_task_group() as tg:
        tg.start_soon(backend.monitor_health, sink)
        await until(lambda: fake.event_sets and fake.event_sets[-1].waits > 0)
        fake.lose(GPU0)
        await sink.wait_count(1)
        fake_clock.advance(5)
        await until(lambda: "nvmlDeviceGetHandleByUUID" in fake.calls)  # asked: still lost
        assert len(sink.events) == 1
        fake.gpu(GPU0).lost = False
        fake_clock.advance(5)
        await sink.wait_count(2)
        fake.emit(GPU0, XID_CRITICAL, 48)
        await sink.wait_count(3)
        tg.cancel_scope.cancel()
    await backend.stop()
    assert [(e.device, e.condition, e.kind, e.cleared) for e in sink.events] == [
        ("gpu-0", "gpu-lost", ConditionKind.STATE, False),
        ("gpu-0", "gpu-lost", ConditionKind.STATE, True),
        ("gpu-0", "xid", ConditionKind.EVENT, False),
    ]
    assert fake.event_sets[-1].registered[GPU0] == ALL_HEALTH_EVENTS


async def test_rediscovery_watches_new_gpus_and_clears_unmonitored(make_backend: BackendFactory) -> None:
    """A GPU found later is watched; one whose registration now works loses ``unmonitored``."""
    gpu = h100(0)
    fake = LibNvml([gpu])
    fake.fail(GPU0, "nvmlDeviceRegisterEvents", int(real.NVML_ERROR_NO_PERMISSION))
    sink = Sink()
    backend = make_backend(fake, health_wait_ms="20")
    await backend.start()
    await backend.discover()
    async with anyio.create_task_group() as tg:
        tg.start_soon(backend.monitor_health, sink)
        await sink.wait_count(1)
        gpu.failures.clear()
        fake.gpus.append(l4(3))
        await backend.discover()
        await sink.wait_count(2)
        await until(lambda: len(fake.event_sets) == 2 and fake.event_sets[-1].waits > 0)
        fake.emit(L4, XID_CRITICAL, 79)
        await sink.wait_count(3)
        tg.cancel_scope.cancel()
    await backend.stop()
    assert [(e.device, e.condition, e.cleared) for e in sink.events] == [
        ("gpu-0", "unmonitored", False),
        ("gpu-0", "unmonitored", True),
        ("gpu-3", "xid", False),
    ]
    assert fake.event_sets[0].freed and fake.event_sets[1].freed


async def test_unchanged_rediscovery_keeps_the_monitor(make_backend: BackendFactory) -> None:
    fake = LibNvml([h100(0)])
    backend = make_backend(fake, health_wait_ms="20")
    await backend.start()
    async with anyio.create_task_group() as tg:
        tg.start_soon(backend.monitor_health, Sink())
        await until(lambda: fake.event_sets and fake.event_sets[-1].waits > 0)
        await backend.discover()
        waits = fake.event_sets[0].waits
        await until(lambda: fake.event_sets[0].waits > waits + 2)
        assert len(fake.event_sets) == 1
        tg.cancel_scope.cancel()
    await backend.stop()
