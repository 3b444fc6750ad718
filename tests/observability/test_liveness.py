"""``monitor/<driver>`` and the monitor's last-seen gauge follow the health monitor itself (issue 13).

Before, both were set by the telemetry poller (a dead health monitor looked alive while telemetry
reads worked) and `monitor_seen_sink` was never wired into the agent.
"""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest

from agent.app import Agent
from agent.config import AgentConfig
from agent.core.backend import (
    HealthEvent,
    HealthSink,
    report_alive,
)
from agent.core.errors import BackendError
from agent.core.model import Severity
from agent.observe.metrics import Metrics
from agent.observe.readiness import Readiness
from agent.observe.telemetry import SILENCE_LIMIT, MonitorLiveness
from tests.observability.fakes import TelemetryBackend
from tests.support.clock import FakeClock

DRIVER = "gpu.example.com"
XID = HealthEvent("gpu-0", "xid", Severity.CRITICAL, "79")


def last_seen(metrics: Metrics, driver: str = DRIVER) -> float | None:
    return metrics.registry.get_sample_value(
        "dra_agent_health_monitor_last_seen_timestamp_seconds", {"driver": driver}
    )


def check(readiness: Readiness, driver: str = DRIVER) -> tuple[bool, str]:
    return readiness.ready()[1][f"monitor/{driver}"]


async def settle() -> None:
    for _ in range(20):
        await anyio.lowlevel.checkpoint()


async def test_events_and_alive_reports_stamp_and_make_ready() -> None:
    metrics, clock, readiness = Metrics(), FakeClock(), Readiness()
    liveness = MonitorLiveness(DRIVER, metrics, clock, readiness)
    assert check(readiness) == (False, "not reported yet")
    seen: list[HealthEvent] = []

    async def tracker(event: HealthEvent) -> None:
        seen.append(event)

    sink = liveness.sink(tracker)
    report_alive(sink)
    assert check(readiness) == (True, "")
    assert last_seen(metrics) == clock.time()
    clock.advance(7)
    await sink(XID)
    assert seen == [XID]
    assert last_seen(metrics) == clock.time()


async def test_report_alive_to_a_plain_sink_is_ignored() -> None:
    async def plain(event: HealthEvent) -> None:
        raise AssertionError("not an event")

    report_alive(plain)


async def test_a_failing_or_returning_monitor_turns_not_ready() -> None:
    metrics, clock, readiness = Metrics(), FakeClock(), Readiness()
    liveness = MonitorLiveness(DRIVER, metrics, clock, readiness)

    async def broken(sink: HealthSink) -> None:
        report_alive(sink)
        raise BackendError("NVIDIA backend: NVML went away")

    with pytest.raises(BackendError):
        await liveness.run(broken, lambda event: anyio.lowlevel.checkpoint())
    ok, detail = check(readiness)
    assert not ok and "BackendError: NVIDIA backend: NVML went away" in detail

    async def returns(sink: HealthSink) -> None:
        report_alive(sink)

    await liveness.run(returns, lambda event: anyio.lowlevel.checkpoint())
    assert check(readiness) == (False, "the health monitor stopped")


async def test_a_silent_monitor_turns_not_ready_until_it_answers() -> None:
    metrics, clock, readiness = Metrics(), FakeClock(), Readiness()
    liveness = MonitorLiveness(DRIVER, metrics, clock, readiness)
    async with anyio.create_task_group() as tg:
        tg.start_soon(liveness.watch)
        await settle()
        clock.advance(SILENCE_LIMIT * 2)  # never answered: stays "not reported yet"
        await settle()
        assert check(readiness) == (False, "not reported yet")
        liveness.alive()
        for _ in range(4):
            clock.advance(SILENCE_LIMIT / 4)
            await settle()
        assert check(readiness)[0]  # exactly the limit: still fine
        clock.advance(SILENCE_LIMIT / 4)
        await settle()
        ok, detail = check(readiness)
        assert not ok and "no sign of life from the health monitor for over 60 s" in detail
        liveness.alive()
        assert check(readiness) == (True, "")
        tg.cancel_scope.cancel()


class MonitorOnly(TelemetryBackend):
    """A backend whose health monitor answers once and then stays silent, or fails."""

    def __init__(self, driver: str, failure: Exception | None = None) -> None:
        super().__init__(driver=driver)
        self.failure = failure

    async def monitor_health(self, sink: HealthSink) -> None:
        if self.failure is not None:
            raise self.failure
        report_alive(sink)
        await anyio.sleep_forever()


async def test_the_agent_wires_the_monitor_into_readiness_and_the_gauge() -> None:
    """Through `agent.app.Agent`, as ``dra-agent run`` builds it (no telemetry poller at all)."""
    metrics, clock, readiness = Metrics(), FakeClock(), Readiness()
    live, broken = MonitorOnly("live.example.com"), MonitorOnly("broken.example.com", BackendError("gone"))
    agent = Agent(AgentConfig(), backends=[live, broken], metrics=metrics, clock=clock, readiness=readiness)
    async with anyio.create_task_group() as tg:
        tg.start_soon(agent.run)
        with anyio.fail_after(5):
            await agent.started.wait()
            while (
                not check(readiness, "live.example.com")[0]
                or "gone" not in check(readiness, "broken.example.com")[1]
            ):
                await anyio.lowlevel.checkpoint()
        assert last_seen(metrics, "live.example.com") == clock.time()
        assert check(readiness, "broken.example.com") == (
            False,
            "the health monitor failed: BackendError: gone",
        )
        for _ in range(5):  # silent from now on
            clock.advance(SILENCE_LIMIT / 4)
            await settle()
        assert not check(readiness, "live.example.com")[0]
        tg.cancel_scope.cancel()
