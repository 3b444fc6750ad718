"""The NVIDIA health pass (issue 23): checks on an interval, independent of NVML events."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pynvml as real
import pytest

from agent.core.backend import BackendOptions, ConditionKind, declared_checks, declared_trends
from agent.core.errors import ConfigError
from agent.core.model import Severity
from backends.nvidia import NvidiaBackend
from backends.nvidia.checks import TREND_WINDOW, GpuChecks, TrendThresholds
from tests.fakes.libnvml import LibNvml, a100_mig, h100, l4, l40s, t4
from tests.nvidia.conftest import BackendFactory, Sink, monitoring
from tests.support.clock import FakeClock

H100 = "GPU-h1000000-0000-0000-0000-000000000000"
A100 = "GPU-a1000001-0000-0000-0000-000000000000"
T4 = "GPU-00t40004-0000-0000-0000-000000000000"
A100_DEVICES = {
    "gpu-1-mig-1g10gb-19-2",
    "gpu-1-mig-1g10gb-19-3",
    "gpu-1-mig-2g20gb-14-0",
    "gpu-1-mig-3g40gb-9-4",
}
INTERVAL = 5.0


def node() -> LibNvml:
    return LibNvml([h100(0), a100_mig(1), l4(3), t4(4)])


async def passes(sink: Sink, clock: FakeClock, count: int) -> None:
    """Run `count` more passes: one health interval each."""
    for _ in range(count):
        seen = len(sink.passes)
        clock.advance(INTERVAL)
        await sink.wait_passes(seen + 1)


def of(sink: Sink, condition: str) -> list[tuple[str, str, bool]]:
    return [(e.device, e.value, e.cleared) for e in sink.events if e.condition == condition]


def test_backend_declares_checks_trends_and_conditions() -> None:
    backend = NvidiaBackend(BackendOptions("node-1"), nvml_module=LibNvml([]).module)
    assert declared_checks(backend) == (
        "answers",
        "ecc-uncorrectable",
        "retired-pages",
        "row-remap",
        "recovery-action",
        "ecc-correctable-rate",
        "pcie-replay-rate",
        "nvlink-errors",
    )
    assert declared_trends(backend) == {"ecc-correctable-rate", "pcie-replay-rate", "nvlink-errors"}
    assert declared_trends(backend) <= set(backend.health_conditions)
    for condition in ("gpu-lost", "ecc-uncorrectable", "retired-pages-pending", "row-remap-failure"):
        assert condition in backend.health_conditions
    assert {"row-remap-pending", "recovery-action"} <= set(backend.health_conditions)


async def test_first_pass_at_start_reports_every_device_looked_at(make_backend: BackendFactory) -> None:
    sink = Sink()
    async with monitoring(make_backend(node(), health_wait_ms="20"), sink):
        await sink.wait_passes(1)
    assert sink.passes[0].devices == {"gpu-0", "gpu-3", "gpu-4", *A100_DEVICES}
    assert sink.passes[0].failed_checks == ()
    assert sink.events == []  # healthy GPUs: nothing to say


async def test_row_remap_pending_and_failure_raise_and_clear(
    make_backend: BackendFactory, fake_clock: FakeClock
) -> None:
    """nvml.h:8438-8453: nvmlDeviceGetRemappedRows is NOT_SUPPORTED while MIG is enabled, so the
    first pass on the A100 (MIG on) cannot read rows; once MIG is turned off the rows are read
    (the check was not given up for the life of the process)."""
    fake = node()
    sink = Sink()
    async with monitoring(make_backend(fake, health_wait_ms="20"), sink):
        await sink.wait_passes(1)
        fake.gpu(A100).mig_mode = (0, 0)  # an admin turns MIG off (the published devices stay)
        fake.gpu(A100).remapped_rows = (0, 1, 1, 0)  # pending: a reset applies it
        await passes(sink, fake_clock, 1)
        assert {(d, v, c) for d, v, c in of(sink, "row-remap-pending")} == {
            (d, "", False) for d in A100_DEVICES
        }
        await passes(sink, fake_clock, 2)  # no repeat while it lasts
        assert len(of(sink, "row-remap-pending")) == 4
        fake.gpu(A100).remapped_rows = (0, 1, 0, 1)  # remapping failed
        await passes(sink, fake_clock, 1)
        fake.gpu(A100).remapped_rows = (0, 0, 0, 0)  # the GPU was replaced or repaired
        await passes(sink, fake_clock, 1)
    pending = [e for e in sink.events if e.condition == "row-remap-pending"]
    failure = [e for e in sink.events if e.condition == "row-remap-failure"]
    assert [e.cleared for e in pending] == [False] * 4 + [True] * 4
    assert {(e.severity, e.kind) for e in pending} == {(Severity.WARNING, ConditionKind.STATE)}
    assert [e.cleared for e in failure] == [False] * 4 + [True] * 4
    assert {(e.severity, e.kind) for e in failure} == {(Severity.CRITICAL, ConditionKind.STATE)}


async def test_retired_pages_pending_on_an_older_gpu(
    make_backend: BackendFactory, fake_clock: FakeClock
) -> None:
    fake = node()
    sink = Sink()
    async with monitoring(make_backend(fake, health_wait_ms="20"), sink):
        await sink.wait_passes(1)
        fake.gpu(T4).retired_pending = True
        await passes(sink, fake_clock, 1)
        fake.gpu(T4).retired_pending = False  # after a reboot
        await passes(sink, fake_clock, 1)
    assert of(sink, "retired-pages-pending") == [("gpu-4", "", False), ("gpu-4", "", True)]
    assert sink.events[0].severity is Severity.WARNING and sink.events[0].kind is ConditionKind.STATE


@pytest.mark.parametrize(
    ("action", "value"),
    [
        (real.NVML_GPU_RECOVERY_ACTION_GPU_RESET, "gpu-reset"),
        (real.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT, "node-reboot"),
        (real.NVML_GPU_RECOVERY_ACTION_DRAIN_P2P, "drain-p2p"),
        (real.NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET, "drain-and-reset"),
    ],
)
async def test_recovery_action_state(
    make_backend: BackendFactory, fake_clock: FakeClock, action: int, value: str
) -> None:
    fake = node()
    sink = Sink()
    async with monitoring(make_backend(fake, health_wait_ms="20"), sink):
        await sink.wait_passes(1)
        fake.gpu(H100).recovery_action = int(action)
        await passes(sink, fake_clock, 1)
        fake.gpu(H100).recovery_action = int(real.NVML_GPU_RECOVERY_ACTION_NONE)
        await passes(sink, fake_clock, 1)
    assert of(sink, "recovery-action") == [("gpu-0", value, False), ("gpu-0", value, True)]
    assert sink.events[0].severity is Severity.CRITICAL and sink.events[0].kind is ConditionKind.STATE


async def test_recovery_action_that_changes_clears_the_old_value(
    make_backend: BackendFactory, fake_clock: FakeClock
) -> None:
    fake = node()
    fake.gpu(H100).recovery_action = int(real.NVML_GPU_RECOVERY_ACTION_GPU_RESET)
    sink = Sink()
    async with monitoring(make_backend(fake, health_wait_ms="20"), sink):
        await sink.wait_passes(1)
        fake.gpu(H100).recovery_action = int(real.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT)
        await passes(sink, fake_clock, 1)
    assert of(sink, "recovery-action") == [
        ("gpu-0", "gpu-reset", False),
        ("gpu-0", "gpu-reset", True),
        ("gpu-0", "node-reboot", False),
    ]


async def test_ecc_counter_reset_is_a_new_baseline(
    make_backend: BackendFactory, fake_clock: FakeClock
) -> None:
    fake = node()
    fake.gpu(H100).ecc_uncorrected = 4
    sink = Sink()
    async with monitoring(make_backend(fake, health_wait_ms="20"), sink):
        await sink.wait_passes(1)
        fake.gpu(H100).ecc_uncorrected = 0  # a GPU reset clears the volatile counters
        await passes(sink, fake_clock, 1)
        fake.raise_ecc(H100, uncorrected=1)
        await passes(sink, fake_clock, 1)
    assert of(sink, "ecc-uncorrectable") == [("gpu-0", "", False)]


@pytest.mark.parametrize(
    ("trend", "setting", "rise"),
    [
        ("ecc-correctable-rate", "ecc_correctable_rate", "ecc"),
        ("pcie-replay-rate", "pcie_replay_rate", "pcie"),
        ("nvlink-errors", "nvlink_error_rate", "nvlink"),
    ],
)
async def test_trend_over_threshold_is_raised_and_cleared_once_under(
    make_backend: BackendFactory, fake_clock: FakeClock, trend: str, setting: str, rise: str
) -> None:
    fake = node()
    gpu = fake.gpu(H100)
    gpu.nvlinks[5] = False
    gpu.nvlink_errors[(5, int(real.NVML_NVLINK_ERROR_DL_RECOVERY))] = 10_000  # an inactive link: not counted

    def add(count: int) -> None:
        if rise == "ecc":
            fake.raise_ecc(H100, corrected=count)
        elif rise == "pcie":
            gpu.pcie_replays = (gpu.pcie_replays or 0) + count
        else:
            # Spread over links and the three counters summed.
            for link, counter in (
                (0, real.NVML_NVLINK_ERROR_DL_REPLAY),
                (3, real.NVML_NVLINK_ERROR_DL_CRC_FLIT),
            ):
                key = (link, int(counter))
                gpu.nvlink_errors[key] = gpu.nvlink_errors.get(key, 0) + count // 2

    sink = Sink()
    async with monitoring(make_backend(fake, health_wait_ms="20", **{setting: "20"}), sink):
        await sink.wait_passes(1)
        add(20)  # 20 in a minute: at the threshold, not over
        await passes(sink, fake_clock, 1)
        assert of(sink, trend) == []
        add(2)
        await passes(sink, fake_clock, 1)
        assert of(sink, trend) == [("gpu-0", "", False)]
        raised = next(e for e in sink.events if e.condition == trend)
        assert (raised.severity, raised.kind) == (Severity.INFO, ConditionKind.STATE)
        assert "22.0 errors per minute" in raised.message
        # Quiet: once the errors are older than the window, the rate is back under.
        await passes(sink, fake_clock, int(TREND_WINDOW / INTERVAL))
    assert of(sink, trend) == [("gpu-0", "", False), ("gpu-0", "", True)]
    assert all(e.device == "gpu-0" for e in sink.events)
    # Link states are asked once a minute, not every pass (15 passes over 70 s: H100 18 links + the
    # end, A100 12 + 1); the L4 and T4 have none: asked once (link 0 NOT_SUPPORTED), then skipped.
    assert fake.count("nvmlDeviceGetNvLinkState") == 2 * (19 + 13) + 2


def test_trend_rate_counts_the_last_minute_without_extrapolating() -> None:
    checks = GpuChecks()
    assert checks.rate("t", 0.0, 100) is None  # the baseline
    assert checks.rate("t", 5.0, 101) == pytest.approx(1.0)  # one error in 5 s is 1 per minute
    assert checks.rate("t", 65.0, 131) == pytest.approx(30.0)  # 101 -> 131 over the last 60 s
    assert checks.rate("t", 130.0, 131) == pytest.approx(0.0)
    assert checks.rate("t", 135.0, 3) is None  # counter reset: a new baseline
    assert checks.rate("t", 335.0, 203) == pytest.approx(60.0)  # 200 over 200 s


async def test_unsupported_checks_are_skipped_with_one_log_line(
    make_backend: BackendFactory, fake_clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    gpu = l40s(5)  # no row remapping, no retired pages, no NVLink
    gpu.recovery_action = None
    gpu.ecc = False
    fake = LibNvml([gpu])
    sink = Sink()
    with caplog.at_level(logging.INFO, logger="agent.backends.nvidia.health"):
        async with monitoring(make_backend(fake, health_wait_ms="20"), sink):
            await sink.wait_passes(1)
            await passes(sink, fake_clock, 10)
    skipped = [r for r in caplog.records if "not supported" in r.getMessage()]
    checks = sorted(str(getattr(r, "fields", {}).get("check")) for r in skipped)
    assert checks == [
        "ecc-correctable-rate",
        "ecc-uncorrectable",
        "nvlink-errors",
        "recovery-action",
        "retired-pages",
        "row-remap",
    ]
    assert all(r.levelno == logging.INFO for r in skipped)
    for call in (
        "nvmlDeviceGetRemappedRows",
        "nvmlDeviceGetRetiredPagesPendingStatus",
        "nvmlDeviceGetNvLinkState",
        "nvmlDeviceGetFieldValues",
    ):
        assert fake.count(call) == 1, call
    assert fake.count("nvmlDeviceGetTotalEccErrors") == 2
    assert fake.count("nvmlDeviceGetPcieReplayCounter") == 11  # supported: read every pass
    assert all(p.devices == {"gpu-5"} and p.failed_checks == () for p in sink.passes)
    assert sink.events == []


@pytest.fixture
def released() -> Iterator[list[LibNvml]]:
    """Fakes to release at the end (no hung worker thread outlives the test)."""
    fakes: list[LibNvml] = []
    yield fakes
    for fake in fakes:
        fake.release()


async def test_hanging_check_call_is_a_failed_check_not_a_lost_gpu(
    make_backend: BackendFactory, released: list[LibNvml], caplog: pytest.LogCaptureFixture
) -> None:
    fake = LibNvml([h100(0), l4(3)])
    released.append(fake)
    fake.hang("nvmlDeviceGetRemappedRows")
    sink = Sink()
    async with monitoring(make_backend(fake, health_wait_ms="20", call_timeout=0.2), sink):
        await sink.wait_passes(1)
        fake.release()
    assert sink.passes[0].failed_checks == ("row-remap",)
    # The H100 (first) hung: it and the GPUs after it on the held lane are not looked at.
    assert sink.passes[0].devices == frozenset()
    assert [e for e in sink.events if e.condition == "gpu-lost"] == []
    failed = [r for r in caplog.records if "health check failed" in r.getMessage()]
    assert len(failed) == 1 and failed[0].levelno == logging.WARNING


async def test_failing_check_call_is_reported_and_warned_once_per_episode(
    make_backend: BackendFactory, fake_clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    fake = LibNvml([h100(0), l4(3)])
    fake.fail(H100, "nvmlDeviceGetPcieReplayCounter", int(real.NVML_ERROR_UNKNOWN))
    sink = Sink()
    with caplog.at_level(logging.INFO, logger="agent.backends.nvidia.health"):
        async with monitoring(make_backend(fake, health_wait_ms="20"), sink):
            await sink.wait_passes(1)
            await passes(sink, fake_clock, 4)
            del fake.gpu(H100).failures["nvmlDeviceGetPcieReplayCounter"]
            await passes(sink, fake_clock, 1)
    assert [p.failed_checks for p in sink.passes] == [("pcie-replay-rate",)] * 5 + [()]
    assert [p.devices for p in sink.passes] == [{"gpu-3"}] * 5 + [{"gpu-0", "gpu-3"}]
    assert sink.events == []
    failed = [r for r in caplog.records if "health check failed" in r.getMessage()]
    assert len(failed) == 1 and failed[0].levelno == logging.WARNING
    assert any("works again" in r.getMessage() for r in caplog.records)


async def test_telemetry_ecc_values_are_the_pass_readings(
    make_backend: BackendFactory, fake_clock: FakeClock
) -> None:
    fake = node()
    fake.raise_ecc(H100, uncorrected=2, corrected=7)
    sink = Sink()
    backend = make_backend(fake, health_wait_ms="20")
    async with monitoring(backend, sink):
        await sink.wait_passes(1)
        per_pass = fake.count("nvmlDeviceGetTotalEccErrors")
        assert per_pass == 2 * 4  # corrected and uncorrected, once per GPU
        for _ in range(5):
            readings = {t.device: t for t in await backend.telemetry()}
        assert fake.count("nvmlDeviceGetTotalEccErrors") == per_pass  # telemetry reads none
        assert (readings["gpu-0"].ecc_corrected_total, readings["gpu-0"].ecc_uncorrected_total) == (7, 2)
        assert readings["gpu-1-mig-3g40gb-9-4"].ecc_uncorrected_total is None  # a GPU's, not per MIG device
        fake.raise_ecc(H100, uncorrected=1)
        await passes(sink, fake_clock, 1)
        assert fake.count("nvmlDeviceGetTotalEccErrors") == 2 * per_pass
        readings = {t.device: t for t in await backend.telemetry()}
        assert readings["gpu-0"].ecc_uncorrected_total == 3


@pytest.mark.parametrize("setting", ["ecc-correctable-rate", "pcie-replay-rate", "nvlink-error-rate"])
@pytest.mark.parametrize("value", ["-1", "ten", "inf", "nan"])
def test_bad_threshold_settings_are_refused(setting: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"nvidia setting {setting}") as caught:
        NvidiaBackend(BackendOptions("node-1", None, {setting: value}), nvml_module=LibNvml([]).module)
    assert "errors per minute >= 0" in str(caught.value)


def test_threshold_settings_and_defaults() -> None:
    assert TrendThresholds.from_settings({}) == TrendThresholds(10.0, 100.0, 10.0)
    assert TrendThresholds.from_settings(
        {"ecc-correctable-rate": "0", "pcie-replay-rate": "2.5", "nvlink-error-rate": "1e3"}
    ) == TrendThresholds(0.0, 2.5, 1000.0)


@pytest.mark.parametrize("setting", ["recovery-interval", "telemetry-interval", "health-wait-ms"])
@pytest.mark.parametrize("value", ["-1", "soon", "inf", "nan"])
def test_bad_interval_settings_are_refused(setting: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"nvidia setting {setting}.*finite number of seconds"):
        NvidiaBackend(BackendOptions("node", settings={setting: value}))
