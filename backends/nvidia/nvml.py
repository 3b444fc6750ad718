"""A thin layer over `pynvml` (nvidia-ml-py): loading, init/shutdown, worker threads, error mapping.

The `pynvml` module is a dependency passed in (tests give pynvml over a stand-in libnvidia-ml);
every blocking NVML call runs in a worker thread, never on the event loop: `Nvml.run` (discovery
and telemetry, one at a time), `Nvml.run_health` (the health monitor's own lane) or
`Nvml.run_unlimited` (shutdown). Each is bounded (`agent.core.vendorcall`), so a wedged driver
fails the call instead of the agent, and SIGTERM never waits for one.
"""

from __future__ import annotations

import ctypes
import importlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

from agent.core.errors import BackendError
from agent.core.logs import log_fields
from agent.core.vendorcall import (
    DEFAULT_CALL_TIMEOUT,
    STOP_TIMEOUT,
    VendorCallTimeoutError,
    VendorLane,
    run_vendor_call,
)

log = logging.getLogger("agent.backends.nvidia")

T = TypeVar("T")

NVML_SONAME = "libnvidia-ml.so.1"
# Where driver libraries live below a driver root, most specific first.
LIBRARY_DIRS = (
    "usr/lib/x86_64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
    "usr/lib64",
    "usr/lib",
    "lib64",
    "lib",
)


def load_pynvml() -> ModuleType:
    """Import `pynvml` (from nvidia-ml-py); `sys.modules['pynvml']` wins, so tests can inject their copy."""
    try:
        return importlib.import_module("pynvml")
    except ImportError as error:
        raise BackendError(
            "NVIDIA backend: the Python module 'pynvml' is not installed: "
            "install the agent with 'pip install dra-agent[nvidia]' (package nvidia-ml-py)"
        ) from error


def find_library_dir(driver_root: Path) -> Path | None:
    """The directory below `driver_root` that holds libnvidia-ml.so.1, if any."""
    for sub in LIBRARY_DIRS:
        candidate = driver_root / sub
        if (candidate / NVML_SONAME).exists():
            return candidate
    return None


