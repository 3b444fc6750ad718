"""The control socket: a round trip per op, bad input answered with an error, the server keeps going."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import pytest

from backends.fake.backend import FakeBackend
from backends.fake.control import ControlError, request, unlink_socket
from backends.fake.faults import FaultInjector
from tests.fake.helpers import Collector, exists, make_backends, read_text, short_socket_path, write_text


async def wait_for_socket(path: str) -> None:
    """Wait until the server accepts connections (the file appears at bind, before listen)."""
    for _ in range(1000):
        if exists(path):
            try:
                stream = await anyio.connect_unix(path)
            except OSError:
                pass
            else:
                await stream.aclose()
                return
        await anyio.sleep(0.005)
    raise AssertionError(f"{path} never accepted a connection")


async def raw(path: str, data: bytes) -> list[dict[str, object]]:
    """Send raw bytes, then read replies until the server closes or goes quiet."""
    stream = await anyio.connect_unix(path)
    replies: list[dict[str, object]] = []
    async with stream:
        await stream.send(data)
        await stream.send_eof()
        buffer = b""
        with anyio.move_on_after(2):
            while True:
                try:
                    buffer += await stream.receive()
                except anyio.EndOfStream:
                    break
    for line in buffer.splitlines():
        replies.append(json.loads(line))
    return replies


class Running:
    def __init__(
        self, backends: list[FakeBackend], injector: FaultInjector, path: str, sink: Collector
    ) -> None:
        self.backends, self.injector, self.path, self.sink = backends, injector, path, sink


@asynccontextmanager
async def serving() -> AsyncIterator[Running]:
    """The mixed profile's backends with their health monitors and control socket running."""
    path = short_socket_path()
    backends, injector = make_backends(control=path)
    sink = Collector()
    async with anyio.create_task_group() as tg:
        for backend in backends:
            tg.start_soon(backend.monitor_health, sink)
        await wait_for_socket(path)
        yield Running(backends, injector, path, sink)
        tg.cancel_scope.cancel()
    for backend in backends:
        await backend.stop()
    assert not exists(path)  # removed on the way out


async def test_round_trip() -> None:
    async with serving() as running:
        path = running.path
        assert await request(path, {"op": "inject", "device": "gpu-3", "condition": "xid", "value": 79}) == [
            "gpu.nvidia.com/gpu-3"
        ]
        assert await request(
            path, {"op": "inject", "device": "gpu-1-128", "condition": "ring-hang", "severity": "warning"}
        ) == ["gpu.amd.com/gpu-1-128"]
        rows = await request(path, {"op": "list"})
        faulty = {(r["driver"], r["device"]): r["faults"] for r in rows if r["faults"]}
        assert faulty[("gpu.nvidia.com", "gpu-3")][0]["value"] == "79"
        assert faulty[("gpu.amd.com", "gpu-1-128")][0]["severity"] == "warning"
        assert len(rows) == 8
        assert await request(path, {"op": "lose", "device": "gpu-2"}) == ["gpu.nvidia.com/gpu-2"]
        assert await request(path, {"op": "recover", "device": "gpu-3", "condition": "xid"}) == [
            "gpu.nvidia.com/gpu-3"
        ]
        assert await request(path, {"op": "recover", "device": "gpu-2"}) == ["gpu.nvidia.com/gpu-2"]
        await anyio.wait_all_tasks_blocked()
        assert [(d, c, v, cl) for d, c, v, cl in running.sink.conditions()] == [
            ("gpu-3", "xid", "79", False),
            ("gpu-1-128", "ring-hang", "", False),
            ("gpu-2", "gpu-lost", "", False),
            ("gpu-3", "xid", "79", True),
            ("gpu-2", "gpu-lost", "", True),
        ]


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        ({"op": "inject", "device": "gpu-9", "condition": "xid"}, "no device 'gpu-9' on any fake driver"),
        ({"op": "inject", "device": "gpu-0"}, "field 'condition' is required"),
        ({"op": "inject", "device": "gpu-0", "condition": "xid", "severity": "fatal"}, "bad inject request"),
        ({"op": "inject", "device": "gpu-0", "condition": "xid", "kind": "forever"}, "bad inject request"),
        ({"op": "inject", "device": ["gpu-0"], "condition": "xid"}, "field 'device' must be a string"),
        ({"op": "reboot"}, "unknown op 'reboot'"),
        ({"op": "scenario", "scenario": {"steps": []}}, "scenario request: steps"),
    ],
)
async def test_bad_requests_get_an_error_and_the_server_goes_on(
    payload: dict[str, object], error: str
) -> None:
    async with serving() as running:
        with pytest.raises(ControlError, match=error.replace("(", r"\(").replace("[", r"\[")):
            await request(running.path, payload)
        assert await request(running.path, {"op": "inject", "device": "gpu-0", "condition": "xid"}) == [
            "gpu.nvidia.com/gpu-0"
        ]


async def test_malformed_input() -> None:
    async with serving() as running:
        replies = await raw(running.path, b'{not json\n[1, 2]\n\n{"op": "list"}\n\xff\xfe\n')
        assert [r["ok"] for r in replies] == [False, False, True, False]
        assert "malformed request" in str(replies[0]["error"])
        assert "one JSON object per line" in str(replies[1]["error"])
        assert "malformed request" in str(replies[3]["error"])
        assert await request(running.path, {"op": "list"})


async def test_oversized_request_is_refused() -> None:
    async with serving() as running:
        replies = await raw(running.path, b"x" * (1 << 20 | 10))
        assert replies and "request longer than" in str(replies[0]["error"])
        assert await request(running.path, {"op": "list"})


