"""Issue 23: what NVIDIA's own mock NVML showed, reproduced on the fake taught its behaviours.

See ../shared/reference/nvml-mock-vs-fake.md. Each of these failed before the health pass:
(1) a GPU lost with no XID (getters GPU_IS_LOST, event waits time out) was never marked and
vanished from rediscovery; (2) on a GPU with XID-only events a rising uncorrectable ECC counter
raised nothing; (3) with dynamic MIG, a GPU in MIG mode whose GPU-instance calls answer
NOT_SUPPORTED was left out of discovery.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pynvml as real
import pytest

from agent.core.backend import ConditionKind
from agent.core.model import Severity
from tests.fakes.libnvml import (
    XID_CRITICAL,
    LibNvml,
    MigLibNvml,
    a100_mig,
    as_mock,
    dynamic_gpu,
    h100,
    l4,
)
from tests.nvidia.conftest import BackendFactory, Sink, monitoring, until
from tests.support.clock import FakeClock

GPU0 = "GPU-h1000000-0000-0000-0000-000000000000"
A100 = "GPU-a1000001-0000-0000-0000-000000000000"
L4 = "GPU-0l400003-0000-0000-0000-000000000000"
A100_DEVICES = {
    "gpu-1-mig-1g10gb-19-2",
    "gpu-1-mig-1g10gb-19-3",
    "gpu-1-mig-2g20gb-14-0",
    "gpu-1-mig-3g40gb-9-4",
}


def mock_node() -> LibNvml:
    """An H100 and an L4 answering as the mock does, and an A100 with MIG devices whose events are
    XID-only too (the mock returns no MIG device handles: its A100 would publish nothing)."""
    a100 = a100_mig(1)
    a100.supported_events, a100.recovery_action = XID_CRITICAL, None
    return LibNvml([as_mock(h100(0)), a100, as_mock(l4(3))])


async def registered(fake: LibNvml) -> None:
    await until(lambda: fake.event_sets and fake.event_sets[-1].waits > 0)


def lost_devices(sink: Sink) -> set[str]:
    return {e.device for e in sink.events if e.condition == "gpu-lost" and not e.cleared}


async def test_gpu_lost_without_event_is_marked_within_two_intervals_and_stays_published(
    make_backend: BackendFactory, fake_clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    fake = mock_node()
    sink = Sink()
    backend = make_backend(fake, health_wait_ms="20")
    async with monitoring(backend, sink):
        await registered(fake)
        await sink.wait_passes(1)
        assert sink.events == []
        fake.lose(GPU0, event=False)
        fake.lose(A100, event=False)
        waits = fake.event_sets[-1].waits
        await until(lambda: fake.event_sets[-1].waits > waits + 2)  # waits just time out
        assert sink.events == []
        fake_clock.advance(5)  # one health interval
        await sink.wait_passes(2)
        assert lost_devices(sink) == {"gpu-0", *A100_DEVICES}
        gpu_lost = next(e for e in sink.events if e.device == "gpu-0")
        assert (gpu_lost.severity, gpu_lost.kind) == (Severity.CRITICAL, ConditionKind.STATE)
        # Rediscovery keeps the lost GPUs' devices published (tainted gpu-lost), not dropped.
        names = {d.name for d in await backend.discover()}
        assert names == {"gpu-0", "gpu-3", *A100_DEVICES}
        with caplog.at_level(logging.INFO, logger="agent.backends.nvidia"):
            for _ in range(3):
                readings = {t.device: t for t in await backend.telemetry()}
                assert readings["gpu-0"].temperature_celsius is None
                assert readings["gpu-3"].temperature_celsius == 35.0
        warnings = [r for r in caplog.records if "does not answer telemetry" in r.getMessage()]
        assert len(warnings) == 2 and all(r.levelno == logging.WARNING for r in warnings)  # one per GPU
        # The GPUs come back (a reset): the monitor asks them every recovery-interval.
        fake.gpu(GPU0).lost = fake.gpu(A100).lost = False
        fake_clock.advance(5)
        await sink.wait_for(lambda events: any(e.cleared and e.device == "gpu-0" for e in events))
    assert {e.device for e in sink.events if e.condition == "gpu-lost" and e.cleared} >= {"gpu-0"}


async def test_gpu_lost_found_by_telemetry_is_asked_at_once(make_backend: BackendFactory) -> None:
    fake = mock_node()
    sink = Sink()
    backend = make_backend(fake, health_wait_ms="20")
    async with monitoring(backend, sink):
        await sink.wait_passes(1)
        fake.lose(GPU0, event=False)
        await backend.telemetry()  # meets GPU_IS_LOST: the GPU is suspect
        # No clock advance: the pass runs because of the suspect, not the interval.
        await sink.wait_for(lambda events: "gpu-0" in lost_devices(sink))
    assert lost_devices(sink) == {"gpu-0"}


async def test_gpu_lost_found_by_rediscovery_is_asked_at_once(make_backend: BackendFactory) -> None:
    fake = mock_node()
    sink = Sink()
    backend = make_backend(fake, health_wait_ms="20")
    async with monitoring(backend, sink):
        await sink.wait_passes(1)
        fake.lose(GPU0, event=False)
        assert "gpu-0" in {d.name for d in await backend.discover()}
        await sink.wait_for(lambda events: "gpu-0" in lost_devices(sink))


async def test_fallen_off_bus_xid_whose_device_cannot_be_read(make_backend: BackendFactory) -> None:
    fake = mock_node()
    sink = Sink()
    async with monitoring(make_backend(fake, health_wait_ms="20"), sink):
        await registered(fake)
        fake.fall_off_bus(GPU0)
        await sink.wait_for(lambda events: "gpu-0" in lost_devices(sink))
    assert lost_devices(sink) == {"gpu-0"}


async def test_xid_only_gpu_uncorrectable_ecc_counter_rise_is_a_fault(
    make_backend: BackendFactory, fake_clock: FakeClock
) -> None:
    fake = mock_node()
    fake.gpu(GPU0).ecc_uncorrected = 3  # from before the agent started: the baseline, silent
    sink = Sink()
    async with monitoring(make_backend(fake, health_wait_ms="20"), sink):
        await registered(fake)
        assert fake.event_sets[0].registered == {GPU0: XID_CRITICAL, A100: XID_CRITICAL, L4: XID_CRITICAL}
        await sink.wait_passes(1)
        fake.raise_ecc(GPU0, uncorrected=2)
        fake.raise_ecc(A100, uncorrected=1)
        fake_clock.advance(5)
        await sink.wait_passes(2)
    ecc = [e for e in sink.events if e.condition == "ecc-uncorrectable"]
    assert {e.device for e in ecc} == {"gpu-0", *A100_DEVICES}  # a GPU's fault is its MIG devices'
    assert {(e.severity, e.kind) for e in ecc} == {(Severity.CRITICAL, ConditionKind.EVENT)}
    assert "3 -> 5" in next(e for e in ecc if e.device == "gpu-0").message


async def test_dynamic_mig_gpu_instance_calls_not_supported_publish_the_gpu_whole(
    make_backend: BackendFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    a100 = "NVIDIA A100-SXM4-80GB"
    gpus = [as_mock(dynamic_gpu(a100, 0)), as_mock(dynamic_gpu("NVIDIA H100 80GB HBM3", 1))]
    nvml = MigLibNvml(gpus)
    backend = make_backend(nvml, cdi_mode="own", dynamic_mig="true", dynamic_mig_dir=str(tmp_path / "state"))
    await backend.start()
    with caplog.at_level(logging.INFO, logger="agent.backends.nvidia"):
        for _ in range(3):
            assert [d.name for d in await backend.discover()] == ["gpu-0", "gpu-1"]
    warnings = [r for r in caplog.records if "GPU-instance calls fail" in r.getMessage()]
    assert len(warnings) == 2 and all(r.levelno == logging.WARNING for r in warnings)  # once per GPU
    assert "Not Supported" in str(getattr(warnings[0], "fields", {}).get("error"))
    # MIG enabled again between two calls: the GPU turns partitionable.
    for gpu in gpus:
        gpu.gi_api = True
    names = [d.name for d in await backend.discover()]
    assert "gpu-0-mig-3g40gb-9-4" in names and "gpu-1" in names
    # A transient NOT_SUPPORTED: whole for that discovery, partitionable at the next.
    nvml.fail_once("nvmlDeviceGetGpuInstanceById", int(real.NVML_ERROR_NOT_SUPPORTED))
    assert "gpu-0-mig-3g40gb-9-4" not in [d.name for d in await backend.discover()]
    assert "gpu-0-mig-3g40gb-9-4" in [d.name for d in await backend.discover()]
    await backend.stop()
