"""Counting worker-thread hops: every `anyio.to_thread.run_sync` the code under test makes."""

from __future__ import annotations

from typing import Any

import anyio.to_thread
import pytest


def count_hops(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """From now on, every function sent to a worker thread is appended to the list returned."""
    hops: list[object] = []
    real = anyio.to_thread.run_sync

    async def counting(func: Any, *args: Any, **kwargs: Any) -> Any:
        hops.append(func)
        return await real(func, *args, **kwargs)

    monkeypatch.setattr(anyio.to_thread, "run_sync", counting)
    return hops
