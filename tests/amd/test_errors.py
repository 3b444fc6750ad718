"""Errors users meet: ROCm missing or too old, init failures, settings, calls before start."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agent.core.backend import BackendOptions, ClaimRef
from agent.core.errors import BackendError, ConfigError, DeviceNotFoundError
from backends.amd.backend import AmdBackend
from backends.amd.binding import check_module, import_amdsmi
from backends.amd.smi import describe, error_code
from tests.amd.conftest import MakeBackend
from tests.fakes.amd_standin import (
    STATUS_DRIVER_NOT_LOADED,
    STATUS_INIT_ERROR,
    STATUS_NO_PERM,
    STATUS_NOT_SUPPORTED,
    AmdSmiLibraryException,
    StandIn,
    environment,
    mi210,
)

CLAIM = ClaimRef("default", "claim", "uid-1")


def _raising(error: BaseException) -> Callable[[str], Any]:
    def import_module(name: str) -> Any:
        assert name == "amdsmi"
        raise error

    return import_module


def test_missing_rocm_library_keyerror_says_what_to_install() -> None:
    # amdsmi 7.0.2 raises KeyError('libamd_smi.so') at import when ROCm is absent.
    with pytest.raises(BackendError, match=r"libamd_smi\.so was not found.*install ROCm.*mount"):
        import_amdsmi(_raising(KeyError("libamd_smi.so")))


def test_missing_python_package() -> None:
    with pytest.raises(BackendError, match=r"amdsmi Python package cannot be imported.*dra-agent\[amd\]"):
        import_amdsmi(_raising(ModuleNotFoundError("No module named 'amdsmi'")))


def test_library_load_oserror() -> None:
    with pytest.raises(BackendError, match=r"could not be loaded.*libdrm"):
        import_amdsmi(_raising(OSError("libdrm.so.2: cannot open shared object file")))


def _devices(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    run_env = {k: v for k, v in os.environ.items() if k not in ("ROCM_PATH", "ROCM_HOME")} | env
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", "devices", "--backend", "amd", "-o", "yaml"],
        env=run_env,
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_devices_without_the_library_is_one_line_and_nothing_on_stdout(tmp_path: Path) -> None:
    """AMD's real binding with no libamd_smi.so: its two prints stay off stdout (issue 30 #3)."""
    result = _devices({"ROCM_PATH": str(tmp_path)})
    assert result.returncode == 1
    assert result.stdout == ""
    errors = [line for line in result.stderr.splitlines() if line.startswith("dra-agent: error:")]
    assert len(errors) == 1 and "libamd_smi.so was not found" in errors[0]
    assert "Traceback" not in result.stderr


def test_devices_with_a_library_older_than_the_binding_names_both() -> None:
    """A libamd_smi.so lacking a symbol the 7.0.2 wrapper binds (a ROCm 6.4 host): one line naming
    both versions, exit 2."""
    result = _devices(environment(mi210(1), "no-cper", lib_version="25.3.0"))
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("dra-agent: error:")]
    assert "amdsmi_get_gpu_cper_entries" in line and "share/amd_smi" in line
    assert "libamd_smi 25.3.0" in line and "amdsmi 7.0.2" in line
    assert "Traceback" not in result.stderr


def test_a_missing_symbol_with_an_unreadable_library_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ROCM_PATH", str(tmp_path))  # the library's version cannot be read there
    with pytest.raises(BackendError, match=r"libamd_smi of unknown version .* lacks a function .*x_fn"):
        import_amdsmi(_raising(AttributeError("/lib/libamd_smi.so: undefined symbol: x_fn")))


def test_devices_with_a_library_of_another_release_names_both_versions() -> None:
    env = environment(mi210(1), lib_version="25.3.0")
    result = _devices(env)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("dra-agent: error:")]
    assert "libamd_smi 25.3.0" in line and "binding 7.0.2" in line


def test_too_old_amdsmi() -> None:
    old = types.ModuleType("amdsmi")
    old.amdsmi_init = lambda: None  # type: ignore[attr-defined]
    with pytest.raises(BackendError, match=r"too old.*AmdSmiEventReader.*ROCm 6\.2"):
        check_module(old)


