"""Resource-health stream: complete lists on connect, on change and as heartbeats; many watchers."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Iterator
from pathlib import Path
from typing import Any, cast

import anyio
import grpc
import pytest
from grpclib.client import Channel
from prometheus_client import CollectorRegistry

from agent.core.inventory import Inventory
from agent.core.model import Device, DeviceHealth, HealthCondition, Severity
from agent.kubelet._protos import v1alpha1 as pb
from agent.kubelet.healthservice import WATCH_PATH, HealthService, truncate_message
from agent.observe.metrics import Metrics
from tests.kubelet.grpc_support import DRIVER, WATCH, grpcio_protos, make_plugin, serving, short_tmp_dir
from tests.support.clock import FakeClock

XID = DeviceHealth((HealthCondition("xid", Severity.CRITICAL, value="79", message="fell off the bus"),))
UNMONITORED = DeviceHealth((HealthCondition("unmonitored", Severity.WARNING),))


@pytest.fixture
def root() -> Iterator[Path]:
    yield from short_tmp_dir()


def inventory(n: int = 2) -> Inventory:
    inv = Inventory(DRIVER)
    inv.set_devices([Device(name=f"gpu-{i}", driver=DRIVER) for i in range(n)])
    return inv


def summary(message: Any) -> dict[str, int]:
    """device name -> health enum value, for pb (betterproto) and pb2 (protobuf) messages."""
    return {d.device.device_name: int(d.health) for d in message.devices}


async def wait_until(predicate: Callable[[], bool]) -> None:
    for _ in range(1000):
        if predicate():
            return
        await anyio.sleep(0.005)
    raise AssertionError("condition not reached")


def test_truncate_message() -> None:
    assert truncate_message("x" * 1024) == "x" * 1024
    cut = truncate_message("y" * 5000)
    assert len(cut) == 1024 and cut.endswith("y...")
    assert truncate_message("short") == "short"


def test_report_contents() -> None:
    inv = inventory(3)
    inv.set_health({"gpu-1": XID, "gpu-2": UNMONITORED})
    clock = FakeClock(start=1_700_000_123.7)
    service = HealthService(inv, pool="node-1", clock=clock, health_check_timeout=45, heartbeat_interval=5)
    report = service.report()
    assert summary(report) == {
        "gpu-0": pb.HealthStatus.HEALTHY,
        "gpu-1": pb.HealthStatus.UNHEALTHY,
        "gpu-2": pb.HealthStatus.UNKNOWN,
    }
    for d in report.devices:
        assert d.device.pool_name == "node-1"
        assert d.last_updated_time == 1_700_000_123
        assert d.health_check_timeout_seconds == 45
    assert report.devices[0].message == ""
    assert report.devices[1].message == "xid=79: fell off the bus"


def test_long_message_is_truncated() -> None:
    inv = inventory(1)
    inv.set_health({"gpu-0": DeviceHealth((HealthCondition("xid", Severity.CRITICAL, message="m" * 3000),))})
    (device,) = HealthService(inv, pool="n").report().devices
    assert len(device.message) == 1024 and device.message.endswith("...")


@pytest.mark.parametrize(("heartbeat", "timeout"), [(0, 60), (-1, 60), (60, 60), (90, 60)])
def test_heartbeat_must_be_inside_the_timeout(heartbeat: float, timeout: int) -> None:
    with pytest.raises(ValueError, match="heartbeat interval"):
        HealthService(inventory(), pool="n", heartbeat_interval=heartbeat, health_check_timeout=timeout)


class FakeStream:
    """Stands in for a grpclib server stream; `send_message` can be held back."""

    def __init__(self, hold: anyio.Event | None = None) -> None:
        self.sent: list[pb.NodeWatchResourcesResponse] = []
        self.hold = hold
        self.peer = None

    async def recv_message(self) -> pb.NodeWatchResourcesRequest:
        return pb.NodeWatchResourcesRequest()

    async def send_message(self, message: pb.NodeWatchResourcesResponse) -> None:
        if self.hold is not None:
            await self.hold.wait()
        self.sent.append(message)


async def test_slow_watcher_never_blocks_and_gets_the_latest_state() -> None:
    inv = inventory(2)
    service = HealthService(inv, pool="n", clock=FakeClock())
    handler = service.__mapping__()[WATCH_PATH].func
    fast, slow = FakeStream(), FakeStream(hold=anyio.Event())
    async with anyio.create_task_group() as tg:
        tg.start_soon(handler, slow)
        tg.start_soon(handler, fast)
        await wait_until(lambda: len(fast.sent) == 1 and service.watchers == 2)
        for i in range(20):
            # The agent side: inventory updates are synchronous and never wait for watchers.
            inv.set_health({"gpu-0": XID} if i % 2 == 0 else {})
            await wait_until(lambda i=i: len(fast.sent) == i + 2)  # type: ignore[misc]
        assert slow.sent == []
        assert slow.hold is not None
        slow.hold.set()
        await wait_until(lambda: len(slow.sent) == 2)
        # Nothing was queued for the slow watcher: the stale first list, then the current one.
        assert summary(slow.sent[-1]) == summary(service.report()) == summary(fast.sent[-1])
        await anyio.sleep(0.05)
        assert len(slow.sent) == 2
        tg.cancel_scope.cancel()
    assert service.watchers == 0


def watch(channel: Channel) -> AsyncGenerator[pb.NodeWatchResourcesResponse, None]:
    stream = pb.DraResourceHealthStub(channel).node_watch_resources(pb.NodeWatchResourcesRequest())
    return cast(AsyncGenerator[pb.NodeWatchResourcesResponse, None], stream)


async def test_nothing_is_sent_before_discovery() -> None:
    inv = Inventory(DRIVER)
    clock = FakeClock()
    service = HealthService(inv, pool="n", clock=clock)
    stream = FakeStream()
    async with anyio.create_task_group() as tg:
        tg.start_soon(service.__mapping__()[WATCH_PATH].func, stream)
        await wait_until(lambda: service.watchers == 1)
        clock.advance(120)
        await anyio.sleep(0.02)
        assert stream.sent == []
        inv.set_devices([Device(name="gpu-0", driver=DRIVER)])
        await wait_until(lambda: len(stream.sent) == 1)
        assert summary(stream.sent[0]) == {"gpu-0": pb.HealthStatus.HEALTHY}
        tg.cancel_scope.cancel()


async def test_grpclib_watcher_initial_change_and_heartbeat(root: Path) -> None:
    inv = inventory(2)
    clock = FakeClock()
    metrics = Metrics(CollectorRegistry())
    plugin = make_plugin(root, inventory=inv, clock=clock, metrics=metrics, heartbeat_interval=10)
    watchers = {"driver": DRIVER}
    async with serving(plugin), Channel(path=str(plugin.dra_socket)) as channel:
        stream = watch(channel)
        with anyio.fail_after(10):
            first = await anext(stream)
            assert summary(first) == {"gpu-0": 1, "gpu-1": 1}
            assert metrics.registry.get_sample_value("dra_agent_health_stream_watchers", watchers) == 1
            inv.set_health({"gpu-1": XID})
            second = await anext(stream)
            assert summary(second) == {"gpu-0": 1, "gpu-1": 2}
            # No change, only time passing: the heartbeat resends the list. Keep advancing the
            # fake clock until it arrives (the server may not have started its sleep yet).
            async with anyio.create_task_group() as tg:

                async def tick() -> None:
                    while True:
                        clock.advance(10)
                        await anyio.sleep(0.005)

                tg.start_soon(tick)
                heartbeat = await anext(stream)
                tg.cancel_scope.cancel()
        await stream.aclose()
    assert summary(heartbeat) == summary(second)
    assert heartbeat.devices[0].last_updated_time > second.devices[0].last_updated_time
    await wait_until(lambda: plugin.health.watchers == 0)
    assert metrics.registry.get_sample_value("dra_agent_health_stream_watchers", watchers) == 0


async def test_two_grpcio_watchers_see_every_change(root: Path) -> None:
    pb2 = grpcio_protos().health
    inv = inventory(1)
    plugin = make_plugin(root, inventory=inv)
    async with serving(plugin), grpc.aio.insecure_channel(f"unix://{plugin.dra_socket}") as channel:
        watch = channel.unary_stream(
            WATCH,
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=pb2.NodeWatchResourcesResponse.FromString,
        )
        calls = [watch(pb2.NodeWatchResourcesRequest()), watch(pb2.NodeWatchResourcesRequest())]
        with anyio.fail_after(10):
            firsts = [await call.read() for call in calls]
            assert [summary(m) for m in firsts] == [{"gpu-0": pb2.HEALTHY}] * 2
            assert firsts[0].devices[0].health_check_timeout_seconds == 60
            await wait_until(lambda: plugin.health.watchers == 2)
            inv.set_health({"gpu-0": UNMONITORED})
            seconds = [await call.read() for call in calls]
            assert [summary(m) for m in seconds] == [{"gpu-0": pb2.UNKNOWN}] * 2
            assert seconds[0].devices[0].message == "unmonitored"
            calls[0].cancel()
            await wait_until(lambda: plugin.health.watchers == 1)
            inv.set_health({})
            third = await calls[1].read()
            assert summary(third) == {"gpu-0": pb2.HEALTHY}


async def test_watcher_sees_vanished_devices(root: Path) -> None:
    inv = inventory(3)
    plugin = make_plugin(root, inventory=inv)
    async with serving(plugin), Channel(path=str(plugin.dra_socket)) as channel:
        stream = watch(channel)
        with anyio.fail_after(10):
            assert len((await anext(stream)).devices) == 3
            inv.set_devices([Device(name="gpu-2", driver=DRIVER)])
            assert summary(await anext(stream)) == {"gpu-2": 1}
        await stream.aclose()
