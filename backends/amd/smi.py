"""A thin seam over the `amdsmi` package: lazy import, clear errors, and calls off the event loop.

`amdsmi` loads ROCm's ``libamd_smi.so`` when imported; without it amdsmi 7 raises
``KeyError('libamd_smi.so')`` (not ImportError). Every call into the library is blocking, so the
backend groups its calls into plain functions of the module and runs them in worker threads on
the lanes of `SmiLibrary` (`agent.core.vendorcall`): discovery and telemetry on one, the health
monitor's polls and its event reads on lanes of their own, shutdown on none. Each call is
bounded, so a wedged driver fails a call instead of the agent, and SIGTERM never waits for one.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from agent.core.errors import BackendError
from agent.core.logs import log_fields
from agent.core.vendorcall import DEFAULT_CALL_TIMEOUT, VendorLane, run_vendor_call

log = logging.getLogger("agent.backends.amd")

T = TypeVar("T")

# amdsmi_status_t values (amdsmi_wrapper.AMDSMI_STATUS_*); stable across ROCm 6 and 7.
STATUS_NOT_SUPPORTED = 2
STATUS_NOT_YET_IMPLEMENTED = 3
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

# Statuses that mean the GPU (or its driver) went away under us, not that a call is unsupported.
LOST_STATUSES = frozenset(
    {STATUS_DRM_ERROR, STATUS_IO, STATUS_FILE_ERROR, STATUS_NOT_FOUND, STATUS_DRIVER_NOT_LOADED}
)
# Statuses that mean this GPU (or this agent, without root) cannot answer a call at all: asking
# again will not help, so a health check that gets one is skipped from then on.
UNAVAILABLE_STATUSES = frozenset({STATUS_NOT_SUPPORTED, STATUS_NOT_YET_IMPLEMENTED, STATUS_NO_PERM})

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


def is_lost(error: BaseException) -> bool:
    """Whether an amdsmi exception says the GPU (or its driver) is gone."""
    return error_code(error) in LOST_STATUSES


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
    """The loaded `amdsmi` module with ways to run blocking work on it in worker threads."""

    def __init__(self, module: Any, call_timeout: float = DEFAULT_CALL_TIMEOUT) -> None:
        self.module = module
        self.call_timeout = call_timeout
        self._serial = VendorLane(call_timeout)
        self._health = VendorLane(call_timeout)
        self._events = VendorLane(call_timeout)

    async def run(self, work: Callable[[Any], T], what: str = "") -> T:
        """Run `work(module)` in a worker thread, one call at a time (discovery, telemetry)."""
        return await self._serial.run(_named(work, what), self.module)

    async def run_health(self, work: Callable[[Any], T], what: str = "") -> T:
        """Run the health monitor's `work(module)` (RAS polls, event readers) on its own lane."""
        return await self._health.run(_named(work, what), self.module)

    async def run_events(self, work: Callable[[Any], T], bound: float, what: str = "") -> T:
        """Run an event read on its own lane, within `bound` seconds."""
        return await self._events.run(_named(work, what), self.module, bound=bound)

    async def run_unlimited(self, work: Callable[[Any], T], bound: float, what: str = "") -> T:
        """Run `work(module)` in its own worker thread, on no lane (shutdown), within `bound` seconds."""
        named = _named(work, what)
        return await run_vendor_call(named.__name__, named, self.module, bound=bound)


def _named(work: Callable[[Any], T], what: str) -> Callable[[Any], T]:
    """`work`, named `what` for the vendor-call thread and errors (a lambda has no useful name)."""
    if not what:
        return work

    def call(module: Any) -> T:
        return work(module)

    call.__name__ = what
    return call


def handle_key(handle: Any) -> int:
    """A hashable identity of a processor handle (ctypes handles compare by object, not value)."""
    value = getattr(handle, "value", None)
    return value if isinstance(value, int) else id(handle)


def log_degraded(device: str, what: str, error: BaseException) -> None:
    """Log that one attribute or reading is unavailable on one device."""
    level = logging.DEBUG if error_code(error) == STATUS_NOT_SUPPORTED else logging.WARNING
    fields = log_fields(device=device, call=what, error=describe(error))
    log.log(level, "amdsmi call failed; leaving it out", extra=fields)
