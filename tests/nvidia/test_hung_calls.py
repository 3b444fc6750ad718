"""A wedged NVML call: bounded, and it holds up neither the health monitor nor the shutdown."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from agent.core.backend import BackendOptions
from agent.core.vendorcall import VendorCallTimeoutError
from backends.nvidia import NvidiaBackend
from tests.fakes.libnvml import XID_CRITICAL, LibNvml, h100
from tests.nvidia.conftest import Sink, until
from tests.support.clock import FakeClock

GPU0 = "GPU-h1000000-0000-0000-0000-000000000000"


@pytest.fixture
def fake() -> Iterator[LibNvml]:
    nvml = LibNvml([h100(0)])
    yield nvml
    nvml.release()  # no worker thread outlives the test


def backend_on(fake: LibNvml, tmp_path: Path, sysfs: Path, clock: FakeClock) -> NvidiaBackend:
    return NvidiaBackend(
        BackendOptions("node-1", None, {"health-wait-ms": "20"}),
        nvml_module=fake.module,
        clock=clock,
        sysfs_root=sysfs,
        proc_root=tmp_path / "proc",
        dev_root=tmp_path / "dev",
        call_timeout=0.2,
    )


async def test_hung_telemetry_fails_in_bound_and_the_monitor_and_stop_go_on(
    fake: LibNvml, tmp_path: Path, sysfs: Path, fake_clock: FakeClock
) -> None:
    backend = backend_on(fake, tmp_path, sysfs, fake_clock)
    await backend.start()
    await backend.discover()
    fake.hang("nvmlDeviceGetTemperatureV")
    sink = Sink()
    async with anyio.create_task_group() as tg:
        tg.start_soon(backend.monitor_health, sink)
        with pytest.raises(VendorCallTimeoutError, match=r"read_telemetry_sync did not return within 0\.2 s"):
            await backend.telemetry()
        # The next read does not start a second stuck thread: it waits for the lane, then says why.
        with pytest.raises(VendorCallTimeoutError, match="not started: read_telemetry_sync has not returned"):
            await backend.telemetry()
        await until(lambda: fake.event_sets and fake.event_sets[-1].waits > 0)
        fake.emit(GPU0, XID_CRITICAL, 79)  # the health monitor is not behind the telemetry lane
        await sink.wait_count(1)
        tg.cancel_scope.cancel()
    with anyio.fail_after(5):
        await backend.stop()
    assert fake.initialized == 0  # nvmlShutdown ran although the telemetry read still hangs
    assert fake.count("nvmlDeviceGetTemperatureV") == 1


async def test_hung_shutdown_is_left_behind(
    fake: LibNvml, tmp_path: Path, sysfs: Path, fake_clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    backend = backend_on(fake, tmp_path, sysfs, fake_clock)
    await backend.start()
    fake.hang("nvmlShutdown")
    with anyio.fail_after(5):
        await backend.stop()
    assert "nvmlShutdown did not return; exiting without it" in caplog.text


async def test_hung_event_wait_fails_the_monitor_in_bound(
    fake: LibNvml, tmp_path: Path, sysfs: Path, fake_clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """The supervisor restarts a failed monitor; the set under the stuck wait is not freed."""
    backend = backend_on(fake, tmp_path, sysfs, fake_clock)
    await backend.start()
    fake.hang("nvmlEventSetWait_v2")
    with anyio.fail_after(5), pytest.raises(VendorCallTimeoutError, match=r"nvmlEventSetWait_v2|_wait_sync"):
        await backend.monitor_health(Sink())
    assert "NVML event wait did not return; leaving its event set" in caplog.text
    assert not fake.event_sets[0].freed
    await backend.stop()


async def test_cancelled_wait_is_not_waited_for_but_its_set_is_freed_after_it(
    fake: LibNvml, tmp_path: Path, sysfs: Path, fake_clock: FakeClock
) -> None:
    backend = backend_on(fake, tmp_path, sysfs, fake_clock)
    await backend.start()
    async with anyio.create_task_group() as tg:
        tg.start_soon(backend.monitor_health, Sink())
        await until(lambda: fake.event_sets and fake.event_sets[-1].waits > 0)
        tg.cancel_scope.cancel()
    assert fake.event_sets[0].freed
    await backend.stop()
