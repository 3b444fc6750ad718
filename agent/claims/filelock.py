"""A cross-process lock on a file (``flock``), for rolling updates.

During a rolling update two agent pods serve the same driver for a while; prepare and unprepare
must not interleave between them, so both serialize through ``serialize.lock`` in the plugin data
directory (as the Go helper does). The lock also excludes tasks of this process: one ``flock`` is
shared by every task of a process, so an `anyio.Lock` orders them first.
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path
from types import TracebackType

import anyio

from agent.core.clock import Clock, SystemClock
from agent.core.errors import AgentError
from agent.core.logs import log_fields

log = logging.getLogger("agent.claims.filelock")


class FileLockError(AgentError):
    """The lock file cannot be opened or locked."""


class FileLock:
    """``async with lock:`` holds an exclusive ``flock`` on `path` (and an in-process lock).

    Waiting polls a non-blocking ``flock`` so that a cancelled waiter never leaves a thread
    behind that would take the lock later.
    """

    def __init__(self, path: Path, *, clock: Clock | None = None, poll_interval: float = 0.005) -> None:
        self.path = path
        self._clock = clock or SystemClock()
        self._poll = poll_interval
        # A semaphore, not a lock: a holder may hand the release to another task (the claim state
        # shares one hold among concurrent calls and the last one out releases it).
        self._local = anyio.Semaphore(1, fast_acquire=True)  # no loop trip when uncontended
        self._fd: int | None = None

    def _open(self) -> int:
        if self._fd is None:
            try:
                # On a fresh node the plugin data directory does not exist yet.
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except OSError as error:
                raise FileLockError(
                    f"cannot open lock file {self.path}: {error.strerror}; "
                    "check that the plugin data directory exists and is writable"
                ) from error
        return self._fd

    def _try_lock(self, fd: int) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError as error:
            raise FileLockError(f"cannot lock {self.path}: {error.strerror}") from error
        return True

    async def acquire(self) -> None:
        """Wait for the lock (cancellable)."""
        await self._local.acquire()
        try:
            fd = self._open()
            waited = False
            while not self._try_lock(fd):
                if not waited:
                    log.info(
                        "waiting for the file lock held by another agent",
                        extra=log_fields(path=str(self.path)),
                    )
                    waited = True
                await self._clock.sleep(self._poll)
        except BaseException:
            self._local.release()
            raise

    async def try_acquire(self) -> bool:
        """Take the lock if it is free now; False (nothing held) when another holder has it."""
        await self._local.acquire()
        try:
            if self._try_lock(self._open()):
                return True
        except BaseException:
            self._local.release()
            raise
        self._local.release()
        return False

    def release(self) -> None:
        """Release the lock."""
        try:
            if self._fd is not None:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._local.release()

    def close(self) -> None:
        """Close the lock file (the lock must not be held)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    async def __aenter__(self) -> FileLock:
        await self.acquire()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
