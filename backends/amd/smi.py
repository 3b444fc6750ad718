"""A thin seam over the `amdsmi` package: lazy import, clear errors, and calls off the event loop.

`amdsmi` loads ROCm's ``libamd_smi.so`` when imported; without it amdsmi 7 raises
``KeyError('libamd_smi.so')`` (not ImportError). Every call into the library is blocking, so the
backend groups its calls into plain functions of the module and runs them with `SmiLibrary.run`
through `anyio.to_thread.run_sync`.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from agent.core.errors import BackendError
from agent.core.logs import log_fields

log = logging.getLogger("agent.backends.amd")

T = TypeVar("T")

# amdsmi_status_t values (amdsmi_wrapper.AMDSMI_STATUS_*); stable across ROCm 6 and 7.
STATUS_NOT_SUPPORTED = 2
STATUS_FAIL_LOAD_MODULE = 4
STATUS_DRM_ERROR = 6
STATUS_TIMEOUT = 8
STATUS_RETRY = 9
STATUS_NO_PERM = 10
STATUS_IO = 12
STATUS_FILE_ERROR = 14
STATUS_INIT_ERROR = 18
STATUS_NOT_FOUND = 31
STATUS_NOT_INIT = 32
STATUS_DRIVER_NOT_LOADED = 34
STATUS_NO_DATA = 40

# Statuses that mean the GPU (or its driver) went away under us, not that a call is unsupported.
LOST_STATUSES = frozenset(
    {STATUS_DRM_ERROR, STATUS_IO, STATUS_FILE_ERROR, STATUS_NOT_FOUND, STATUS_DRIVER_NOT_LOADED}
)

# What the backend cannot work without; an amdsmi without these is too old (ROCm < 6.2).
REQUIRED_NAMES = (
    "amdsmi_init",
    "amdsmi_shut_down",
    "amdsmi_get_processor_handles",
    "amdsmi_get_gpu_device_bdf",
    "amdsmi_get_gpu_asic_info",
    "amdsmi_get_gpu_kfd_info",
    "AmdSmiEventReader",
    "AmdSmiEvtNotificationType",
    "AmdSmiGpuBlock",
    "AmdSmiInitFlags",
    "AmdSmiException",
    "AmdSmiLibraryException",
)

INSTALL_HINT = (
    "install ROCm 6.2 or newer on the node (it provides libamd_smi.so and the amdsmi Python package, "
    "'pip install dra-agent[amd]'), or mount the host's /opt/rocm into the agent's container and set "
    "LD_LIBRARY_PATH=/opt/rocm/lib"
)


def import_amdsmi(import_module: Callable[[str], Any] = importlib.import_module) -> Any:
    """Import the `amdsmi` module, or raise `BackendError` saying what to install or mount."""
    try:
        return import_module("amdsmi")
    except KeyError as error:
        # amdsmi 7 looks the shared library up in a dict of found libraries at import time.
        missing = error.args[0] if error.args else "libamd_smi.so"
        raise BackendError(f"amd backend: ROCm library {missing} was not found: {INSTALL_HINT}") from error
    except ImportError as error:
        raise BackendError(
            f"amd backend: the amdsmi Python package cannot be imported ({error}): {INSTALL_HINT}"
        ) from error
    except OSError as error:
        raise BackendError(
            f"amd backend: libamd_smi.so could not be loaded ({error}): {INSTALL_HINT}"
        ) from error


def check_module(module: Any) -> None:
    """Raise `BackendError` when `module` lacks a function the backend needs (amdsmi too old)."""
    missing = [name for name in REQUIRED_NAMES if not hasattr(module, name)]
    if missing:
        raise BackendError(
            f"amd backend: the installed amdsmi is too old (it lacks {', '.join(missing)}): {INSTALL_HINT}"
        )


def error_code(error: BaseException) -> int | None:
    """The amdsmi status code of a library exception, or None for other exceptions."""
    getter = getattr(error, "get_error_code", None)
    if getter is None:
        return None
    try:
        code = getter()
    except Exception:
        return None
    return code if isinstance(code, int) else None


def describe(error: BaseException) -> str:
    """A one-line description of an amdsmi exception for logs and messages."""
    info = getattr(error, "get_error_info", None)
    if callable(info):
        try:
            return f"{info(False)} (code {error_code(error)})"
        except Exception:
            pass
    return f"{type(error).__name__}: {error}"


def init_error(error: BaseException) -> BackendError:
    """Turn a failure of ``amdsmi_init`` into a `BackendError` that says what to do."""
    code = error_code(error)
    if code == STATUS_DRIVER_NOT_LOADED:
        fix = "the amdgpu kernel driver is not loaded: install amdgpu-dkms or run 'modprobe amdgpu'"
    elif code == STATUS_NO_PERM:
        fix = (
            "permission denied: run the agent privileged or give it access to /dev/kfd, /dev/dri "
            "and /sys/class/kfd"
        )
    elif code in (STATUS_INIT_ERROR, STATUS_FAIL_LOAD_MODULE, STATUS_NOT_INIT):
        fix = (
            "the ROCm SMI library failed to initialize; check that the ROCm version matches the "
            f"kernel driver ({INSTALL_HINT})"
        )
    else:
        fix = "check the node's amdgpu driver and ROCm installation ('amd-smi list' should list the GPUs)"
    return BackendError(f"amd backend: amdsmi_init failed: {describe(error)}: {fix}")


class SmiLibrary:
    """The loaded `amdsmi` module with a way to run blocking work on it in a worker thread."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self._limiter: anyio.CapacityLimiter | None = None

    async def run(self, work: Callable[[Any], T]) -> T:
        """Run `work(module)` in a worker thread, one call at a time (the library serializes anyway)."""
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(1)
        return await anyio.to_thread.run_sync(work, self.module, limiter=self._limiter)

    async def run_unlimited(self, work: Callable[[Any], T]) -> T:
        """Run `work(module)` in its own worker thread (for waits such as reading events)."""
        return await anyio.to_thread.run_sync(work, self.module)


def handle_key(handle: Any) -> int:
    """A hashable identity of a processor handle (ctypes handles compare by object, not value)."""
    value = getattr(handle, "value", None)
    return value if isinstance(value, int) else id(handle)


def log_degraded(device: str, what: str, error: BaseException) -> None:
    """Log that one attribute or reading is unavailable on one device."""
    level = logging.DEBUG if error_code(error) == STATUS_NOT_SUPPORTED else logging.WARNING
    fields = log_fields(device=device, call=what, error=describe(error))
    log.log(level, "amdsmi call failed; leaving it out", extra=fields)
