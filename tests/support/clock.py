"""A manual clock for tests and benchmarks: hold times and backoff without sleeping."""

from __future__ import annotations

import anyio
import anyio.lowlevel


class FakeClock:
    """A manual clock for tests: `advance` moves time; `sleep` waits until time has moved enough."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._now = start
        self._start = start
        self._changed = anyio.Event()

    def time(self) -> float:
        return self._now

    def monotonic(self) -> float:
        return self._now - self._start

    async def sleep(self, seconds: float) -> None:
        deadline = self._now + seconds
        while self._now < deadline:
            event = self._changed
            await event.wait()
        await anyio.lowlevel.checkpoint()

    def advance(self, seconds: float) -> None:
        """Move time forward and wake sleepers whose deadline has passed."""
        self._now += seconds
        event, self._changed = self._changed, anyio.Event()
        event.set()
