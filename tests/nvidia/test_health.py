"""The NVML event loop: XIDs, ECC, lost GPUs, unmonitored GPUs, recovery and prompt shutdown."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import pynvml as real
import pytest

from agent.core.backend import ConditionKind, HealthEvent
from agent.core.errors import ConfigError
from agent.core.inventory import Inventory
from agent.core.model import HealthStatus, Severity
from agent.health.tracker import HealthTracker
from backends.nvidia.xids import XidPolicy, parse_xids
from tests.fakes.libnvml import (
    ALL_HEALTH_EVENTS,
    DOUBLE_BIT_ECC,
    SINGLE_BIT_ECC,
    XID_CRITICAL,
    LibNvml,
    a100_mig,
    h100,
    l4,
)
from tests.nvidia.conftest import BackendFactory, Sink, monitoring, until
from tests.support.clock import FakeClock

A100 = "GPU-a1000000-0000-0000-0000-000000000000"
H100 = "GPU-h1000002-0000-0000-0000-000000000000"
L4 = "GPU-0l400003-0000-0000-0000-000000000000"
A100_MIGS = [
    "gpu-0-mig-1g10gb-19-2",
    "gpu-0-mig-1g10gb-19-3",
    "gpu-0-mig-2g20gb-14-0",
    "gpu-0-mig-3g40gb-9-4",
]


async def registered(fake: LibNvml, count: int = 1) -> None:
    """Wait until the monitor has created `count` event sets and waits on the last."""
    await until(lambda: len(fake.event_sets) >= count and fake.event_sets[-1].waits > 0)


def node() -> LibNvml:
    return LibNvml([a100_mig(0), h100(2), l4(3)])


async def test_registers_xid_and_ecc_events_per_gpu(make_backend: BackendFactory) -> None:
    fake = node()
    sink = Sink()
    async with monitoring(make_backend(fake, health_wait_ms="20"), sink):
        await registered(fake)
        assert fake.event_sets[0].registered == {
            A100: ALL_HEALTH_EVENTS,
            H100: ALL_HEALTH_EVENTS,
            L4: ALL_HEALTH_EVENTS,
        }
    assert fake.event_sets[0].freed
    assert sink.events == []


async def test_critical_xid(make_backend: BackendFactory, fake_clock: FakeClock) -> None:
    fake = node()
    sink = Sink()
    backend = make_backend(fake, health_wait_ms="20")
    async with monitoring(backend, sink):
        await registered(fake)
        fake.emit(H100, XID_CRITICAL, 79)
        await sink.wait_count(1)
        telemetry = {t.device: t for t in await backend.telemetry()}
    assert sink.events == [
        HealthEvent(
            "gpu-2", "xid", Severity.CRITICAL, "79", "GPU error", ConditionKind.EVENT, at=fake_clock.time()
        )
    ]
    assert telemetry["gpu-2"].last_error_code == 79
    assert telemetry["gpu-3"].last_error_code == 0  # none since start: a series at 0


async def test_application_xids_are_informational(make_backend: BackendFactory) -> None:
    fake = node()
    sink = Sink()
    async with monitoring(make_backend(fake, health_wait_ms="20"), sink):
        await registered(fake)
        for xid in (13, 31, 43, 45, 68, 109, 48):
            fake.emit(H100, XID_CRITICAL, xid)
        await sink.wait_count(7)
    assert [(e.value, e.severity) for e in sink.events] == [
        ("13", Severity.INFO),
        ("31", Severity.INFO),
        ("43", Severity.INFO),
        ("45", Severity.INFO),
        ("68", Severity.INFO),
        ("109", Severity.INFO),
        ("48", Severity.CRITICAL),
    ]


async def test_ignored_and_forced_xids(make_backend: BackendFactory) -> None:
    fake = node()
    sink = Sink()
    async with monitoring(
        make_backend(fake, health_wait_ms="20", ignored_xids="79+94", critical_xids="13"), sink
    ):
        await registered(fake)
        for xid in (79, 94, 13, 31):
            fake.emit(L4, XID_CRITICAL, xid)
        await sink.wait_count(4)
    assert [(e.device, e.value, e.severity) for e in sink.events] == [
        ("gpu-3", "79", Severity.INFO),
        ("gpu-3", "94", Severity.INFO),
        ("gpu-3", "13", Severity.CRITICAL),
        ("gpu-3", "31", Severity.INFO),
    ]


def test_xid_policy_parsing() -> None:
    assert parse_xids("x", "79,94") == {79, 94}
    assert parse_xids("x", " 79 + 94 ") == {79, 94}
    assert parse_xids("x", "") == frozenset()
    policy = XidPolicy.from_settings({"ignored-xids": "79", "critical-xids": "13,31"})
    assert policy.severity(79) is Severity.INFO
    assert policy.severity(13) is Severity.CRITICAL and policy.severity(43) is Severity.INFO
    for bad in ("seventy", "-1"):
        with pytest.raises(ConfigError, match="ignored-xids"):
            XidPolicy.from_settings({"ignored-xids": bad})


async def test_xid_storm_is_reported_in_order(make_backend: BackendFactory) -> None:
    fake = node()
    sink = Sink()
    async with monitoring(make_backend(fake, health_wait_ms="20"), sink):
        await registered(fake)
        for i in range(300):
            fake.emit(H100 if i % 2 else L4, XID_CRITICAL, 1000 + i)
        await sink.wait_count(300)
    assert [int(e.value) for e in sink.events] == list(range(1000, 1300))
    assert {e.device for e in sink.events} == {"gpu-2", "gpu-3"}


async def test_mig_attribution(make_backend: BackendFactory) -> None:
    fake = node()
    sink = Sink()
    async with monitoring(make_backend(fake, health_wait_ms="20"), sink):
        await registered(fake)
        fake.emit(A100, XID_CRITICAL, 94, gi=2, ci=0)  # the 3g.40gb instance
        await sink.wait_count(1)
        fake.emit(A100, XID_CRITICAL, 79)  # no instance: the whole GPU
        await sink.wait_count(5)
        fake.emit(A100, XID_CRITICAL, 95, gi=42, ci=0)  # an instance we do not publish
        await sink.wait_count(9)
    assert [e.device for e in sink.events[:1]] == ["gpu-0-mig-3g40gb-9-4"]
    assert sorted(e.device for e in sink.events[1:5]) == A100_MIGS
    assert sorted(e.device for e in sink.events[5:9]) == A100_MIGS


async def test_ecc_events(make_backend: BackendFactory) -> None:
    fake = node()
    sink = Sink()
    async with monitoring(make_backend(fake, health_wait_ms="20"), sink):
        await registered(fake)
        fake.emit(H100, DOUBLE_BIT_ECC)
        fake.emit(H100, SINGLE_BIT_ECC)
        await sink.wait_count(2)
    assert [(e.condition, e.severity, e.kind) for e in sink.events] == [
        ("ecc-uncorrectable", Severity.CRITICAL, ConditionKind.EVENT),
        ("ecc-correctable", Severity.INFO, ConditionKind.EVENT),
    ]


async def test_gpu_lost_marks_all_its_devices_and_monitoring_goes_on(make_backend: BackendFactory) -> None:
    fake = node()
    sink = Sink()
    async with monitoring(make_backend(fake, health_wait_ms="20"), sink):
        await registered(fake)
        fake.lose(A100)
        await sink.wait_count(4)
        # The event set is rebuilt without the lost GPU; the others are still watched.
        await registered(fake, 2)
        assert A100 not in fake.event_sets[1].registered
        fake.emit(H100, XID_CRITICAL, 48)
        await sink.wait_count(5)
    lost = sink.events[:4]
    assert sorted(e.device for e in lost) == A100_MIGS
    assert {(e.condition, e.severity, e.kind) for e in lost} == {
        ("gpu-lost", Severity.CRITICAL, ConditionKind.STATE)
    }
    assert sink.events[4].device == "gpu-2"
    assert fake.event_sets[0].freed and fake.event_sets[1].freed


async def test_unreadable_event_from_a_lost_gpu(make_backend: BackendFactory) -> None:
    """The event arrives but its GPU no longer answers (NVIDIA's mock, `nvml-mock-ctl fail --mode
    fallen_off_bus --xid 79`, benchmarks/README.md): the XID was dropped, only `gpu-lost` raised.
    The event's handle is the one registered: it names the GPU without asking it."""
    fake = node()
    sink = Sink()
    async with monitoring(make_backend(fake, health_wait_ms="20"), sink):
        await registered(fake)
        fake.emit(H100, XID_CRITICAL, 79)
        fake.gpu(H100).lost = True
        await sink.wait_count(2)
    assert [(e.device, e.condition, e.value) for e in sink.events] == [
        ("gpu-2", "xid", "79"),
        ("gpu-2", "gpu-lost", ""),
    ]


async def test_transient_wait_error_is_not_a_fault(make_backend: BackendFactory) -> None:
    fake = node()
    sink = Sink()
    async with monitoring(make_backend(fake, health_wait_ms="20"), sink):
        await registered(fake)
        fake.emit_error(int(real.NVML_ERROR_UNKNOWN))
        fake.emit(L4, XID_CRITICAL, 62)
        await sink.wait_count(1)
    assert [(e.device, e.condition, e.value) for e in sink.events] == [("gpu-3", "xid", "62")]


async def test_unmonitored_gpu_is_a_warning(make_backend: BackendFactory) -> None:
    old = l4(3)
    old.supported_events = 0  # an old GPU: no XID events
    fake = LibNvml([h100(2), old])
    sink = Sink()
    async with monitoring(make_backend(fake, health_wait_ms="20"), sink):
        await sink.wait_count(1)
        await registered(fake)
        fake.emit(H100, XID_CRITICAL, 79)
        await sink.wait_count(2)
    first = sink.events[0]
    assert (first.device, first.condition, first.severity, first.kind) == (
        "gpu-3",
        "unmonitored",
        Severity.WARNING,
        ConditionKind.STATE,
    )
    assert "NOT_SUPPORTED" in first.message
    assert fake.event_sets[0].registered == {H100: ALL_HEALTH_EVENTS}


async def test_ecc_not_supported_still_watches_xids(make_backend: BackendFactory) -> None:
    consumer = l4(3)
    consumer.supported_events = XID_CRITICAL
    fake = LibNvml([consumer])
    sink = Sink()
    async with monitoring(make_backend(fake, health_wait_ms="20"), sink):
        await registered(fake)
        assert fake.event_sets[0].registered == {L4: XID_CRITICAL}
    assert sink.events == []


@pytest.mark.parametrize(
    ("code", "condition", "severity"),
    [
        (int(real.NVML_ERROR_NOT_SUPPORTED), "unmonitored", Severity.WARNING),
        (int(real.NVML_ERROR_NO_PERMISSION), "unmonitored", Severity.WARNING),
        (int(real.NVML_ERROR_GPU_IS_LOST), "gpu-lost", Severity.CRITICAL),
    ],
)
async def test_registration_failures(
    make_backend: BackendFactory, code: int, condition: str, severity: Severity
) -> None:
    gpu = h100(2)
    fake = LibNvml([gpu])
    fake.fail(gpu.uuid, "nvmlDeviceRegisterEvents", code)
    sink = Sink()
    async with monitoring(make_backend(fake, health_wait_ms="20"), sink):
        await sink.wait_count(1)
    assert [(e.device, e.condition, e.severity) for e in sink.events] == [("gpu-2", condition, severity)]


async def test_supported_event_types_not_supported(make_backend: BackendFactory) -> None:
    gpu = h100(2)
    fake = LibNvml([gpu])
    fake.fail(gpu.uuid, "nvmlDeviceGetSupportedEventTypes", int(real.NVML_ERROR_NOT_SUPPORTED))
    sink = Sink()
    async with monitoring(make_backend(fake, health_wait_ms="20"), sink):
        await sink.wait_count(1)
    assert sink.events[0].condition == "unmonitored"


async def test_no_event_sets_at_all(make_backend: BackendFactory) -> None:
    fake = LibNvml([h100(2), l4(3)], missing={"nvmlEventSetCreate"})
    sink = Sink()
    async with monitoring(make_backend(fake, health_wait_ms="20"), sink):
        await sink.wait_count(2)
    assert {(e.device, e.condition, e.severity) for e in sink.events} == {
        ("gpu-2", "unmonitored", Severity.WARNING),
        ("gpu-3", "unmonitored", Severity.WARNING),
    }


async def test_no_gpus_monitor_just_waits(make_backend: BackendFactory) -> None:
    sink = Sink()
    async with monitoring(make_backend(LibNvml([]), health_wait_ms="20"), sink):
        await anyio.sleep(0.05)
    assert sink.events == []


async def test_recovery_action_back_to_none_clears(
    make_backend: BackendFactory, fake_clock: FakeClock
) -> None:
    fake = node()
    gpu = fake.gpu(H100)
    gpu.recovery_action = int(real.NVML_GPU_RECOVERY_ACTION_GPU_RESET)
    sink = Sink()
    async with monitoring(make_backend(fake, health_wait_ms="20", recovery_interval="5"), sink):
        await registered(fake)
        # The first health pass read the action (reset): a recovery-action state.
        await sink.wait_count(1)
        fake.emit(H100, XID_CRITICAL, 79)
        await sink.wait_count(2)
        # The GPU gets reset; the next pass sees none: both end.
        gpu.recovery_action = int(real.NVML_GPU_RECOVERY_ACTION_NONE)
        fake_clock.advance(5)
        await sink.wait_count(4)
    assert [(e.device, e.condition, e.value, e.kind, e.cleared) for e in sink.events] == [
        ("gpu-2", "recovery-action", "gpu-reset", ConditionKind.STATE, False),
        ("gpu-2", "xid", "79", ConditionKind.EVENT, False),
        ("gpu-2", "recovery-action", "gpu-reset", ConditionKind.STATE, True),
        ("gpu-2", "xid", "79", ConditionKind.EVENT, True),
    ]


async def test_recovery_action_after_the_fault_clears_it_when_back_to_none(
    make_backend: BackendFactory, fake_clock: FakeClock
) -> None:
    fake = node()
    gpu = fake.gpu(H100)
    sink = Sink()
    async with monitoring(make_backend(fake, health_wait_ms="20"), sink):
        await registered(fake)
        fake.emit(H100, XID_CRITICAL, 79)
        await sink.wait_count(1)
        gpu.recovery_action = int(real.NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET)
        fake_clock.advance(5)
        await sink.wait_count(2)
        gpu.recovery_action = int(real.NVML_GPU_RECOVERY_ACTION_NONE)
        fake_clock.advance(5)
        await sink.wait_count(4)
    assert [(e.condition, e.value, e.cleared) for e in sink.events] == [
        ("xid", "79", False),
        ("recovery-action", "drain-and-reset", False),
        ("recovery-action", "drain-and-reset", True),
        ("xid", "79", True),
    ]


async def test_recovery_action_none_from_the_start_leaves_the_hold_time(
    make_backend: BackendFactory, fake_clock: FakeClock
) -> None:
    fake = node()
    sink = Sink()
    async with monitoring(make_backend(fake, health_wait_ms="20"), sink):
        await registered(fake)
        fake.emit(H100, DOUBLE_BIT_ECC)
        await sink.wait_count(1)
        fake_clock.advance(60)
        await until(lambda: fake.calls.count("nvmlDeviceGetFieldValues") == 6)
    assert [e.cleared for e in sink.events] == [False]
    # Read once per health pass and GPU (3 GPUs, the first pass and one more), never more.
    assert fake.calls.count("nvmlDeviceGetFieldValues") == 6


async def test_recovery_field_not_supported(make_backend: BackendFactory, fake_clock: FakeClock) -> None:
    fake = node()
    for gpu in fake.gpus:
        gpu.recovery_action = None  # an older driver
    sink = Sink()
    async with monitoring(make_backend(fake, health_wait_ms="20"), sink):
        await registered(fake)
        fake.emit(H100, XID_CRITICAL, 79)
        await sink.wait_count(1)
        await until(lambda: "nvmlDeviceGetFieldValues" in fake.calls)
        fake.emit(H100, XID_CRITICAL, 79)
        await sink.wait_count(2)
        fake_clock.advance(60)
        await anyio.sleep(0.1)
    # Not readable: asked once per GPU, then the hold time of the taint policy applies.
    assert [e.cleared for e in sink.events] == [False, False]
    assert fake.calls.count("nvmlDeviceGetFieldValues") == 3


async def test_recovery_field_read_fails(make_backend: BackendFactory) -> None:
    fake = node()
    fake.fail(H100, "nvmlDeviceGetFieldValues", int(real.NVML_ERROR_FUNCTION_NOT_FOUND))
    sink = Sink()
    async with monitoring(make_backend(fake, health_wait_ms="20"), sink):
        await registered(fake)
        fake.emit(H100, XID_CRITICAL, 79)
        await sink.wait_count(1)
        await anyio.sleep(0.05)
    assert [e.cleared for e in sink.events] == [False]


async def test_shutdown_while_waiting_is_prompt(make_backend: BackendFactory) -> None:
    fake = node()
    backend = make_backend(fake, health_wait_ms="100")
    await backend.start()
    sink = Sink()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(backend.monitor_health, sink)
            await registered(fake)
            tg.cancel_scope.cancel()
    # The wait in the worker thread ended (no abandoned thread) and the event set was freed.
    assert fake.event_sets[0].freed
    await backend.stop()
    assert fake.initialized == 0


async def test_fault_ends_as_unhealthy_device(make_backend: BackendFactory, fake_clock: FakeClock) -> None:
    """Through the core's tracker: an XID from the stand-in libnvidia-ml makes the device unhealthy."""
    fake = node()
    backend = make_backend(fake, health_wait_ms="20")
    await backend.start()
    inventory = Inventory(backend.driver_name)
    inventory.set_devices(await backend.discover())
    tracker = HealthTracker(inventory, fake_clock, hold_seconds=60)
    seen = inventory.version
    handle: Callable[[HealthEvent], Awaitable[None]] = tracker.handle
    async with anyio.create_task_group() as tg:
        tg.start_soon(backend.monitor_health, handle)
        await registered(fake)
        fake.emit(H100, XID_CRITICAL, 79)
        with anyio.fail_after(5):
            seen = await inventory.wait_changed(seen)
        tg.cancel_scope.cancel()
    await backend.stop()
    health = {d.name: d.health for d in inventory.devices()}
    assert health["gpu-2"].status is HealthStatus.UNHEALTHY
    assert "xid=79" in health["gpu-2"].message
    assert health["gpu-3"].status is HealthStatus.HEALTHY
    fake_clock.advance(61)
    tracker.expire()
    assert {d.name: d.health.status for d in inventory.devices()}["gpu-2"] is HealthStatus.HEALTHY