@pytest.mark.parametrize(
    ("code", "hint"),
    [
        (STATUS_DRIVER_NOT_LOADED, "modprobe amdgpu"),
        (STATUS_NO_PERM, "privileged"),
        (STATUS_INIT_ERROR, "ROCm version matches"),
        (STATUS_NOT_SUPPORTED, "amd-smi list"),
    ],
)
async def test_init_failures_say_what_to_do(make_backend: MakeBackend, code: int, hint: str) -> None:
    backend, fake = make_backend(mi210(1), init_status=code)
    with pytest.raises(BackendError, match=hint):
        await backend.start()
    assert fake.calls("amdsmi_init") == 1


async def test_start_twice_initializes_once_and_stop_is_safe(make_backend: MakeBackend) -> None:
    backend, fake = make_backend(mi210(1))
    await backend.stop()  # before start: nothing to do
    await backend.start()
    await backend.start()
    assert fake.calls("amdsmi_init") == 1
    await backend.stop()
    await backend.stop()
    assert fake.calls("amdsmi_shut_down") == 1


async def test_stop_never_raises(make_backend: MakeBackend) -> None:
    backend, fake = make_backend(mi210(1))
    await backend.start()
    fake.module.amdsmi_shut_down()  # the library is already down: the backend's call fails
    await backend.stop()
    assert fake.calls("amdsmi_shut_down") == 2


async def test_calls_before_start_fail_clearly(make_backend: MakeBackend) -> None:
    backend, _ = make_backend(mi210(1))
    with pytest.raises(BackendError, match="not started"):
        await backend.discover()
    with pytest.raises(BackendError, match="not started"):
        await backend.telemetry()


async def test_listing_failure_is_a_backend_error(make_backend: MakeBackend) -> None:
    backend, fake = make_backend(mi210(1))
    await backend.start()

    def broken() -> list[Any]:
        raise AmdSmiLibraryException(STATUS_DRIVER_NOT_LOADED)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fake.module, "amdsmi_get_processor_handles", broken)
        with pytest.raises(BackendError, match=r"listing GPUs failed.*amd-smi list"):
            await backend.discover()
    await backend.stop()


async def test_prepare_unknown_device(make_backend: MakeBackend) -> None:
    backend, _ = make_backend(mi210(1))
    await backend.start()
    await backend.discover()
    with pytest.raises(DeviceNotFoundError, match="gpu-9-9"):
        await backend.prepare("gpu-9-9", CLAIM)
    await backend.stop()


@pytest.mark.parametrize(
    "settings",
    [{"poll-interval": "0"}, {"poll-interval": "soon"}, {"cper-max-age": "-1"}, {"colour": "red"}],
)
def test_bad_settings(settings: dict[str, str]) -> None:
    with pytest.raises(ConfigError):
        AmdBackend(BackendOptions("node-1", None, settings))


def test_describe_and_error_code() -> None:
    error = AmdSmiLibraryException(STATUS_NOT_SUPPORTED)
    assert error_code(error) == STATUS_NOT_SUPPORTED
    assert describe(error) == "AMDSMI_STATUS_NOT_SUPPORTED (code 2)"
    assert error_code(ValueError("x")) is None
    assert describe(ValueError("x")) == "ValueError: x"


def test_the_real_binding_over_the_standin_has_what_the_backend_needs(standin: StandIn) -> None:
    standin.configure(mi210(1))
    smi = standin.module
    check_module(smi)
    members = smi.AmdSmiEvtNotificationType.__members__
    assert members["PAGE_FAULT_START"] is members["PAGE_FAULT_END"]
    assert smi.AmdSmiTemperatureType["JUNCTION"] is smi.AmdSmiTemperatureType["HOTSPOT"]
    with pytest.raises(AmdSmiLibraryException) as info:
        smi.amdsmi_get_processor_handles()  # before amdsmi_init
    assert "STATUS_NOT_INIT" in str(info.value)


def test_the_host_rocms_binding_is_preferred(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As AMD's amd-smi: the binding under the host's ROCm (share/amd_smi), else the image's."""
    host = tmp_path / "share" / "amd_smi"
    (host / "amdsmi").mkdir(parents=True)
    (host / "amdsmi" / "__init__.py").write_text("")
    monkeypatch.setenv("ROCM_PATH", str(tmp_path))
    seen: list[str] = []

    def import_module(name: str) -> Any:
        seen.append(sys.path[0])
        return types.ModuleType(name)

    import_amdsmi(import_module)
    assert seen == [str(host)] and str(host) not in sys.path
    monkeypatch.setenv("ROCM_PATH", str(tmp_path / "elsewhere"))
    import_amdsmi(import_module)
    assert seen[-1] != str(host)
