"""The AMD health pass (issue 23): report_pass, bad pages, trends, unsupported and hung checks,
lost statuses met outside the pass, ECC reads shared with telemetry, and its settings."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

from agent.core.backend import (
    GPU_LOST,
    BackendOptions,
    ConditionKind,
    PollsHealth,
    ReportsConditions,
    ReportsTrends,
    declared_checks,
    declared_trends,
)
from agent.core.errors import ConfigError
from agent.core.model import Severity
from backends.amd.backend import AmdBackend
from backends.amd.trends import RateWindow
from tests.amd.conftest import MakeBackend
from tests.amd.test_health import SETTINGS, Sink, eventually, monitoring, next_poll
from tests.fakes.amd_standin import (
    PAGE_PENDING,
    PAGE_UNRESERVABLE,
    STATUS_DRIVER_NOT_LOADED,
    STATUS_NOT_FOUND,
    AmdSmiLibraryException,
    StandIn,
    bad_page,
    mi210,
    mi300x,
)
from tests.support.clock import FakeClock

# A trend window of one interval: each pass judges the rate since the one before.
TREND_SETTINGS = {**SETTINGS, "trend-window": "10", "ecc-correctable-rate": "6", "pcie-replay-rate": "8"}
SKIP_LOG = "health check not supported on this GPU; skipping it"


def names(first: int, count: int) -> set[str]:
    return {f"gpu-{first + i}-{127 + first + i}" for i in range(count)}


@pytest.fixture
def wedge() -> Iterator[threading.Event]:
    released = threading.Event()
    yield released
    released.set()


def test_the_backend_declares_its_checks_and_trends() -> None:
    backend = AmdBackend(BackendOptions("node-1"))
    assert isinstance(backend, PollsHealth) and isinstance(backend, ReportsTrends)
    assert isinstance(backend, ReportsConditions)
    assert declared_checks(backend) == (
        "answers",
        "ecc-uncorrectable",
        "bad-pages",
        "cper",
        "ecc-correctable-rate",
        "pcie-replay-rate",
        "xgmi-errors",
    )
    trends = declared_trends(backend)
    assert trends == {"ecc-correctable-rate", "pcie-replay-rate", "xgmi-errors"}
    assert trends <= set(backend.health_conditions)
    assert {GPU_LOST, "bad-pages"} <= set(backend.health_conditions)


async def test_every_pass_reports_the_published_devices_it_looked_at(
    make_backend: MakeBackend, fake_clock: FakeClock
) -> None:
    async with monitoring(make_backend, mi300x("cpx_nps4", count=2)) as (_, _, sink):
        await next_poll(sink, fake_clock)
        await next_poll(sink, fake_clock)
    assert len(sink.passes) >= 3
    for devices, failed in sink.passes:
        assert devices == names(1, 16)  # both GPUs' eight partitions each
        assert failed == []
    assert sink.events == []


async def test_a_lost_gpu_is_looked_at(make_backend: MakeBackend, fake_clock: FakeClock) -> None:
    gpus = mi210(2)
    async with monitoring(make_backend, gpus) as (_, _, sink):
        gpus[0].lost = True
        await next_poll(sink, fake_clock)
    assert sink.passes[-1] == (names(1, 2), [])
    (lost,) = sink.of(GPU_LOST)
    assert lost.device == "gpu-1-128"


async def test_bad_pages_pending_then_threshold_then_cleared(
    make_backend: MakeBackend, fake_clock: FakeClock
) -> None:
    gpus = mi300x("cpx_nps4", count=1)
    gpus[0].bad_page_threshold = 3
    async with monitoring(make_backend, gpus) as (_, _, sink):
        gpus[0].bad_pages = [bad_page(0x1000, PAGE_PENDING)]
        await next_poll(sink, fake_clock)
        await next_poll(sink, fake_clock)  # unchanged: not reported again
        assert len(sink.of("bad-pages")) == 8
        gpus[0].bad_pages = [
            bad_page(0x1000),
            bad_page(0x2000),
            bad_page(0x3000, PAGE_UNRESERVABLE),
        ]
        await next_poll(sink, fake_clock)
        assert len(sink.of("bad-pages")) == 16
        gpus[0].bad_page_threshold = 10  # e.g. the driver's bad_page_threshold raised
        await next_poll(sink, fake_clock)
    marks = [e for e in sink.of("bad-pages") if e.device == "gpu-1-128"]
    assert [(e.severity, e.cleared) for e in marks] == [
        (Severity.WARNING, False),
        (Severity.CRITICAL, False),
        (Severity.CRITICAL, True),
    ]
    assert all(e.kind is ConditionKind.STATE for e in marks)
    assert marks[0].message.startswith("1 bad VRAM pages pending retirement")
    assert "threshold of 3" in marks[1].message


async def test_correctable_ecc_rate_over_and_under_its_threshold(
    make_backend: MakeBackend, fake_clock: FakeClock
) -> None:
    gpus = mi300x("cpx_nps4", count=1)
    async with monitoring(make_backend, gpus, settings=TREND_SETTINGS) as (_, _, sink):
        gpus[0].ecc_correctable = {"UMC": 1}  # 6 per minute: at the threshold, not above it
        await next_poll(sink, fake_clock)
        assert sink.of("ecc-correctable-rate") == []
        gpus[0].ecc_correctable = {"UMC": 2, "GFX": 1}  # 12 per minute
        await next_poll(sink, fake_clock)
        assert len(sink.of("ecc-correctable-rate")) == 8
        await next_poll(sink, fake_clock)  # no new errors: back under it
    marks = [e for e in sink.of("ecc-correctable-rate") if e.device == "gpu-1-128"]
    assert [(e.severity, e.kind, e.cleared) for e in marks] == [
        (Severity.INFO, ConditionKind.STATE, False),
        (Severity.INFO, ConditionKind.STATE, True),
    ]
    assert marks[0].message == "12.0 correctable ECC errors per minute over the last 10 s (threshold 6)"
    assert sink.of("ecc-uncorrectable") == []


async def test_pcie_replay_rate_over_and_under_its_threshold(
    make_backend: MakeBackend, fake_clock: FakeClock
) -> None:
    gpus = mi210(1)
    async with monitoring(make_backend, gpus, settings=TREND_SETTINGS) as (_, _, sink):
        gpus[0].pcie_replay_count = 1  # 6 per minute
        await next_poll(sink, fake_clock)
        assert sink.of("pcie-replay-rate") == []
        gpus[0].pcie_replay_count = 3  # 12 per minute
        await next_poll(sink, fake_clock)
        await next_poll(sink, fake_clock)
    raised, cleared = sink.of("pcie-replay-rate")
    assert (raised.severity, raised.cleared, cleared.cleared) == (Severity.INFO, False, True)
    assert raised.message.startswith("12.0 PCIe replays per minute")


async def test_xgmi_errors_while_the_status_says_so(make_backend: MakeBackend, fake_clock: FakeClock) -> None:
    gpus = mi300x(count=2)
    async with monitoring(make_backend, gpus) as (_, _, sink):
        gpus[1].xgmi_status = 2
        await next_poll(sink, fake_clock)
        await next_poll(sink, fake_clock)
        gpus[1].xgmi_status = 0  # reset (amd-smi reset --xgmi-err)
        await next_poll(sink, fake_clock)
    raised, cleared = sink.of("xgmi-errors")
    assert (raised.device, raised.severity, raised.kind) == ("gpu-2-129", Severity.INFO, ConditionKind.STATE)
    assert raised.message == "the XGMI link reports multiple errors"
    assert (cleared.device, cleared.cleared) == ("gpu-2-129", True)


async def test_an_unsupported_check_is_skipped_with_one_log_line(
    make_backend: MakeBackend, fake_clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "agent.backends.amd")
    gpus = mi210(1)  # no XGMI, no CPER
    gpus[0].bad_page_threshold = None  # without root amdsmi answers NOT_SUPPORTED
    gpus[0].pcie_replay_count = None  # UINT64_MAX: the binding gives "N/A"
    async with monitoring(make_backend, gpus) as (_, fake, sink):
        for _ in range(5):
            await next_poll(sink, fake_clock)
        gpus[0].bad_pages = [bad_page(0x1000, PAGE_PENDING)]  # the rest still works
        await next_poll(sink, fake_clock)
    skipped = [r for r in caplog.records if r.getMessage() == SKIP_LOG]
    checks = sorted(r.__dict__["fields"]["check"] for r in skipped)
    assert checks == ["bad-page-threshold", "cper", "pcie-replay-rate", "xgmi-errors"]
    assert fake.calls("amdsmi_gpu_xgmi_error_status") == 1
    assert fake.calls("amdsmi_get_gpu_bad_page_threshold") == 1
    assert all(failed == [] and devices == {"gpu-1-128"} for devices, failed in sink.passes)
    (pending,) = sink.of("bad-pages")
    assert pending.severity is Severity.WARNING


async def test_a_lost_status_from_one_check_while_the_gpu_answers_skips_that_check(
    make_backend: MakeBackend, fake_clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpus = mi210(1)
    gpus[0].fail = {"amdsmi_get_gpu_bad_page_info": STATUS_NOT_FOUND}  # no RAS EEPROM table here
    backend, _ = make_backend(gpus, settings=dict(SETTINGS))
    await backend.start()
    await backend.discover()
    sink = Sink()
    async with anyio.create_task_group() as tg:
        tg.start_soon(backend.monitor_health, sink)
        await eventually(lambda: len(sink.passes) >= 1)
        await next_poll(sink, fake_clock)
        tg.cancel_scope.cancel()
    await backend.stop()
    assert sink.events == []
    assert all(devices == {"gpu-1-128"} for devices, _ in sink.passes)


async def test_a_hung_check_fails_the_check_not_the_gpu(standin: StandIn, fake_clock: FakeClock) -> None:
    fake = standin.configure(mi210(2))
    backend = AmdBackend(BackendOptions("node-1", None, dict(SETTINGS)), clock=fake_clock, call_timeout=0.2)
    await backend.start()
    await backend.discover()
    fake.set_behaviour(hang="amdsmi_get_gpu_bad_page_info")
    sink = Sink()
    async with anyio.create_task_group() as tg:
        tg.start_soon(backend.monitor_health, sink)
        await eventually(lambda: len(sink.passes) >= 1)
        # The first GPU's call hangs: the pass ends there (the other GPU would only wait for the lane).
        assert sink.passes[0] == (set(), ["bad-pages"])
        await next_poll(sink, fake_clock)  # the lane is still held: the same check is named
        assert sink.passes[1] == (set(), ["bad-pages"])
        fake.release()  # the call returns, and the lane is free again
        await next_poll(sink, fake_clock)
        tg.cancel_scope.cancel()
    await backend.stop()
    assert sink.passes[-1] == (names(1, 2), [])
    assert sink.of(GPU_LOST) == []


async def test_a_lost_status_met_by_telemetry_is_reported_by_the_next_pass(
    make_backend: MakeBackend, fake_clock: FakeClock
) -> None:
    gpus = mi210(2)
    async with monitoring(make_backend, gpus) as (backend, _, sink):
        gpus[1].lost = True
        await backend.telemetry()  # DRM calls answer DRM_ERROR, sysfs reads an unknown error
        gpus[1].lost = False  # back before the pass looks (a reset): the loss is not silent
        await next_poll(sink, fake_clock)
        assert [d.name for d in await backend.discover()] == ["gpu-1-128", "gpu-2-129"]
        await next_poll(sink, fake_clock)
    lost, back = sink.of(GPU_LOST)
    assert (lost.device, lost.severity, lost.kind, lost.cleared) == (
        "gpu-2-129",
        Severity.CRITICAL,
        ConditionKind.STATE,
        False,
    )
    assert lost.message.startswith("GPU stopped answering: telemetry: amdsmi_get_gpu_vram_usage")
    assert "STATUS_DRM_ERROR" in lost.message
    assert (back.device, back.cleared) == ("gpu-2-129", True)


async def test_one_failing_sensor_is_not_a_lost_gpu(make_backend: MakeBackend, fake_clock: FakeClock) -> None:
    gpus = mi210(1)
    async with monitoring(make_backend, gpus) as (backend, _, sink):
        gpus[0].fail = {"amdsmi_get_power_info": STATUS_NOT_FOUND}  # no hwmon
        (reading,) = await backend.telemetry()
        assert reading.power_watts is None and reading.memory_total_bytes is not None
        await next_poll(sink, fake_clock)
    assert sink.of(GPU_LOST) == []


async def test_rediscovery_keeps_a_lost_gpu_published(
    make_backend: MakeBackend, fake_clock: FakeClock
) -> None:
    gpus = mi300x("cpx_nps4", count=2)
    async with monitoring(make_backend, gpus) as (backend, fake, sink):
        for gpu in gpus[8:]:
            gpu.lost = True
        devices = await backend.discover()
        assert {d.name for d in devices} == names(1, 16)
        assert [d.name for d in devices] == sorted(
            (d.name for d in devices), key=lambda n: int(n.split("-")[1])
        )
        await next_poll(sink, fake_clock)

        def unloaded() -> list[Any]:
            raise AmdSmiLibraryException(STATUS_DRIVER_NOT_LOADED)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(fake.module, "amdsmi_get_processor_handles", unloaded)
            assert {d.name for d in await backend.discover()} == names(1, 16)  # the driver went away
            await next_poll(sink, fake_clock)
    lost = sink.of(GPU_LOST)
    assert {e.device for e in lost} == names(1, 16)
    assert {e.device for e in lost[:8]} == names(9, 8)  # the second GPU first, then the first
    assert "amdsmi no longer lists this GPU" in lost[-1].message  # its handle is from before the re-init


async def test_telemetry_reuses_the_passs_ecc_reads(make_backend: MakeBackend) -> None:
    gpus = mi300x("cpx_nps4", count=1)
    gpus[0].ecc_correctable = {"UMC": 7, "SDMA": 2}
    gpus[0].ecc_uncorrectable = {"GFX": 1}
    async with monitoring(make_backend, gpus) as (backend, fake, _):
        reads = fake.calls("amdsmi_get_gpu_ecc_count")
        readings = await backend.telemetry()
        await backend.telemetry()
        assert fake.calls("amdsmi_get_gpu_ecc_count") == reads  # telemetry read no counter again
        assert fake.calls("amdsmi_get_gpu_total_ecc_count") == 0
        library_totals = fake.module.amdsmi_get_gpu_total_ecc_count(fake.handle(0))
    assert len(readings) == 8
    # The GPU's counts, on each of its partitions (ECC is per physical GPU), as the library sums them.
    assert {(r.ecc_corrected_total, r.ecc_uncorrected_total) for r in readings} == {(9, 1)}
    assert (library_totals["correctable_count"], library_totals["uncorrectable_count"]) == (9, 1)


def test_the_interval_is_the_agents_unless_overridden() -> None:
    options = BackendOptions("node-1", health_interval=2.5)
    assert AmdBackend(options)._health_settings.poll_interval == 2.5
    override = BackendOptions("node-1", settings={"poll-interval": "7"}, health_interval=2.5)
    assert AmdBackend(override)._health_settings.poll_interval == 7.0


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("ecc-correctable-rate", "0"),
        ("pcie-replay-rate", "-1"),
        ("trend-window", "a minute"),
        ("poll-interval", ""),
    ],
)
def test_bad_threshold_settings(key: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"--backend amd:{key}.*a positive number") as info:
        AmdBackend(BackendOptions("node-1", settings={key: value}))
    assert info.value.option == f"--backend amd:{key}"


def test_a_rate_is_judged_over_a_whole_window() -> None:
    window = RateWindow(60)
    assert window.add(0, 0) is None
    assert window.add(30, 5) is None  # half a window: no verdict yet
    assert window.add(60, 6) == pytest.approx(6.0)
    assert window.add(90, 6) == pytest.approx(1.0 * 60 / 60)  # from the sample at 30: 1 in 60 s
    assert window.add(100, 2) is None  # the counter went back (a reset): start over
    assert window.add(160, 2) == 0.0
