from __future__ import annotations

import threading
from collections.abc import Sequence

import anyio

from agent.core.backend import DeviceTelemetry
from agent.core.inventory import Inventory
from agent.core.model import DeviceHealth, HealthCondition, Severity
from agent.observe.metrics import Metrics
from agent.observe.readiness import Readiness
from agent.observe.telemetry import (
    FAILURES_BEFORE_NOT_READY,
    TelemetryPoller,
    update_device_counts,
)
from tests.observability.fakes import DRIVER, TelemetryBackend, make_devices
from tests.support.clock import FakeClock

NODE = "node-a"


def labels(i: int) -> dict[str, str]:
    return {
        "driver": DRIVER,
        "pool": NODE,
        "device": f"gpu-{i}",
        "UUID": f"GPU-{i:08x}",
        "pci_bus_id": f"0000:{i + 1:02x}:00.0",
        "product": "Example GPU 80GB",
    }


def full_reading(i: int) -> DeviceTelemetry:
    return DeviceTelemetry(
        device=f"gpu-{i}",
        utilization_ratio=0.5,
        memory_used_bytes=1024,
        memory_total_bytes=80 * 2**30,
        temperature_celsius=61.0,
        power_watts=300.5,
        ecc_corrected_total=2,
        ecc_uncorrected_total=0,
        last_error_code=79,
    )


def setup(
    count: int = 2,
) -> tuple[TelemetryBackend, Inventory, Metrics, FakeClock, Readiness, TelemetryPoller]:
    backend = TelemetryBackend([full_reading(i) for i in range(count)])
    inventory = Inventory(DRIVER)
    inventory.set_devices(make_devices(count))
    metrics, clock, readiness = Metrics(), FakeClock(), Readiness()
    poller = TelemetryPoller(
        backend, inventory, metrics, node_name=NODE, interval=10.0, clock=clock, readiness=readiness
    )
    return backend, inventory, metrics, clock, readiness, poller


async def test_sets_every_gauge_with_identity_labels() -> None:
    _, _, metrics, _, readiness, poller = setup()
    assert readiness.ready()[0] is False  # expected before the first read
    assert await poller.poll_once()
    get = metrics.registry.get_sample_value
    for i in range(2):
        assert get("dra_agent_device_utilization_ratio", labels(i)) == 0.5
        assert get("dra_agent_device_memory_used_bytes", labels(i)) == 1024
        assert get("dra_agent_device_memory_total_bytes", labels(i)) == 80 * 2**30
        assert get("dra_agent_device_temperature_celsius", labels(i)) == 61.0
        assert get("dra_agent_device_power_watts", labels(i)) == 300.5
        assert get("dra_agent_device_ecc_corrected_errors", labels(i)) == 2
        assert get("dra_agent_device_ecc_uncorrected_errors", labels(i)) == 0
        assert get("dra_agent_device_last_error_code", labels(i)) == 79
    driver = {"driver": DRIVER}
    assert get("dra_agent_telemetry_read_duration_seconds_count", driver) == 1
    assert not get("dra_agent_health_monitor_last_seen_timestamp_seconds", driver)  # the monitor's, not ours
    assert get("dra_agent_devices", {**driver, "health": "healthy"}) == 2
    assert readiness.ready() == (True, {f"telemetry/{DRIVER}": (True, "")})


async def test_degraded_fields_have_no_series() -> None:
    backend, _, metrics, _, _, poller = setup(1)
    await poller.poll_once()
    backend.readings = [DeviceTelemetry(device="gpu-0", temperature_celsius=40.0)]
    await poller.poll_once()
    get = metrics.registry.get_sample_value
    assert get("dra_agent_device_temperature_celsius", labels(0)) == 40.0
    assert get("dra_agent_device_power_watts", labels(0)) is None
    assert get("dra_agent_device_utilization_ratio", labels(0)) is None


async def test_vanished_and_unknown_devices_are_removed_or_ignored() -> None:
    backend, inventory, metrics, _, _, poller = setup(2)
    await poller.poll_once()
    inventory.set_devices(make_devices(1))
    backend.readings = [full_reading(0), full_reading(1), DeviceTelemetry(device="ghost", power_watts=1.0)]
    await poller.poll_once()
    get = metrics.registry.get_sample_value
    assert get("dra_agent_device_power_watts", labels(0)) == 300.5
    assert get("dra_agent_device_power_watts", labels(1)) is None
    assert get("dra_agent_devices", {"driver": DRIVER, "health": "healthy"}) == 1


