"""Time as a dependency, so tests can drive hold times and backoff without sleeping."""

from __future__ import annotations

import time
from typing import Protocol

import anyio


class Clock(Protocol):
    """Wall time, monotonic time and sleeping."""

    def time(self) -> float:
        """Unix time in seconds."""
        ...

    def monotonic(self) -> float:
        """Monotonic seconds, for intervals."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Sleep (cancellable)."""
        ...


class SystemClock:
    """The real clock."""

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await anyio.sleep(seconds)
