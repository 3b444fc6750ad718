"""Rates of counters that only grow (correctable ECC errors, PCIe replays), for trend conditions."""

from __future__ import annotations

from collections import deque


class RateWindow:
    """The samples of one counter over the last `window` seconds, and its rate per minute.

    The rate is only judged over a whole window: a single error right after the agent starts
    (or between two passes a few seconds apart) is not a rate.
    """

    def __init__(self, window: float) -> None:
        self._window = window
        self._samples: deque[tuple[float, int]] = deque()

    def add(self, at: float, count: int) -> float | None:
        """Add the count read at `at` (monotonic seconds); the rate per minute, or None before a
        whole window of samples."""
        if self._samples and count < self._samples[-1][1]:
            # The counter went back (a GPU reset or a driver reload zeroes it): start over.
            self._samples.clear()
        self._samples.append((at, count))
        # Keep one sample at or before the window's start: the rate spans at least the window.
        while len(self._samples) > 1 and self._samples[1][0] <= at - self._window:
            self._samples.popleft()
        first_at, first = self._samples[0]
        elapsed = at - first_at
        if elapsed < self._window or elapsed <= 0:
            return None
        return (count - first) * 60.0 / elapsed

    def reset(self) -> None:
        """Forget the samples (the GPU was lost: its counters may restart)."""
        self._samples.clear()
