"""EventRecorder: body shape, deduplication, rate limit, failures swallowed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agent.core.errors import KubeApiError
from agent.kube.events import WARNING, EventRecorder
from agent.observe.metrics import Metrics
from tests.support.clock import FakeClock


class FakeKube:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.fail: KubeApiError | None = None
        self.node_lookups = 0

    async def create_event(self, body: Mapping[str, Any], namespace: str = "default") -> dict[str, Any]:
        if self.fail is not None:
            raise self.fail
        self.events.append(dict(body))
        return dict(body)

    async def get_node(self, name: str) -> dict[str, Any]:
        self.node_lookups += 1
        return {"metadata": {"name": name, "uid": "uid-1"}}


def recorder(kube: FakeKube, clock: FakeClock, **kwargs: Any) -> EventRecorder:
    return EventRecorder(kube, "node-1", "", clock, **kwargs)  # type: ignore[arg-type]


async def test_event_body_names_the_node(fake_clock: FakeClock) -> None:
    kube = FakeKube()
    assert await recorder(kube, fake_clock).record("DeviceTainted", "gpu-0 tainted", WARNING)
    (event,) = kube.events
    assert event["involvedObject"] == {"apiVersion": "v1", "kind": "Node", "name": "node-1", "uid": "uid-1"}
    assert event["type"] == "Warning" and event["reason"] == "DeviceTainted"
    assert event["metadata"]["name"].startswith("node-1.")
    assert event["firstTimestamp"].endswith("Z")


async def test_repeats_are_dropped_within_the_window(fake_clock: FakeClock) -> None:
    kube = FakeKube()
    rec = recorder(kube, fake_clock, dedupe_seconds=60)
    assert await rec.record("R", "same")
    assert not await rec.record("R", "same")
    assert await rec.record("R", "other")
    fake_clock.advance(61)
    assert await rec.record("R", "same")
    assert len(kube.events) == 3 and rec.suppressed == 1
    assert kube.node_lookups == 1


async def test_bursts_are_rate_limited(fake_clock: FakeClock) -> None:
    kube = FakeKube()
    rec = recorder(kube, fake_clock, burst=3, refill_seconds=10)
    sent = [await rec.record("R", f"m{i}") for i in range(5)]
    assert sent == [True, True, True, False, False]
    fake_clock.advance(10)
    assert await rec.record("R", "later")


async def test_failures_are_swallowed_and_counted(fake_clock: FakeClock) -> None:
    kube = FakeKube()
    metrics = Metrics()
    kube.fail = KubeApiError("down", 0)
    rec = recorder(kube, fake_clock, metrics=metrics)
    assert not await rec.record("R", "a")
    assert not await rec.record("R", "b")
    kube.fail = None
    assert await rec.record("R", "c")
    assert (
        metrics.registry.get_sample_value(
            "dra_agent_api_writes_total", {"resource": "events", "verb": "create", "result": "error"}
        )
        == 2
    )
