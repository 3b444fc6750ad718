"""Errors users meet: ROCm missing or too old, init failures, settings, calls before start."""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from collections.abc import Callable
from typing import Any

import pytest

from agent.core.backend import BackendOptions, ClaimRef
from agent.core.errors import BackendError, ConfigError, DeviceNotFoundError
from backends.amd import create_backend
from backends.amd.backend import AmdBackend
from backends.amd.smi import check_module, describe, error_code, import_amdsmi
from tests.amd.conftest import MakeBackend
from tests.fakes.fake_amdsmi import (
    AMDSMI_STATUS_DRIVER_NOT_LOADED,
    AMDSMI_STATUS_INIT_ERROR,
    AMDSMI_STATUS_NO_PERM,
    AMDSMI_STATUS_NOT_SUPPORTED,
    AmdSmiLibraryException,
    FakeAmdSmi,
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


@pytest.mark.skipif(
    importlib.util.find_spec("amdsmi") is None or os.path.exists("/opt/rocm/lib/libamd_smi.so"),
    reason="needs the real amdsmi package on a machine without ROCm",
)
async def test_real_amdsmi_without_rocm_gives_backend_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # The real package, really failing: the entry point's backend must turn it into advice.
    monkeypatch.delitem(sys.modules, "amdsmi", raising=False)
    backend = create_backend(BackendOptions("node-1"))[0]
    with pytest.raises(BackendError, match="ROCm"):
        await backend.start()


def test_too_old_amdsmi() -> None:
    old = types.ModuleType("amdsmi")
    old.amdsmi_init = lambda: None  # type: ignore[attr-defined]
    with pytest.raises(BackendError, match=r"too old.*AmdSmiEventReader.*ROCm 6\.2"):
        check_module(old)


@pytest.mark.parametrize(
    ("code", "hint"),
    [
        (AMDSMI_STATUS_DRIVER_NOT_LOADED, "modprobe amdgpu"),
        (AMDSMI_STATUS_NO_PERM, "privileged"),
        (AMDSMI_STATUS_INIT_ERROR, "ROCm version matches"),
        (AMDSMI_STATUS_NOT_SUPPORTED, "amd-smi list"),
    ],
)
async def test_init_failures_say_what_to_do(make_backend: MakeBackend, code: int, hint: str) -> None:
    backend, fake = make_backend(mi210(1), init_error=code)
    with pytest.raises(BackendError, match=hint):
        await backend.start()
    assert fake.init_calls == 1


async def test_start_twice_initializes_once_and_stop_is_safe(make_backend: MakeBackend) -> None:
    backend, fake = make_backend(mi210(1))
    await backend.stop()  # before start: nothing to do
    await backend.start()
    await backend.start()
    assert fake.init_calls == 1
    await backend.stop()
    await backend.stop()
    assert fake.shutdown_calls == 1


async def test_stop_never_raises(make_backend: MakeBackend) -> None:
    backend, fake = make_backend(mi210(1))
    await backend.start()

    def broken() -> None:
        raise AmdSmiLibraryException(AMDSMI_STATUS_INIT_ERROR)

    fake.amdsmi_shut_down = broken  # type: ignore[method-assign]
    await backend.stop()


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
        raise AmdSmiLibraryException(AMDSMI_STATUS_DRIVER_NOT_LOADED)

    fake.amdsmi_get_processor_handles = broken  # type: ignore[method-assign]
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
    error = AmdSmiLibraryException(AMDSMI_STATUS_NOT_SUPPORTED)
    assert error_code(error) == AMDSMI_STATUS_NOT_SUPPORTED
    assert describe(error) == "AMDSMI_STATUS_NOT_SUPPORTED (code 2)"
    assert error_code(ValueError("x")) is None
    assert describe(ValueError("x")) == "ValueError: x"


def test_fake_is_a_module_with_real_names() -> None:
    fake = FakeAmdSmi(mi210(1))
    check_module(fake)
    members = fake.AmdSmiEvtNotificationType.__members__
    assert members["PAGE_FAULT_START"] is members["PAGE_FAULT_END"]
    assert fake.AmdSmiTemperatureType["JUNCTION"] is fake.AmdSmiTemperatureType["HOTSPOT"]
    with pytest.raises(AmdSmiLibraryException) as info:
        fake.amdsmi_get_processor_handles()  # before amdsmi_init
    assert "AMDSMI_STATUS_NOT_INIT" in str(info.value)
