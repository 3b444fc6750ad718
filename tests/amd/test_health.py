"""Health: events (reset, ring hang, thermal, VM fault), the health pass (ECC, CPER), loss, unmonitored."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Collection
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import pytest

from agent.core.backend import ConditionKind, HealthEvent
from agent.core.inventory import Inventory
from agent.core.model import HealthStatus, Severity
from agent.health.tracker import HealthTracker
from backends.amd.backend import AmdBackend
from backends.amd.checks import EccReading, read_ecc
from backends.amd.events import close_readers, open_readers
from tests.amd.conftest import MakeBackend
from tests.fakes.amd_standin import (
    STATUS_NO_PERM,
    STATUS_NOT_FOUND,
    STATUS_NOT_SUPPORTED,
    AmdSmiLibraryException,
    GpuSpec,
    StandIn,
    cper_record,
    load,
    mi210,
    mi300x,
)
from tests.support.clock import FakeClock

SETTINGS = {"sysfs-root": "/dev/null", "poll-interval": "10", "event-timeout-ms": "20"}


@dataclass
class Sink:
    """A `HealthSink` that keeps the events and each pass's `report_pass`."""

    events: list[HealthEvent] = field(default_factory=list)
    passes: list[tuple[set[str], list[str]]] = field(default_factory=list)

    async def __call__(self, event: HealthEvent) -> None:
        self.events.append(event)

    def pass_completed(self, devices: Collection[str], failed_checks: Collection[str]) -> None:
        self.passes.append((set(devices), list(failed_checks)))

    def of(self, condition: str) -> list[HealthEvent]:
        return [e for e in self.events if e.condition == condition]


async def eventually(check: Callable[[], bool], limit: float = 5.0) -> None:
    """Wait until `check()` holds; what it watches changes in worker threads, so poll it."""
    with anyio.fail_after(limit):
        while not check():  # noqa: ASYNC110
            await anyio.sleep(0.005)


@asynccontextmanager
async def monitoring(
    make_backend: MakeBackend,
    gpus: list[GpuSpec],
    settings: dict[str, str] | None = None,
    **fake_kwargs: object,
) -> AsyncIterator[tuple[AmdBackend, StandIn, Sink]]:
    backend, fake = make_backend(gpus, settings=dict(settings or SETTINGS), **fake_kwargs)
    await backend.start()
    await backend.discover()
    sink = Sink()
    async with anyio.create_task_group() as tg:
        tg.start_soon(backend.monitor_health, sink)
        # The first pass runs at once; wait for it (its ECC reading is the baseline).
        await eventually(lambda: len(sink.passes) >= 1)
        yield backend, fake, sink
        tg.cancel_scope.cancel()
    await backend.stop()


async def one_pass(backend: AmdBackend) -> Sink:
    """Run the backend's health monitoring until its first pass completes."""
    sink = Sink()
    async with anyio.create_task_group() as tg:
        tg.start_soon(backend.monitor_health, sink)
        await eventually(lambda: len(sink.passes) >= 1)
        tg.cancel_scope.cancel()
    return sink


async def next_poll(sink: Sink, clock: FakeClock) -> None:
    """Move the clock one interval on and wait for the pass it starts to complete."""
    before = len(sink.passes)
    clock.advance(10)
    await eventually(lambda: len(sink.passes) > before)


async def test_pre_and_post_reset_mark_the_whole_gpu(make_backend: MakeBackend) -> None:
    async with monitoring(make_backend, mi300x("cpx_nps4", count=2)) as (_, fake, sink):
        fake.push_event(3, "GPU_PRE_RESET", "reset requested by driver")
        await eventually(lambda: len(sink.of("gpu-reset")) == 8)
        fake.push_event(0, "GPU_POST_RESET")
        await eventually(lambda: len(sink.of("gpu-reset")) == 16)
    resets = sink.of("gpu-reset")
    assert {e.device for e in resets} == {f"gpu-{1 + i}-{128 + i}" for i in range(8)}
    assert all(e.severity is Severity.CRITICAL and e.kind is ConditionKind.EVENT for e in resets)
    assert resets[0].message == "GPU reset started: reset requested by driver"
    assert resets[-1].message == "GPU reset completed"


