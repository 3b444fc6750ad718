"""A thin seam over the `amdsmi` package: lazy import, clear errors, and calls off the event loop.

Loading the binding is `backends.amd.binding`'s concern. Every call into the library is blocking, so the
backend groups its calls into plain functions of the module and runs them in worker threads on
the lanes of `SmiLibrary` (`agent.core.vendorcall`): discovery and telemetry on one, the health
monitor's polls and its event reads on lanes of their own, shutdown on none. Each call is
bounded, so a wedged driver fails a call instead of the agent, and SIGTERM never waits for one.
Re-initialising the library (`SmiLibrary.reinit`: ``amdsmi_shut_down`` + ``amdsmi_init``, which
invalidates every handle) waits until no call is running on any lane and holds the others back.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from agent.core.errors import BackendError
from agent.core.logs import log_fields
from agent.core.vendorcall import DEFAULT_CALL_TIMEOUT, VendorCallTimeoutError, VendorLane, run_vendor_call
from backends.amd.binding import INSTALL_HINT

log = logging.getLogger("agent.backends.amd")

T = TypeVar("T")

# amdsmi_status_t values (amdsmi_wrapper.AMDSMI_STATUS_*); stable across ROCm 6 and 7.
STATUS_INVAL = 1
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
STATUS_NO_DATA = 40
STATUS_UNKNOWN_ERROR = 0xFFFFFFFF

# Statuses that mean the GPU (or its driver) went away under us, not that a call is unsupported:
# the DRM ioctl failing (amd_smi_drm.cc answers DRM_ERROR for any failed ioctl), the device or
# driver gone. Not FILE_ERROR: 7.0.x answers it for an empty CPER ring of a healthy GPU.
LOST_STATUSES = frozenset({STATUS_DRM_ERROR, STATUS_IO, STATUS_NOT_FOUND, STATUS_DRIVER_NOT_LOADED})
# Statuses that mean this GPU (or this agent, without root) cannot answer a call at all: asking
# again will not help, so a health check that gets one is skipped from then on.
UNAVAILABLE_STATUSES = frozenset({STATUS_NOT_SUPPORTED, STATUS_NOT_YET_IMPLEMENTED, STATUS_NO_PERM})


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


class _Gate:
    """Calls share the library; a re-initialisation has it alone (it waits for the calls running,
    and calls arriving meanwhile wait for it)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._running = 0
        self._exclusive = False
        self._waiting = 0

    def enter(self, bound: float, what: str) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: not self._exclusive and not self._waiting, bound):
                raise VendorCallTimeoutError(f"vendor call {what} not started: amdsmi is re-initialising")
            self._running += 1

    def leave(self) -> None:
        with self._cond:
            self._running -= 1
            self._cond.notify_all()

    def enter_alone(self, bound: float) -> None:
        with self._cond:
            self._waiting += 1
            try:
                if not self._cond.wait_for(lambda: not self._running and not self._exclusive, bound):
                    raise VendorCallTimeoutError(
                        f"amdsmi re-initialisation not started: a call has not returned for {bound:g} s"
                    )
            finally:
                self._waiting -= 1
            self._exclusive = True

    def leave_alone(self) -> None:
        with self._cond:
            self._exclusive = False
            self._cond.notify_all()


class SmiLibrary:
    """The loaded `amdsmi` module with ways to run blocking work on it in worker threads."""

    def __init__(self, module: Any, call_timeout: float = DEFAULT_CALL_TIMEOUT) -> None:
        self.module = module
        self.call_timeout = call_timeout
        self._serial = VendorLane(call_timeout)
        self._health = VendorLane(call_timeout)
        self._events = VendorLane(call_timeout)
        self._gate = _Gate()
        self.generation = 0
        """How many times `reinit` re-initialised amdsmi (every handle from before is stale)."""

    def _shared(self, work: Callable[[Any], T], what: str) -> Callable[[Any], T]:
        """`work`, named `what` for the vendor-call thread and errors, run while no re-init runs."""
        gate, bound = self._gate, self.call_timeout

        def call(module: Any) -> T:
            gate.enter(bound, what or "call")
            try:
                return work(module)
            finally:
                gate.leave()

        call.__name__ = what or getattr(work, "__name__", "call")
        return call

    async def run(self, work: Callable[[Any], T], what: str = "") -> T:
        """Run `work(module)` in a worker thread, one call at a time (discovery, telemetry)."""
        return await self._serial.run(self._shared(work, what), self.module)

    async def run_health(self, work: Callable[[Any], T], what: str = "") -> T:
        """Run the health monitor's `work(module)` (RAS polls, event readers) on its own lane."""
        return await self._health.run(self._shared(work, what), self.module)

    async def run_events(self, work: Callable[[Any], T], bound: float, what: str = "") -> T:
        """Run an event read on its own lane, within `bound` seconds."""
        return await self._events.run(self._shared(work, what), self.module, bound=bound)

    async def run_unlimited(self, work: Callable[[Any], T], bound: float, what: str = "") -> T:
        """Run `work(module)` in its own worker thread, on no lane (shutdown), within `bound` seconds."""
        named = _named(work, what)
        return await run_vendor_call(named.__name__, named, self.module, bound=bound)

    async def reinit(self, work: Callable[[Any], T], what: str) -> T:
        """Run `work(module)` (``amdsmi_shut_down`` + ``amdsmi_init``...) on the serial lane with
        no other amdsmi call running on any lane."""
        gate, bound = self._gate, self.call_timeout

        def alone(module: Any) -> T:
            gate.enter_alone(bound)
            try:
                self.generation += 1  # before the work: a failed re-init leaves stale handles too
                return work(module)
            finally:
                gate.leave_alone()

        alone.__name__ = what
        return await self._serial.run(alone, self.module, bound=2 * bound)


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
