"""Resource-health stream: complete lists on connect, on change and as heartbeats; many watchers.

Served as v1 and v1alpha1. Upstream facts relied on (kubernetes/kubernetes):
staging/src/k8s.io/kubelet/pkg/apis/dra-health/v1/api.proto (package v1, the v1alpha1 messages
unchanged), .../dra-health/v1/conversion.go (v1 and v1alpha1 differ only by package: field
copies), pkg/kubelet/cm/dra/healthinfo.go (``DefaultHealthTimeout`` 30 s when a report carries
no ``health_check_timeout_seconds``; a device whose last report is older than its timeout is
Unknown; the kubelet stamps its own receive time) and pkg/kubelet/cm/dra/plugin/
dra_plugin_manager_test.go (``TestPickHealthService``: v1 is picked when both are offered).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import AsyncGenerator, Callable, Iterator
from pathlib import Path
from typing import Any, cast

import anyio
import grpc
import pytest
from grpclib import GRPCError
from grpclib.client import Channel
from grpclib.const import Status
from prometheus_client import CollectorRegistry

from agent.core.inventory import Inventory
from agent.core.model import Device, DeviceHealth, HealthCondition, Severity
from agent.kubelet._protos import v1 as pb_v1
from agent.kubelet._protos import v1alpha1 as pb
from agent.kubelet.healthservice import (
    HEALTH_APIS,
    KUBELET_DEFAULT_HEALTH_TIMEOUT,
    V1,
    V1ALPHA1,
    WATCH_PATH,
    WATCH_PATH_V1,
    HealthService,
    truncate_message,
)
from agent.observe.metrics import Metrics
from tests.kubelet.grpc_support import (
    DRIVER,
    WATCH,
    WATCH_V1,
    grpcio_protos,
    make_plugin,
    serving,
    short_tmp_dir,
)
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


@pytest.mark.parametrize(
    ("heartbeat", "timeout"),
    # At most a third of min(timeout, 30 s): a 1.34 kubelet ignores the advertised timeout.
    [(0, 60), (-1, 60), (60, 60), (90, 60), (11, 60), (10.5, 120), (7, 20), (1, 0), (1, -5)],
)
def test_heartbeat_must_be_well_inside_the_timeout(heartbeat: float, timeout: int) -> None:
    with pytest.raises(ValueError, match="heartbeat interval"):
        HealthService(inventory(), pool="n", heartbeat_interval=heartbeat, health_check_timeout=timeout)


@pytest.mark.parametrize(("heartbeat", "timeout"), [(10, 60), (10, 30), (5, 15), (10, 3600), (0.5, 2)])
def test_heartbeats_that_fit(heartbeat: float, timeout: int) -> None:
    service = HealthService(inventory(), pool="n", heartbeat_interval=heartbeat, health_check_timeout=timeout)
    assert service.heartbeat_interval == heartbeat


def test_default_heartbeat_fits_three_times_into_both_timeouts() -> None:
    service = HealthService(inventory(), pool="n")
    assert service.health_check_timeout >= KUBELET_DEFAULT_HEALTH_TIMEOUT
    assert service.heartbeat_interval * 3 <= KUBELET_DEFAULT_HEALTH_TIMEOUT


def test_both_apis_have_the_same_messages() -> None:
    # conversion.go copies every field one to one: the two packages must stay field-identical.
    for name in (
        "NodeWatchResourcesRequest",
        "DeviceIdentifier",
        "DeviceHealth",
        "NodeWatchResourcesResponse",
    ):
        fields = [
            {f.name: (f.metadata["betterproto"].number, f.type) for f in dataclasses.fields(getattr(m, name))}
            for m in (pb_v1, pb)
        ]
        assert fields[0] == fields[1], name
    assert {s.name: s.value for s in pb_v1.HealthStatus} == {s.name: s.value for s in pb.HealthStatus}


def test_one_report_both_apis_same_bytes() -> None:
    inv = inventory(3)
    inv.set_health({"gpu-1": XID, "gpu-2": UNMONITORED})
    service = HealthService(inv, pool="node-1", clock=FakeClock())
    v1, v1alpha1 = service.report(V1), service.report(V1ALPHA1)
    assert isinstance(v1, pb_v1.NodeWatchResourcesResponse)
    assert isinstance(v1alpha1, pb.NodeWatchResourcesResponse)
    assert bytes(v1) == bytes(v1alpha1) != b""
    assert set(service.__mapping__()) == {WATCH_PATH_V1, WATCH_PATH} == {a.watch_path for a in HEALTH_APIS}


REQUEST = pb.NodeWatchResourcesRequest()


class FakeStream:
    """Stands in for a grpclib server stream; `send_message` can be held back.

    With a `clock`, `times` records the clock's time of every message sent.
    """

    def __init__(
        self,
        hold: anyio.Event | None = None,
        clock: FakeClock | None = None,
        request: Any = REQUEST,
    ) -> None:
        self.sent: list[Any] = []
        self.times: list[float] = []
        self.hold = hold
        self.clock = clock
        self.request = request
        self.peer = None

    async def recv_message(self) -> Any:
        if isinstance(self.request, Exception):
            raise self.request
        return self.request

    async def send_message(self, message: Any) -> None:
        if self.hold is not None:
            await self.hold.wait()
        self.sent.append(message)
        if self.clock is not None:
            self.times.append(self.clock.time())


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


class WatchedClock(FakeClock):
    """A `FakeClock` that knows the deadlines of the sleeps in progress."""

    def __init__(self) -> None:
        super().__init__()
        self.deadlines: list[float] = []

    async def sleep(self, seconds: float) -> None:
        deadline = self.time() + seconds
        self.deadlines.append(deadline)
        try:
            await super().sleep(seconds)
        finally:
            self.deadlines.remove(deadline)

    def settled(self) -> bool:
        """Someone sleeps, and no sleep is due: every waiter has caught up with the time."""
        return bool(self.deadlines) and all(d > self.time() for d in self.deadlines)


@pytest.mark.parametrize("api", HEALTH_APIS, ids=lambda a: a.service)
async def test_reports_stay_within_the_kubelet_timeout(api: Any) -> None:
    """Play healthinfo.go's staleness rule over 5 minutes of fake time, in 1 s steps.

    After every step (once the stream sleeps again) each device's last report must be younger
    than the heartbeat interval, hence well inside both the advertised timeout and the kubelet's
    30 s default; inventory changes in between are reported at once.
    """
    inv = inventory(2)
    clock = WatchedClock()
    service = HealthService(inv, pool="n", clock=clock)
    stream = FakeStream(clock=clock)
    async with anyio.create_task_group() as tg:
        tg.start_soon(service.__mapping__()[api.watch_path].func, stream)
        await wait_until(lambda: len(stream.sent) == 1 and clock.settled())
        start = clock.time()
        for step in range(1, 301):
            clock.advance(1)
            if step % 47 == 0:
                sent = len(stream.sent)
                inv.set_health({"gpu-0": XID} if step % 2 else {})
                await wait_until(lambda sent=sent: len(stream.sent) > sent)  # type: ignore[misc]
            await wait_until(clock.settled)
            last, age = stream.sent[-1], clock.time() - stream.times[-1]
            assert {d.device.device_name for d in last.devices} == {"gpu-0", "gpu-1"}
            for device in last.devices:
                timeout = device.health_check_timeout_seconds or KUBELET_DEFAULT_HEALTH_TIMEOUT
                assert age < service.heartbeat_interval <= min(timeout, KUBELET_DEFAULT_HEALTH_TIMEOUT) / 3
        tg.cancel_scope.cancel()
    gaps = [b - a for a, b in itertools.pairwise(stream.times)]
    assert max(gaps) == service.heartbeat_interval == 10
    assert {start + step for step in range(47, 301, 47)} <= set(stream.times)
    assert all(isinstance(m, api.messages.NodeWatchResourcesResponse) for m in stream.sent)


@pytest.mark.parametrize(
    ("request_", "expected"),
    [
        (None, "expects one NodeWatchResourcesRequest, got none"),
        (RuntimeError("The given binary data does not match the protobuf schema."), "malformed"),
    ],
)
async def test_bad_requests_are_refused_clearly(request_: Any, expected: str) -> None:
    service = HealthService(inventory(), pool="n", clock=FakeClock())
    stream = FakeStream(request=request_)
    with pytest.raises(GRPCError) as err:
        await service.__mapping__()[WATCH_PATH_V1].func(stream)
    assert err.value.status is Status.INVALID_ARGUMENT
    assert expected in (err.value.message or "") and "v1.DRAResourceHealth" in (err.value.message or "")
    assert stream.sent == [] and service.watchers == 0


def watch_v1(channel: Channel) -> AsyncGenerator[pb_v1.NodeWatchResourcesResponse, None]:
    stream = pb_v1.DraResourceHealthStub(channel).node_watch_resources(pb_v1.NodeWatchResourcesRequest())
    return cast(AsyncGenerator[pb_v1.NodeWatchResourcesResponse, None], stream)


async def test_grpclib_v1_watcher(root: Path) -> None:
    inv = inventory(2)
    plugin = make_plugin(root, inventory=inv)
    async with serving(plugin), Channel(path=str(plugin.dra_socket)) as channel:
        stream = watch_v1(channel)
        with anyio.fail_after(10):
            first = await anext(stream)
            assert isinstance(first, pb_v1.NodeWatchResourcesResponse)
            assert summary(first) == {
                "gpu-0": pb_v1.HealthStatus.HEALTHY,
                "gpu-1": pb_v1.HealthStatus.HEALTHY,
            }
            assert first.devices[0].health_check_timeout_seconds == 60
            assert first.devices[0].device.pool_name == "node-1"
            inv.set_health({"gpu-1": XID})
            second = await anext(stream)
            assert summary(second) == {"gpu-0": 1, "gpu-1": pb_v1.HealthStatus.UNHEALTHY}
            assert second.devices[1].message == "xid=79: fell off the bus"
        await stream.aclose()
    await wait_until(lambda: plugin.health.watchers == 0)


async def test_grpcio_watchers_on_v1_and_v1alpha1(root: Path) -> None:
    protos = grpcio_protos()
    inv = inventory(1)
    plugin = make_plugin(root, inventory=inv)
    async with serving(plugin), grpc.aio.insecure_channel(f"unix://{plugin.dra_socket}") as channel:
        calls = [
            channel.unary_stream(
                path,
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=pb2.NodeWatchResourcesResponse.FromString,
            )(pb2.NodeWatchResourcesRequest())
            for path, pb2 in ((WATCH_V1, protos.health_v1), (WATCH, protos.health))
        ]
        with anyio.fail_after(10):
            firsts = [await call.read() for call in calls]
            assert [summary(m) for m in firsts] == [{"gpu-0": protos.health_v1.HEALTHY}] * 2
            assert type(firsts[0]).DESCRIPTOR.full_name == "v1.NodeWatchResourcesResponse"
            assert type(firsts[1]).DESCRIPTOR.full_name == "v1alpha1.NodeWatchResourcesResponse"
            assert firsts[0].devices[0].health_check_timeout_seconds == 60
            await wait_until(lambda: plugin.health.watchers == 2)
            inv.set_health({"gpu-0": XID})
            seconds = [await call.read() for call in calls]
            assert [summary(m) for m in seconds] == [{"gpu-0": protos.health_v1.UNHEALTHY}] * 2
            assert seconds[0].SerializeToString() == seconds[1].SerializeToString()
            for call in calls:
                call.cancel()
    await wait_until(lambda: plugin.health.watchers == 0)


@pytest.mark.parametrize("path", [WATCH_V1, WATCH])
async def test_grpcio_malformed_request_gets_invalid_argument(root: Path, path: str) -> None:
    plugin = make_plugin(root, inventory=inventory(1))
    async with serving(plugin), grpc.aio.insecure_channel(f"unix://{plugin.dra_socket}") as channel:
        call = channel.unary_stream(path, request_serializer=lambda m: m, response_deserializer=bytes)(
            b"\x0a\x05ab"  # field 1, length 5, but only 2 bytes follow
        )
        with anyio.fail_after(10), pytest.raises(grpc.aio.AioRpcError) as err:
            await call.read()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    service = path.split("/")[1]
    assert err.value.details().startswith(f"malformed {service} NodeWatchResourcesRequest")
    assert plugin.health.watchers == 0