async def test_client_that_goes_away() -> None:
    async with serving() as running:
        stream = await anyio.connect_unix(running.path)
        await stream.send(b'{"op": "list"}\n')
        await stream.aclose()
        await anyio.sleep(0.01)
        assert await request(running.path, {"op": "list"})


async def test_scenario_through_the_socket() -> None:
    async with serving() as running:
        scenario = {
            "steps": [
                {"at": 0, "inject": {"device": "gpu-0", "condition": "xid", "value": 48}},
                {
                    "at": 0,
                    "storm": {
                        "device": "gpu-1",
                        "condition": "xid",
                        "value": 79,
                        "rate": 2000,
                        "duration": 0.01,
                    },
                },
                {"at": 0.02, "inject": {"device": "gpu-99", "condition": "xid"}},
            ]
        }
        result = await request(running.path, {"op": "scenario", "scenario": scenario}, wait=10)
        assert result["events"] == 21
        assert result["actions"] == 2
        assert len(result["errors"]) == 1 and "gpu-99" in result["errors"][0]


async def test_no_server() -> None:
    path = short_socket_path()
    with pytest.raises(ControlError, match="cannot reach the fake backend's control socket"):
        await request(path, {"op": "list"})


async def test_socket_in_use_is_not_stolen() -> None:
    path = short_socket_path()
    (first, _), _ = make_backends(control=path)
    (second, _), _ = make_backends(control=path)
    sink = Collector()
    async with anyio.create_task_group() as tg:
        tg.start_soon(first.monitor_health, sink)
        await wait_for_socket(path)
        # The second agent logs the problem; its health monitoring goes on without a socket.
        tg.start_soon(second.monitor_health, sink)
        await anyio.sleep(0.05)
        second.injector.inject_now("gpu-0", "xid", "31")
        assert await request(path, {"op": "inject", "device": "gpu-1", "condition": "xid"})
        await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    assert sorted(e.device for e in sink.events) == ["gpu-0", "gpu-1"]


async def test_stale_socket_file_is_replaced() -> None:
    path = short_socket_path()
    listener = await anyio.create_unix_listener(path)
    await listener.aclose()  # leaves the file behind, as a crashed agent would
    assert exists(path)
    (backend, _), _ = make_backends(control=path)
    async with anyio.create_task_group() as tg:
        tg.start_soon(backend.monitor_health, Collector())
        await anyio.sleep(0.05)
        assert await request(path, {"op": "list"})
        tg.cancel_scope.cancel()
    assert not exists(path)


async def test_path_that_is_not_a_socket(caplog: pytest.LogCaptureFixture) -> None:
    path = short_socket_path()
    write_text(path, "not a socket")
    (backend, _), injector = make_backends(control=path)
    sink = Collector()
    async with anyio.create_task_group() as tg:
        tg.start_soon(backend.monitor_health, sink)
        await anyio.sleep(0.05)
        injector.inject_now("gpu-0", "xid", "31")
        await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    assert [e.device for e in sink.events] == ["gpu-0"]
    errors = [getattr(r, "fields", {}).get("error", "") for r in caplog.records]
    assert any("exists and is not a socket" in str(e) for e in errors)
    unlink_socket(path)  # a regular file is left alone
    assert read_text(path) == "not a socket"


async def test_serving_moves_to_another_backend_when_the_first_stops() -> None:
    path = short_socket_path()
    (nvidia, amd), _ = make_backends(control=path)
    sink = Collector()
    async with anyio.create_task_group() as outer:
        first = anyio.CancelScope()

        async def run_first() -> None:
            with first:
                await nvidia.monitor_health(sink)

        outer.start_soon(run_first)
        await wait_for_socket(path)
        outer.start_soon(amd.monitor_health, sink)
        await anyio.sleep(0.01)
        first.cancel()
        await anyio.sleep(0.05)
        await wait_for_socket(path)
        assert await request(path, {"op": "inject", "device": "gpu-2-129", "condition": "gpu-reset"})
        outer.cancel_scope.cancel()
    assert [e.device for e in sink.events] == ["gpu-2-129"]


async def test_concurrent_clients() -> None:
    async with serving() as running:
        results: list[object] = []

        async def one(i: int) -> None:
            results.append(
                await request(running.path, {"op": "inject", "device": f"gpu-{i % 4}", "condition": "xid"})
            )

        async with anyio.create_task_group() as tg:
            for i in range(40):
                tg.start_soon(one, i)
        assert len(results) == 40
        await anyio.wait_all_tasks_blocked()
        assert len(running.sink.events) == 40


class BrokenTarget:
    """A target whose listing fails as a bug would."""

    async def inject(self, *args: object, **kwargs: object) -> list[str]:
        return ["x/y"]

    async def recover(self, *args: object, **kwargs: object) -> list[str]:
        return []

    async def lose(self, *args: object, **kwargs: object) -> list[str]:
        return []

    def snapshot(self) -> list[dict[str, object]]:
        raise RuntimeError("boom")


async def test_a_bug_in_a_handler_is_answered_and_the_server_goes_on() -> None:
    from agent.core.clock import SystemClock
    from backends.fake.control import serve_control

    path = short_socket_path()
    async with anyio.create_task_group() as tg:
        tg.start_soon(serve_control, BrokenTarget(), path, SystemClock())
        await wait_for_socket(path)
        with pytest.raises(ControlError, match="internal error in the fake backend: RuntimeError: boom"):
            await request(path, {"op": "list"})
        assert await request(path, {"op": "inject", "device": "d", "condition": "xid"}) == ["x/y"]
        tg.cancel_scope.cancel()
