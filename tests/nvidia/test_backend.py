"""Backend lifecycle, errors users meet, settings, telemetry, and the `devices` command."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pynvml as real
import pytest

from agent.cli import main
from agent.core.backend import Backend, BackendOptions
from agent.core.errors import BackendError, ConfigError
from backends.nvidia import NvidiaBackend, create_backend
from backends.nvidia.nvml import Nvml, find_library_dir, load_pynvml
from tests.fakes.libnvml import MIB, LibNvml, a100_mig, h100, install, l4
from tests.nvidia.conftest import BackendFactory, Sink, monitoring
from tests.support.clock import FakeClock


def test_entry_point_creates_one_backend() -> None:
    backends = create_backend(BackendOptions("node-1"))
    assert len(backends) == 1
    assert isinstance(backends[0], NvidiaBackend) and isinstance(backends[0], Backend)
    assert backends[0].driver_name == "gpu.nvidia.com"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"cdi-mode": "magic"}, "expected auto, own, toolkit"),
        ({"host-root": "host"}, "host-root: expected an absolute path"),
        ({"cdi-hook-path": "nvidia-cdi-hook"}, "cdi-hook-path: expected an absolute path"),
        ({"colour": "blue"}, "one of driver, cdi-mode"),
        ({"driver-root": "run/nvidia"}, "absolute path"),
        ({"ignored-xids": "a,b"}, "XID numbers"),
        ({"telemetry-interval": "-1"}, "seconds >= 0"),
        ({"health-wait-ms": "soon"}, "health-wait-ms"),
    ],
)
def test_bad_settings(settings: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        NvidiaBackend(BackendOptions("node-1", settings=settings))


def test_bad_driver_name() -> None:
    with pytest.raises(ConfigError, match="driver"):
        NvidiaBackend(BackendOptions("node-1", driver_name="Not_A_Name"))


async def test_library_not_found_says_where_and_how(make_backend: BackendFactory) -> None:
    fake = LibNvml([], init_error=int(real.NVML_ERROR_LIBRARY_NOT_FOUND))
    backend = make_backend(fake, driver_root="/run/nvidia/driver")
    with pytest.raises(BackendError) as caught:
        await backend.start()
    message = str(caught.value)
    for needle in (
        "libnvidia-ml.so.1",
        "LD_LIBRARY_PATH",
        "/run/nvidia/driver",
        "nvidia.driverRoot",
        "driver-root",
    ):
        assert needle in message
    await backend.stop()  # stopping a backend that never started is fine


@pytest.mark.parametrize(
    ("code", "needle"),
    [
        (int(real.NVML_ERROR_DRIVER_NOT_LOADED), "kernel driver is not loaded"),
        (int(real.NVML_ERROR_NO_PERMISSION), "privileged"),
        (int(real.NVML_ERROR_LIB_RM_VERSION_MISMATCH), "different versions"),
        (int(real.NVML_ERROR_UNKNOWN), "nvmlInit failed: Unknown Error"),
    ],
)
async def test_init_errors(make_backend: BackendFactory, code: int, needle: str) -> None:
    backend = make_backend(LibNvml([], init_error=code))
    with pytest.raises(BackendError, match=needle):
        await backend.start()


def test_non_nvml_init_error() -> None:
    class Odd:
        def nvmlInit(self) -> None:
            raise RuntimeError("boom")

    with pytest.raises(BackendError, match="boom"):
        Nvml(Odd()).init_sync()


async def test_use_before_start(make_backend: BackendFactory, fake: LibNvml) -> None:
    backend = make_backend(fake)
    with pytest.raises(BackendError, match="start"):
        await backend.discover()


async def test_start_is_idempotent_and_stop_shuts_down(make_backend: BackendFactory, fake: LibNvml) -> None:
    backend = make_backend(fake)
    await backend.start()
    await backend.start()
    assert fake.initialized == 1
    await backend.stop()
    await backend.stop()
    assert fake.initialized == 0


async def test_shutdown_failure_is_only_logged(make_backend: BackendFactory, fake: LibNvml) -> None:
    backend = make_backend(fake)
    await backend.start()
    fake.missing.add("nvmlShutdown")
    await backend.stop()


async def test_listing_gpus_fails(make_backend: BackendFactory, fake: LibNvml) -> None:
    backend = make_backend(fake)
    await backend.start()
    fake.missing.add("nvmlDeviceGetCount")
    with pytest.raises(BackendError, match="cannot list GPUs"):
        await backend.discover()
    await backend.stop()


def test_pynvml_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(BackendError, match=r"dra-agent\[nvidia\]"):
        load_pynvml()


def test_find_library_dir(tmp_path: Path) -> None:
    assert find_library_dir(tmp_path) is None
    (tmp_path / "usr" / "lib64").mkdir(parents=True)
    (tmp_path / "usr" / "lib64" / "libnvidia-ml.so.1").touch()
    assert find_library_dir(tmp_path) == tmp_path / "usr" / "lib64"


async def test_bad_library_in_driver_root_is_only_logged(
    make_backend: BackendFactory, tmp_path: Path
) -> None:
    # Not a real shared object: the preload fails, is logged, and nvmlInit goes on.
    (tmp_path / "drv" / "usr" / "lib64").mkdir(parents=True)
    (tmp_path / "drv" / "usr" / "lib64" / "libnvidia-ml.so.1").write_text("not an ELF file")
    backend = make_backend(LibNvml([h100(0)]), driver_root=str(tmp_path / "drv"))
    await backend.start()
    assert [d.name for d in await backend.discover()] == ["gpu-0"]
    await backend.stop()


async def test_telemetry_values(make_backend: BackendFactory) -> None:
    gpu = h100(0)
    gpu.utilization, gpu.memory_used, gpu.temperature, gpu.power_mw = 55, 10 * 1024 * MIB, 61, 312_500
    gpu.ecc_corrected, gpu.ecc_uncorrected = 7, 1
    mig_gpu = a100_mig(1)
    mig_gpu.migs[0].memory_used = 2048 * MIB
    backend = make_backend(LibNvml([gpu, mig_gpu]))
    sink = Sink()
    async with monitoring(backend, sink):
        # The ECC totals are the health pass's readings (issue 23): none before the first pass.
        await sink.wait_passes(1)
        readings = {t.device: t for t in await backend.telemetry()}
    full = readings["gpu-0"]
    assert full.utilization_ratio == pytest.approx(0.55)
    assert (full.memory_used_bytes, full.memory_total_bytes) == (10 * 1024 * MIB, 81559 * MIB)
    assert (full.temperature_celsius, full.power_watts) == (61.0, 312.5)
    assert (full.ecc_corrected_total, full.ecc_uncorrected_total, full.last_error_code) == (7, 1, 0)
    mig = readings["gpu-1-mig-3g40gb-9-4"]
    # A MIG device has its own memory; utilization and ECC are per GPU, not reported per MIG device.
    assert (mig.memory_used_bytes, mig.memory_total_bytes) == (2048 * MIB, 40192 * MIB)
    assert mig.utilization_ratio is None and mig.ecc_corrected_total is None
    assert mig.temperature_celsius == 35.0


async def test_telemetry_degrades_per_field(make_backend: BackendFactory) -> None:
    gpu, other = h100(0), l4(1)
    fake = LibNvml([gpu, other])
    fake.fail(gpu.uuid, "nvmlDeviceGetPowerUsage", int(real.NVML_ERROR_NOT_SUPPORTED))
    fake.fail(gpu.uuid, "nvmlDeviceGetTotalEccErrors", int(real.NVML_ERROR_UNKNOWN))
    backend = make_backend(fake)
    await backend.start()
    await backend.discover()
    other.lost = True  # falls off the bus after discovery
    readings = {t.device: t for t in await backend.telemetry()}
    await backend.stop()
    assert readings["gpu-0"].power_watts is None and readings["gpu-0"].ecc_corrected_total is None
    assert readings["gpu-0"].temperature_celsius == 35.0
    lost = readings["gpu-1"]
    assert (lost.memory_total_bytes, lost.temperature_celsius, lost.utilization_ratio) == (None, None, None)


async def test_telemetry_interval_caches_reads(make_backend: BackendFactory, fake_clock: FakeClock) -> None:
    fake = LibNvml([h100(0)])
    backend = make_backend(fake, telemetry_interval="10")
    await backend.start()
    first = await backend.telemetry()
    reads = fake.count("nvmlDeviceGetTemperatureV")
    assert await backend.telemetry() == first
    assert fake.count("nvmlDeviceGetTemperatureV") == reads
    fake_clock.advance(10)
    await backend.telemetry()
    assert fake.count("nvmlDeviceGetTemperatureV") == reads + 1
    await backend.stop()


def test_devices_command_lists_what_nvml_sees(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    install(monkeypatch, LibNvml([a100_mig(0), h100(1)]))
    assert main(["devices", "--backend", "nvidia", "-o", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == [
        "gpu-0-mig-3g40gb-9-4",
        "gpu-0-mig-2g20gb-14-0",
        "gpu-0-mig-1g10gb-19-2",
        "gpu-0-mig-1g10gb-19-3",
        "gpu-1",
    ]
    assert rows[-1]["attributes"]["productName"] == {"string": "NVIDIA H100 80GB HBM3"}
    assert rows[-1]["capacity"]["memory"] == "81559Mi"
    assert main(["devices", "--backend", "nvidia:cdi-mode=toolkit,ignored-xids=79+94"]) == 0
    assert "gpu-1" in capsys.readouterr().out


def test_devices_command_without_driver(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    install(monkeypatch, LibNvml([], init_error=int(real.NVML_ERROR_LIBRARY_NOT_FOUND)))
    assert main(["devices", "--backend", "nvidia"]) == 1
    assert "libnvidia-ml.so.1" in capsys.readouterr().err


async def test_temperature_through_the_versioned_call_where_the_driver_has_it(
    make_backend: BackendFactory,
) -> None:
    """nvml.h:5979 deprecates nvmlDeviceGetTemperature in 13.0 for nvmlDeviceGetTemperatureV; a
    driver without the V symbol is still read through the older call."""
    for missing, used in (
        ((), "nvmlDeviceGetTemperatureV"),
        (("nvmlDeviceGetTemperatureV",), "nvmlDeviceGetTemperature"),
    ):
        fake = LibNvml([h100(0)], missing=missing)
        backend = make_backend(fake)
        await backend.start()
        [reading] = await backend.telemetry()
        await backend.stop()
        assert reading.temperature_celsius == 35.0
        assert fake.count(used) == 1
        assert fake.count("nvmlDeviceGetTemperature") == (1 if missing else 0)
