"""Blocking vendor-library calls (NVML, amdsmi) in worker threads, bounded and never blocking shutdown.

A wedged driver can make a vendor call never return. Each call therefore has a time bound (past
it the caller gets `VendorCallTimeoutError` and the thread is left to finish on its own), and a
cancelled caller (SIGTERM) does not wait for the thread either. While a call runs, its worker
thread is named ``dra-agent vendor call: <what>``, so that at exit `exit_if_vendor_calls_hung` can
tell a hung call from an idle worker: the interpreter waits for every worker thread before it
exits, which a call that never returns would turn into a process that only SIGKILL ends.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from agent.core.errors import BackendError
from agent.core.logs import log_fields

log = logging.getLogger("agent.core.vendorcall")

T = TypeVar("T")

THREAD_PREFIX = "dra-agent vendor call: "
DEFAULT_CALL_TIMEOUT = 30.0
"""A vendor call that takes longer is treated as hung (the slowest normal call, a full
discovery of eight MIG-partitioned GPUs, takes about a second)."""
STOP_TIMEOUT = 1.0
"""How long shutting a vendor library down may take before the agent exits without it."""


class VendorCallTimeoutError(BackendError):
    """A vendor call did not return within its bound (the driver is probably wedged)."""


async def run_vendor_call(
    what: str,
    func: Callable[..., T],
    *args: Any,
    bound: float,
    limiter: anyio.CapacityLimiter | None = None,
) -> T:
    """`func(*args)` in a worker thread; raise `VendorCallTimeoutError` after `bound` seconds.

    Cancellation returns at once, leaving the thread to finish; `limiter` (when given) is
    released then too, so a hung call never holds up a later one for longer than `bound`.
    """

    def named() -> T:
        thread = threading.current_thread()
        name, thread.name = thread.name, THREAD_PREFIX + what
        try:
            return func(*args)
        finally:
            thread.name = name

    try:
        with anyio.fail_after(bound):
            return await anyio.to_thread.run_sync(named, abandon_on_cancel=True, limiter=limiter)
    except TimeoutError as error:
        raise VendorCallTimeoutError(
            f"vendor call {what} did not return within {bound:g} s: the GPU driver may be hung; "
            "check 'dmesg' and the vendor's tool (nvidia-smi, amd-smi) on the node"
        ) from error


class VendorLane:
    """Vendor calls that run one at a time, each bounded; a hung call keeps the lane.

    The lane is held by the worker thread, not by the caller: a call abandoned past its bound
    (or on cancellation) still holds it until it returns, and later calls wait for it at most
    their own bound. So a wedged driver costs one stuck thread per lane, not one per call.
    """

    def __init__(self, bound: float = DEFAULT_CALL_TIMEOUT) -> None:
        self.bound = bound
        self._limiter = anyio.CapacityLimiter(1)  # queue callers without taking threads
        self._lock = threading.Lock()
        self._holder = ""

    async def run(self, func: Callable[..., T], *args: Any, bound: float | None = None) -> T:
        """`func(*args)` on this lane; `VendorCallTimeoutError` past `bound` (default: the lane's)."""
        limit = self.bound if bound is None else bound
        what = getattr(func, "__name__", "call")

        started = threading.Event()

        def held() -> T:
            if not self._lock.acquire(timeout=limit):
                raise VendorCallTimeoutError(self._not_started(what, limit))
            started.set()
            self._holder = what
            try:
                return func(*args)
            finally:
                self._lock.release()

        try:
            return await run_vendor_call(what, held, bound=limit, limiter=self._limiter)
        except VendorCallTimeoutError as error:
            if started.is_set():
                raise
            raise VendorCallTimeoutError(self._not_started(what, limit)) from error

    def _not_started(self, what: str, limit: float) -> str:
        return (
            f"vendor call {what} not started: {self._holder} has not returned for {limit:g} s; "
            "the GPU driver may be hung: check 'dmesg' and the vendor's tool on the node"
        )


async def acquire_when_free(lock: threading.Lock, within: float) -> bool:
    """Take `lock` once the worker thread that holds it lets go; ``False`` after `within` seconds.

    Polls a non-blocking acquire, so that a cancelled caller never leaves a thread behind that
    would take the lock later (a vendor handle freed under a call in flight is a use after free).
    """
    with anyio.move_on_after(within):
        while not lock.acquire(blocking=False):  # noqa: ASYNC110
            await anyio.sleep(0.005)
        return True
    return False


def vendor_calls_running() -> list[str]:
    """What the vendor calls still running in a worker thread are doing."""
    return sorted(
        t.name[len(THREAD_PREFIX) :] for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)
    )


def exit_if_vendor_calls_hung(code: int, grace: float = 0.5) -> None:
    """At exit: give running vendor calls `grace` seconds, then end the process if one still runs.

    Returns when none runs (the interpreter can exit normally); otherwise logs what hangs and
    exits at once with `code`, instead of waiting forever for a thread that never returns.
    """
    deadline = time.monotonic() + grace
    # A call that ends leaves its thread alive (an idle worker) under its old name: poll names.
    while (hung := vendor_calls_running()) and time.monotonic() < deadline:
        time.sleep(0.01)
    if not hung:
        return
    log.error(
        "vendor calls still hung at exit; exiting without waiting for them",
        extra=log_fields(calls=",".join(hung), hint="check the GPU driver ('dmesg') before restarting"),
    )
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
