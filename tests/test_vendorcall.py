"""Bounded vendor calls: time bounds, cancellation, lanes a hung call keeps, the exit that does not wait."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import anyio
import pytest

from agent.core.vendorcall import (
    VendorCallTimeoutError,
    VendorLane,
    acquire_when_free,
    exit_if_vendor_calls_hung,
    run_vendor_call,
    vendor_calls_running,
)


@pytest.fixture
def wedge() -> Iterator[threading.Event]:
    """Set at the end of the test: what blocked on it returns (no thread outlives the test)."""
    released = threading.Event()
    yield released
    released.set()


def nvml_wedged(released: threading.Event) -> str:
    released.wait()
    return "late"


async def wait_until_not_running(what: str) -> None:
    with anyio.fail_after(5):
        while what in vendor_calls_running():  # noqa: ASYNC110 - a worker thread renames itself
            await anyio.sleep(0.005)


async def test_a_call_returns_its_value_from_a_named_thread() -> None:
    def read() -> str:
        return threading.current_thread().name

    assert (
        await run_vendor_call("nvmlDeviceGetName", read, bound=5)
        == "dra-agent vendor call: nvmlDeviceGetName"
    )
    assert "nvmlDeviceGetName" not in vendor_calls_running()


async def test_a_hung_call_fails_past_its_bound_and_says_what_to_check(wedge: threading.Event) -> None:
    with pytest.raises(VendorCallTimeoutError, match=r"nvml_wedged did not return within 0.05 s.*dmesg"):
        await run_vendor_call("nvml_wedged", nvml_wedged, wedge, bound=0.05)
    assert vendor_calls_running() == ["nvml_wedged"]
    wedge.set()
    await wait_until_not_running("nvml_wedged")


async def test_cancellation_does_not_wait_for_the_thread(wedge: threading.Event) -> None:
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: run_vendor_call("nvml_wedged", nvml_wedged, wedge, bound=60))
            while "nvml_wedged" not in vendor_calls_running():  # noqa: ASYNC110
                await anyio.sleep(0.005)
            tg.cancel_scope.cancel()
    assert "nvml_wedged" in vendor_calls_running()


async def test_a_hung_call_keeps_its_lane_and_later_calls_fail_within_their_bound(
    wedge: threading.Event,
) -> None:
    lane = VendorLane(bound=0.05)
    with pytest.raises(VendorCallTimeoutError):
        await lane.run(nvml_wedged, wedge)
    with pytest.raises(VendorCallTimeoutError, match="not started: nvml_wedged has not returned"):
        await lane.run(str, 1)
    other = VendorLane(bound=0.05)  # another lane (the health monitor's) is not held up
    assert await other.run(str, 2) == "2"
    wedge.set()
    await wait_until_not_running("nvml_wedged")
    assert await lane.run(str, 3, bound=5) == "3"


async def test_a_lane_runs_one_call_at_a_time() -> None:
    lane = VendorLane(bound=5)
    inside: list[int] = []
    most = [0]

    def call() -> None:
        inside.append(1)
        most[0] = max(most[0], len(inside))
        inside.pop()

    async with anyio.create_task_group() as tg:
        for _ in range(8):
            tg.start_soon(lane.run, call)
    assert most[0] == 1


async def test_acquire_when_free_waits_for_the_holder_and_gives_up_past_its_bound() -> None:
    lock = threading.Lock()
    lock.acquire()
    assert not await acquire_when_free(lock, 0.02)  # still held: the caller leaves it
    async with anyio.create_task_group() as tg:
        tg.start_soon(anyio.to_thread.run_sync, lock.release)
        assert await acquire_when_free(lock, 30)
    assert lock.locked()
    lock.release()


def test_exit_returns_when_no_call_hangs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "_exit", pytest.fail)
    exit_if_vendor_calls_hung(0, grace=0.01)


async def test_exit_does_not_wait_for_a_hung_call(
    wedge: threading.Event, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    exits: list[int] = []
    monkeypatch.setattr(os, "_exit", exits.append)
    with pytest.raises(VendorCallTimeoutError):
        await run_vendor_call("nvml_wedged", nvml_wedged, wedge, bound=0.01)
    exit_if_vendor_calls_hung(3, grace=0.01)
    assert exits == [3]
    [record] = [r for r in caplog.records if r.getMessage().startswith("vendor calls still hung at exit")]
    assert record.__dict__["fields"]["calls"] == "nvml_wedged"