class Nvml:
    """The `pynvml` module plus the knowledge of how its errors map to our decisions."""

    def __init__(
        self,
        module: ModuleType | Any,
        driver_root: Path = Path("/"),
        call_timeout: float = DEFAULT_CALL_TIMEOUT,
    ) -> None:
        self.lib: Any = module
        self.driver_root = driver_root
        self.call_timeout = call_timeout
        self._initialized = False
        # Discovery and telemetry (cheap calls) run one at a time; the health monitor has a lane
        # of its own and shutdown none, so a wedged telemetry read holds up neither.
        self._serial = VendorLane(call_timeout)
        self._health = VendorLane(call_timeout)

    # -- error classification -------------------------------------------------------------

    def error_class(self, name: str) -> type[BaseException]:
        cls = getattr(self.lib, name, None)
        return cls if isinstance(cls, type) and issubclass(cls, BaseException) else _Never

    def is_error(self, error: BaseException) -> bool:
        """An `NVMLError` of any code."""
        return isinstance(error, self.error_class("NVMLError"))

    def is_unsupported(self, error: BaseException) -> bool:
        """The GPU or the driver cannot do this call: degrade, do not fail."""
        return isinstance(
            error,
            (self.error_class("NVMLError_NotSupported"), self.error_class("NVMLError_FunctionNotFound")),
        )

    def is_gpu_lost(self, error: BaseException) -> bool:
        """The GPU fell off the bus or needs a reset.

        Not GPU_NOT_FOUND: nvml.h:1333 "No GPUs were found" is about the system, not one GPU.
        """
        return isinstance(
            error, (self.error_class("NVMLError_GpuIsLost"), self.error_class("NVMLError_ResetRequired"))
        )

    def is_timeout(self, error: BaseException) -> bool:
        return isinstance(error, self.error_class("NVMLError_Timeout"))

    def is_not_found(self, error: BaseException) -> bool:
        return isinstance(error, self.error_class("NVMLError_NotFound"))

    # -- lifecycle --------------------------------------------------------------------------

    def init_sync(self) -> None:
        """`nvmlInit`, turning the errors users meet into `BackendError`s that say what to do."""
        self._preload_from_driver_root()
        try:
            self.lib.nvmlInit()
        except Exception as error:
            raise self._init_error(error) from error
        self._initialized = True

    def shutdown_sync(self) -> None:
        """`nvmlShutdown`; never raises."""
        if not self._initialized:
            return
        self._initialized = False
        try:
            self.lib.nvmlShutdown()
        except Exception as error:
            log.warning("nvmlShutdown failed", extra=log_fields(error=str(error)))

    def _preload_from_driver_root(self) -> None:
        # pynvml opens libnvidia-ml.so.1 by soname through the dynamic loader. When the driver
        # lives under a driver root (GPU Operator: /run/nvidia/driver), loading it by path first
        # makes that soname resolve to it.
        if str(self.driver_root) in ("", "/"):
            return
        libdir = find_library_dir(self.driver_root)
        if libdir is None:
            return
        try:
            ctypes.CDLL(str(libdir / NVML_SONAME), mode=ctypes.RTLD_GLOBAL)
        except OSError as error:
            log.warning(
                "cannot preload NVML from the driver root",
                extra=log_fields(path=str(libdir / NVML_SONAME), error=str(error)),
            )

    def _init_error(self, error: BaseException) -> BaseException:
        if isinstance(error, self.error_class("NVMLError_LibraryNotFound")):
            return BackendError(
                f"NVIDIA backend: cannot load the NVML library {NVML_SONAME}: looked through the dynamic "
                f"loader (LD_LIBRARY_PATH={os.environ.get('LD_LIBRARY_PATH', '')!r}, /etc/ld.so.cache, "
                f"/usr/lib) and in the driver root {str(self.driver_root)!r} "
                f"({', '.join(LIBRARY_DIRS)}). Fix: mount the NVIDIA driver root into the agent and "
                "point it there (Helm value nvidia.driverRoot: '/' for a driver installed on the host, "
                "'/run/nvidia/driver' for the GPU Operator; backend setting driver-root=...), or set "
                "LD_LIBRARY_PATH to the directory that holds libnvidia-ml.so.1"
            )
        if isinstance(error, self.error_class("NVMLError_DriverNotLoaded")):
            return BackendError(
                "NVIDIA backend: the NVIDIA kernel driver is not loaded on this node: install the "
                "driver (or let the GPU Operator's driver pod finish) and check 'nvidia-smi' on the host"
            )
        if isinstance(error, self.error_class("NVMLError_NoPermission")):
            return BackendError(
                "NVIDIA backend: no permission to open the NVIDIA devices: run the agent privileged "
                "or give it access to /dev/nvidiactl and /dev/nvidia*"
            )
        if isinstance(error, self.error_class("NVMLError_LibRmVersionMismatch")):
            return BackendError(
                "NVIDIA backend: the NVML library and the loaded kernel driver have different "
                "versions: mount the driver root of the running driver, or reboot after a driver upgrade"
            )
        if self.is_error(error):
            return BackendError(
                f"NVIDIA backend: nvmlInit failed: {error}: check the driver with 'nvidia-smi'"
            )
        return BackendError(f"NVIDIA backend: nvmlInit failed: {error!r}")

    # -- threads ----------------------------------------------------------------------------

    async def run(self, func: Callable[..., T], *args: Any) -> T:
        """Run the blocking `func(*args)` in a worker thread (one at a time), bounded in time."""
        return await self._serial.run(func, *args)

    async def run_health(self, func: Callable[..., T], *args: Any, bound: float | None = None) -> T:
        """Run the health monitor's `func(*args)` in a worker thread, on its own lane."""
        return await self._health.run(func, *args, bound=bound)

    async def run_unlimited(self, func: Callable[..., T], *args: Any, bound: float) -> T:
        """Run `func(*args)` in a worker thread of its own (on no lane), within `bound` seconds."""
        return await run_vendor_call(func.__name__, func, *args, bound=bound)

    async def shutdown(self) -> None:
        """`nvmlShutdown`, bounded (`STOP_TIMEOUT`) and on no lane a hung call may hold; never raises."""
        try:
            await self.run_unlimited(self.shutdown_sync, bound=STOP_TIMEOUT)
        except VendorCallTimeoutError as error:
            log.warning("nvmlShutdown did not return; exiting without it", extra=log_fields(error=str(error)))

    def optional(self, what: str, func: Callable[..., T], *args: Any) -> T | None:
        """Call `func(*args)` in this thread; None where the GPU or driver does not support it.

        A lost GPU still raises (the caller drops that GPU); other NVML errors degrade the value.
        """
        try:
            return func(*args)
        except Exception as error:
            if self.is_gpu_lost(error) or not self.is_error(error):
                raise
            if self.is_unsupported(error):
                log.debug("NVML call not supported", extra=log_fields(call=what, error=str(error)))
            else:
                log.warning("NVML call failed", extra=log_fields(call=what, error=str(error)))
            return None


class _Never(Exception):
    """Stands in for an error class an older pynvml module does not define."""


def text(value: str | bytes) -> str:
    """pynvml returns str on Python 3, but older versions returned bytes."""
    return value.decode(errors="replace") if isinstance(value, bytes) else value