async def test_failed_reads_drop_series_count_errors_and_turn_not_ready() -> None:
    backend, _, metrics, _, readiness, poller = setup(1)
    await poller.poll_once()
    backend.error = RuntimeError("NVML_ERROR_GPU_IS_LOST")
    for _ in range(FAILURES_BEFORE_NOT_READY - 1):
        assert not await poller.poll_once()
    get = metrics.registry.get_sample_value
    assert get("dra_agent_device_power_watts", labels(0)) is None
    assert readiness.ready()[0]  # a transient failure does not flip readiness
    assert not await poller.poll_once()
    ok, checks = readiness.ready()
    assert not ok
    assert "NVML_ERROR_GPU_IS_LOST" in checks[f"telemetry/{DRIVER}"][1]
    assert get("dra_agent_telemetry_read_errors_total", {"driver": DRIVER}) == FAILURES_BEFORE_NOT_READY
    assert get("dra_agent_telemetry_read_duration_seconds_count", {"driver": DRIVER}) == 4
    backend.error = None
    assert await poller.poll_once()
    assert readiness.ready()[0]
    assert get("dra_agent_device_power_watts", labels(0)) == 300.5


async def test_run_polls_on_the_interval() -> None:
    backend, _, _, clock, _, poller = setup(1)
    async with anyio.create_task_group() as tg:
        tg.start_soon(poller.run)
        await wait_for(lambda: backend.reads == 1)
        clock.advance(9.0)
        await settle()
        assert backend.reads == 1
        clock.advance(1.0)
        await wait_for(lambda: backend.reads == 2)
        tg.cancel_scope.cancel()


async def test_device_counts_follow_health() -> None:
    inventory = Inventory(DRIVER)
    inventory.set_devices(make_devices(3))
    critical = DeviceHealth((HealthCondition("xid", Severity.CRITICAL, "79"),))
    warning = DeviceHealth((HealthCondition("unmonitored", Severity.WARNING),))
    inventory.set_health({"gpu-0": critical, "gpu-1": warning})
    metrics = Metrics()
    update_device_counts(metrics, inventory)
    get = metrics.registry.get_sample_value
    assert get("dra_agent_devices", {"driver": DRIVER, "health": "unhealthy"}) == 1
    assert get("dra_agent_devices", {"driver": DRIVER, "health": "unknown"}) == 1
    assert get("dra_agent_devices", {"driver": DRIVER, "health": "healthy"}) == 1


async def settle() -> None:
    for _ in range(20):
        await anyio.lowlevel.checkpoint()


async def wait_for(condition: object) -> None:
    assert callable(condition)
    with anyio.fail_after(5):
        while not condition():
            await anyio.lowlevel.checkpoint()


class ThreadedBackend(TelemetryBackend):
    """Reads in a worker thread (as the vendor backends do) and waits there until released."""

    def __init__(self) -> None:
        super().__init__([full_reading(0)])
        self.entered = threading.Event()
        self.release = threading.Event()

    def _blocking_read(self) -> None:
        self.entered.set()
        self.release.wait(10)

    async def telemetry(self) -> Sequence[DeviceTelemetry]:
        await anyio.to_thread.run_sync(self._blocking_read)
        return await super().telemetry()


async def test_a_slow_read_does_not_hold_up_other_tasks() -> None:
    backend = ThreadedBackend()
    inventory = Inventory(DRIVER)
    inventory.set_devices(make_devices(1))
    poller = TelemetryPoller(backend, inventory, Metrics(), node_name=NODE, clock=FakeClock())
    async with anyio.create_task_group() as tg:
        tg.start_soon(poller.poll_once)
        await anyio.to_thread.run_sync(backend.entered.wait, 10)
        # A "prepare" runs to completion on the loop while the read is stuck in its thread.
        for _ in range(10):
            await anyio.lowlevel.checkpoint()
        assert backend.reads == 0
        backend.release.set()
    assert backend.reads == 1