async def test_thermal_throttle_is_informational_and_vm_fault_is_per_partition(
    make_backend: MakeBackend,
) -> None:
    async with monitoring(make_backend, mi300x("cpx_nps4", count=1)) as (_, fake, sink):
        fake.push_event(2, "THERMAL_THROTTLE")
        fake.push_event(5, "VMFAULT", "page fault at 0xdead")
        fake.push_event(5, "PROCESS_START")  # not subscribed: never delivered
        await eventually(lambda: len(sink.of("thermal-throttle")) == 8 and len(sink.of("vm-fault")) == 1)
        await anyio.sleep(0.05)
    assert all(e.severity is Severity.INFO for e in sink.of("thermal-throttle"))
    (fault,) = sink.of("vm-fault")
    assert (fault.device, fault.severity) == ("gpu-6-133", Severity.INFO)
    assert {e.condition for e in sink.events} == {"thermal-throttle", "vm-fault"}


async def test_ring_hang_where_the_amdsmi_version_has_it(
    make_backend: MakeBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    import enum

    smi = load().module
    members = {m.name: m.value for m in smi.AmdSmiEvtNotificationType} | {"RING_HANG": 14}
    newer = enum.IntEnum("AmdSmiEvtNotificationType", members)  # type: ignore[misc]
    monkeypatch.setattr(smi, "AmdSmiEvtNotificationType", newer)
    monkeypatch.setattr(smi.amdsmi_interface, "AmdSmiEvtNotificationType", newer)
    async with monitoring(make_backend, mi210(2)) as (_, fake, sink):
        await eventually(lambda: bool(fake.event_mask(0) & (1 << 13)))
        fake.push_event(1, "14", "ring gfx_0.0.0 timeout")
        await eventually(lambda: len(sink.of("ring-hang")) == 1)
    (hang,) = sink.of("ring-hang")
    assert (hang.device, hang.severity) == ("gpu-2-129", Severity.CRITICAL)


async def test_events_unavailable_marks_unmonitored_until_they_open(
    make_backend: MakeBackend, fake_clock: FakeClock
) -> None:
    async with monitoring(make_backend, mi210(2), events_status=STATUS_NO_PERM) as (_, fake, sink):
        await eventually(lambda: len(sink.of("unmonitored")) == 2)
        await next_poll(sink, fake_clock)  # still failing: reported once
        assert len(sink.of("unmonitored")) == 2
        fake.set_behaviour(events_status=0)
        await next_poll(sink, fake_clock)
        await eventually(lambda: len(sink.of("unmonitored")) == 4)
    marks = sink.of("unmonitored")
    assert all(e.value == "events" and e.severity is Severity.WARNING for e in marks)
    assert all(e.kind is ConditionKind.STATE for e in marks)
    assert [e.cleared for e in marks] == [False, False, True, True]
    assert "STATUS_NO_PERM" in marks[0].message


async def test_quiet_reads_are_quiet(
    make_backend: MakeBackend, fake_clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """No event pending: the read raises NO_DATA (rocm_smi.cc rsmi_event_notification_get), and a
    first read may answer a stale errno: neither is "events unavailable" (issue 30 #1)."""
    caplog.set_level(logging.WARNING, "agent.backends.amd")
    backend, fake = make_backend(mi300x(count=2), settings=dict(SETTINGS))
    fake.set_behaviour(first_read_status=STATUS_NOT_SUPPORTED)
    await backend.start()
    await backend.discover()
    sink = Sink()
    async with anyio.create_task_group() as tg:
        tg.start_soon(backend.monitor_health, sink)
        await eventually(lambda: fake.calls("amdsmi_get_gpu_event_notification") >= 5)
        fake.push_event(0, "GPU_PRE_RESET")
        await eventually(lambda: len(sink.of("gpu-reset")) == 1)
        before = fake.calls("amdsmi_get_gpu_event_notification")
        await eventually(lambda: fake.calls("amdsmi_get_gpu_event_notification") >= before + 5)
        tg.cancel_scope.cancel()
    await backend.stop()
    assert sink.of("unmonitored") == []
    assert "unavailable" not in caplog.text


async def test_event_reads_failing_in_a_row_mark_unmonitored_then_recover(
    make_backend: MakeBackend, fake_clock: FakeClock
) -> None:
    async with monitoring(make_backend, mi210(1)) as (_, fake, sink):
        fake.set_behaviour(read_status=STATUS_NOT_SUPPORTED)  # every read
        await eventually(lambda: len(sink.of("unmonitored")) == 1)
        fake.set_behaviour(read_status=0)
        fake_clock.advance(10)
        await eventually(lambda: len(sink.of("unmonitored")) == 2)
    down, up = sink.of("unmonitored")
    assert (down.value, down.cleared, up.value, up.cleared) == ("events", False, "events", True)


async def test_ecc_rise_reports_block_and_baseline_is_silent(
    make_backend: MakeBackend, fake_clock: FakeClock
) -> None:
    gpus = mi300x("cpx_nps4", count=1)
    gpus[0].ecc_uncorrectable = {"UMC": 3}  # errors from before the agent started
    async with monitoring(make_backend, gpus) as (_, _, sink):
        await next_poll(sink, fake_clock)
        assert sink.of("ecc-uncorrectable") == []
        gpus[0].ecc_uncorrectable = {"UMC": 5, "GFX": 1}
        await next_poll(sink, fake_clock)
        assert len(sink.of("ecc-uncorrectable")) == 16  # two blocks x eight partitions
        await next_poll(sink, fake_clock)  # the counter stopped rising: nothing new
        assert len(sink.of("ecc-uncorrectable")) == 16
    umc = [e for e in sink.of("ecc-uncorrectable") if e.value == "umc"]
    assert len(umc) == 8 and umc[0].severity is Severity.CRITICAL and umc[0].kind is ConditionKind.EVENT
    assert umc[0].message == "2 new uncorrectable errors in umc (5 since boot)"


async def test_ras_unavailable_is_unmonitored_until_it_appears(
    make_backend: MakeBackend, fake_clock: FakeClock
) -> None:
    gpus = mi210(1)
    gpus[0].ecc_enabled_mask = 0  # a VM guest: no RAS
    async with monitoring(make_backend, gpus) as (_, _, sink):
        await eventually(lambda: len(sink.of("unmonitored")) == 1)
        gpus[0].unsupported.add("amdsmi_get_gpu_ecc_enabled")
        await next_poll(sink, fake_clock)
        assert len(sink.of("unmonitored")) == 1  # still unmonitored, reported once
        gpus[0].unsupported.discard("amdsmi_get_gpu_ecc_enabled")
        gpus[0].ecc_enabled_mask = 1
        await next_poll(sink, fake_clock)
    down, up = sink.of("unmonitored")
    assert (down.value, down.kind, down.cleared) == ("ras", ConditionKind.STATE, False)
    assert "VM guest" in down.message
    assert (up.value, up.cleared) == ("ras", True)


async def test_fatal_cper_within_max_age_only(make_backend: MakeBackend, fake_clock: FakeClock) -> None:
    def stamp(seconds_ago: float) -> str:
        return time.strftime("%Y/%m/%d %H:%M:%S", time.gmtime(fake_clock.time() - seconds_ago))

    gpus = mi300x(count=1)
    gpus[0].cper = [cper_record(stamp(86400), record_id="old")]  # kept across a reboot
    async with monitoring(make_backend, gpus) as (_, _, sink):
        gpus[0].cper = [
            *gpus[0].cper,
            cper_record(stamp(5), severity="non_fatal_corrected", record_id="c"),
            cper_record(stamp(5), notify_type="PCIE", record_id="new"),
        ]
        await next_poll(sink, fake_clock)
        await next_poll(sink, fake_clock)  # the cursor moved on: no repeat
    (fatal,) = sink.of("cper-fatal")
    assert (fatal.device, fatal.value, fatal.severity) == ("gpu-1-128", "pcie", Severity.CRITICAL)
    assert fatal.message.startswith("fatal CPER record new at ")  # bytes decoded (issue 30 #8)


async def test_cper_unsupported_is_not_unmonitored(make_backend: MakeBackend, fake_clock: FakeClock) -> None:
    async with monitoring(make_backend, mi210(1)) as (_, fake, sink):
        await next_poll(sink, fake_clock)
    assert sink.events == []
    assert fake.calls("amdsmi_get_gpu_cper_entries") == 1  # not asked again once unsupported


async def test_gpu_lost_and_back(make_backend: MakeBackend, fake_clock: FakeClock) -> None:
    gpus = mi300x(count=2)
    async with monitoring(make_backend, gpus) as (_, _, sink):
        gpus[1].lost = True
        await next_poll(sink, fake_clock)
        await next_poll(sink, fake_clock)  # reported once
        gpus[1].lost = False
        await next_poll(sink, fake_clock)
    lost, back = sink.of("gpu-lost")
    assert (lost.device, lost.severity, lost.kind, lost.cleared) == (
        "gpu-2-129",
        Severity.CRITICAL,
        ConditionKind.STATE,
        False,
    )
    assert "amdsmi_get_gpu_vram_usage: AMDSMI_STATUS_DRM_ERROR" in lost.message
    assert (back.device, back.cleared) == ("gpu-2-129", True)


def test_read_ecc_unsupported_block_is_skipped(standin: StandIn) -> None:
    smi = standin.module
    gpu = standin.configure(mi210(1)).gpus[0]
    gpu.ecc_enabled_mask = 0b11
    gpu.ecc_uncorrectable = {"UMC": 1, "SDMA": 2}
    smi.amdsmi_init()
    gpu.fail = {"amdsmi_get_gpu_ecc_count": STATUS_NOT_FOUND}
    assert read_ecc(smi, standin.handle(0))[0] is None
    gpu.fail = {}
    gpu.ecc_enabled_mask = 0b1 | 0b1000_0000_0000_0000_0000  # a block without counters: NOT_SUPPORTED
    assert read_ecc(smi, standin.handle(0)) == (EccReading({"umc": 1}, {"umc": 0}), "")
    smi.amdsmi_shut_down()


async def test_reset_taints_then_recovers_after_hold(
    make_backend: MakeBackend, fake_clock: FakeClock
) -> None:
    backend, fake = make_backend(mi210(1), settings=dict(SETTINGS))
    await backend.start()
    inventory = Inventory(backend.driver_name)
    inventory.set_devices(await backend.discover())
    tracker = HealthTracker(inventory, fake_clock, hold_seconds=60)
    async with anyio.create_task_group() as tg:
        tg.start_soon(backend.monitor_health, tracker.handle)
        fake.push_event(0, "GPU_PRE_RESET")
        await eventually(lambda: inventory.devices()[0].health.status is HealthStatus.UNHEALTHY)
        fake_clock.advance(61)
        tracker.expire()
        assert inventory.devices()[0].health.status is HealthStatus.HEALTHY
        tg.cancel_scope.cancel()
    await backend.stop()


async def test_shutdown_while_waiting_for_events_is_prompt(make_backend: MakeBackend) -> None:
    backend, fake = make_backend(mi300x(count=2), settings={**SETTINGS, "event-timeout-ms": "200"})
    await backend.start()
    await backend.discover()
    with anyio.fail_after(2):  # cancellation waits for at most one event read (200 ms)
        async with anyio.create_task_group() as tg:
            tg.start_soon(backend.monitor_health, Sink())
            await eventually(lambda: fake.event_mask(0) != 0 and fake.event_mask(1) != 0)
            await anyio.sleep(0.05)  # the reader is now blocked in read()
            tg.cancel_scope.cancel()
    assert fake.calls("amdsmi_stop_gpu_event_notification") == 2
    assert fake.event_mask(0) == fake.event_mask(1) == 0
    await backend.stop()


async def test_no_devices_waits_quietly(make_backend: MakeBackend) -> None:
    backend, _ = make_backend([], settings=dict(SETTINGS))
    await backend.start()
    with anyio.move_on_after(0.05) as scope:
        await backend.monitor_health(Sink())  # discovers itself first
    assert scope.cancelled_caught
    await backend.stop()


def test_open_readers_tolerates_one_lost_gpu_but_not_all(standin: StandIn) -> None:
    smi = standin.module
    standin.configure(mi210(2))
    smi.amdsmi_init()
    standin.gpus[1].lost = True
    handles = [standin.handle(0), standin.handle(1)]
    assert len(open_readers(smi, handles)) == 1
    standin.gpus[0].lost = True
    with pytest.raises(AmdSmiLibraryException):
        open_readers(smi, handles)
    smi.amdsmi_shut_down()


async def test_rediscovery_restarts_monitoring_with_the_new_devices(make_backend: MakeBackend) -> None:
    """amdsmi lists what it found at amdsmi_init until shut down: rediscovery re-initialises it,
    so a GPU that appears later is seen without a restart (issue 30 #5)."""
    gpus = mi210(2)
    later = gpus.pop()
    async with monitoring(make_backend, gpus) as (backend, fake, sink):
        await eventually(lambda: fake.event_mask(0) != 0)
        index = fake.add(later)  # the GPU comes back
        assert len(await backend.discover()) == 2
        await eventually(lambda: fake.event_mask(index) != 0)
        fake.push_event(index, "GPU_PRE_RESET")
        await eventually(lambda: len(sink.of("gpu-reset")) == 1)
    assert sink.of("gpu-reset")[0].device == "gpu-2-129"
    assert fake.calls("amdsmi_init") == 2 and fake.calls("amdsmi_shut_down") >= 1


def test_close_readers_never_raises() -> None:
    class Broken:
        def stop(self) -> None:
            raise AmdSmiLibraryException(STATUS_NOT_FOUND)

    close_readers(load().module, [Broken(), Broken()])
