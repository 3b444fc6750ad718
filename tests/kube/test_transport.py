"""The API client's HTTP (`agent.kube.transport`, on aiohttp) against small scripted servers.

Each server here is an anyio TCP listener that reads requests and answers with bytes written by
the test, so framing (RFC 9112: Content-Length, chunked with extensions and trailers, a body
ending with the connection), keep-alive, broken and malformed answers can be shown exactly: what
the agent sees of them through aiohttp, and what our layer adds (the bounds, the resend, the
watch's lines, the errors). The
resend after a stale keep-alive connection follows Go's net/http (src/net/http/transport.go
``shouldRetryRequest`` / ``errServerClosedIdle``, src/net/http/request.go ``isReplayable``): only a
reused connection, only when no byte of the answer came back, only GET/HEAD/OPTIONS/TRACE.
"""

from __future__ import annotations

import json
import socket
import ssl
import struct
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.abc import ByteStream, SocketAttribute
from anyio.streams.buffered import BufferedByteReceiveStream
from anyio.streams.tls import TLSAttribute, TLSListener

from agent.core.errors import KubeApiError
from agent.kube import transport
from agent.kube.client import REQUEST_CONCURRENCY, KubeClient, ServerInfo

CLAIM = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/claim-1"


@dataclass(frozen=True)
class Request:
    line: str
    headers: dict[str, str]
    body: bytes
    connection: int
    """Which connection brought it (1: the server's first)."""


@dataclass(frozen=True)
class Reply:
    data: bytes
    close: bool = False
    """Close the connection after sending `data`."""


Handler = Callable[[Request, ByteStream], Awaitable[Reply | None]]


@dataclass
class Server:
    """Counts connections and requests; `handler` answers (None: close without answering)."""

    handler: Handler
    url: str = ""
    connections: int = 0
    open_now: int = 0
    most_open: int = 0
    requests: list[Request] = field(default_factory=list)
    closed: anyio.Event = field(default_factory=anyio.Event)
    """Set whenever the server has closed a connection."""

    async def serve(self, stream: ByteStream) -> None:
        self.connections += 1
        number = self.connections
        self.open_now += 1
        self.most_open = max(self.most_open, self.open_now)
        reader = BufferedByteReceiveStream(stream)
        try:
            while True:
                head = await reader.receive_until(b"\r\n\r\n", 65536)
                line, *lines = head.decode().split("\r\n")
                headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines)}
                body = await reader.receive_exactly(int(headers.get("content-length", "0")))
                request = Request(line, headers, body, number)
                self.requests.append(request)
                reply = await self.handler(request, stream)
                if reply is None:
                    return
                await stream.send(reply.data)
                if reply.close:
                    return
        except (anyio.IncompleteRead, anyio.EndOfStream, anyio.BrokenResourceError, OSError):
            pass  # the client went away
        finally:
            self.open_now -= 1
            await anyio.aclose_forcefully(stream)
            self.closed.set()
            self.closed = anyio.Event()


@asynccontextmanager
async def serving(handler: Handler, tls: ssl.SSLContext | None = None) -> AsyncIterator[Server]:
    server = Server(handler)
    listener: Any = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(SocketAttribute.local_port)
    if tls is not None:
        listener = TLSListener(listener, tls, standard_compatible=False)
    server.url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, server.serve)
        try:
            yield server
        finally:
            tg.cancel_scope.cancel()


def ok(body: bytes = b'{"kind": "ResourceClaim"}', status: str = "200 OK", extra: str = "") -> Reply:
    return Reply(f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body)


async def answer_ok(request: Request, stream: ByteStream) -> Reply:
    return ok()


def configuration(host: str) -> Any:
    from kubernetes_asyncio.client.configuration import Configuration

    return Configuration(host=host)


def client(url: str, **settings: Any) -> KubeClient:
    cfg = configuration(url)
    for name, value in settings.items():
        setattr(cfg, name, value)
    return KubeClient.from_configuration(cfg, request_timeout=5)


@pytest.fixture(autouse=True)
def no_environment_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)


# ----- framing ---------------------------------------------------------------------------


async def test_content_length_answer_and_the_request_sent() -> None:
    async with serving(answer_ok) as server:
        kube = client(server.url)
        try:
            got = await kube.request("POST", "/api/v1/namespaces/default/events", body={"a": 1})
            await kube.request("GET", "/list", query=[("fieldSelector", "spec.nodeName=n,spec.driver=d")])
        finally:
            await kube.close()
    assert got == {"kind": "ResourceClaim"}
    post, get = server.requests
    assert post.line == "POST /api/v1/namespaces/default/events HTTP/1.1"
    assert post.headers["host"] == server.url.removeprefix("http://")
    assert post.headers["content-type"] == "application/json" and json.loads(post.body) == {"a": 1}
    assert post.headers["content-length"] == str(len(post.body))
    assert get.line == "GET /list?fieldSelector=spec.nodeName%3Dn%2Cspec.driver%3Dd HTTP/1.1"
    assert "content-length" not in get.headers
    assert server.connections == 1  # kept alive


async def test_chunked_answer_with_extensions_and_trailers() -> None:
    async def chunked(request: Request, stream: ByteStream) -> Reply:
        return Reply(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b'5;name=value\r\n{"a":\r\n3\r\n 1}\r\n0;last\r\nX-Trailer: yes\r\nX-Other: 2\r\n\r\n'
        )

    async with serving(chunked) as server:
        kube = client(server.url)
        try:
            assert await kube.request("GET", CLAIM) == {"a": 1}
            assert await kube.request("GET", CLAIM) == {"a": 1}  # the trailers were all read
        finally:
            await kube.close()
    assert server.connections == 1


async def test_body_until_the_connection_closes_is_read_and_the_connection_not_reused() -> None:
    async def close_delimited(request: Request, stream: ByteStream) -> Reply:
        return Reply(b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n{"b": 2}', close=True)

    async with serving(close_delimited) as server:
        kube = client(server.url)
        try:
            assert await kube.request("GET", CLAIM) == {"b": 2}
            assert await kube.request("GET", CLAIM) == {"b": 2}
        finally:
            await kube.close()
    assert server.connections == 2


async def test_connection_close_is_honoured() -> None:
    async def closing(request: Request, stream: ByteStream) -> Reply:
        return ok(extra="Connection: close\r\n")  # the server may keep it open: we must not reuse it

    async with serving(closing) as server:
        kube = client(server.url)
        try:
            for _ in range(3):
                await kube.request("GET", CLAIM)
        finally:
            await kube.close()
    assert server.connections == 3


async def test_interim_answers_are_skipped_and_errors_keep_their_status() -> None:
    async def interim(request: Request, stream: ByteStream) -> Reply:
        body = b'{"reason": "NotFound", "message": "gone"}'
        return Reply(b"HTTP/1.1 100 Continue\r\n\r\n" + ok(body, "404 Not Found").data)

    async with serving(interim) as server:
        kube = client(server.url)
        try:
            with pytest.raises(KubeApiError, match="404 NotFound: gone") as error:
                await kube.request("GET", CLAIM)
        finally:
            await kube.close()
    assert error.value.status == 404


# ----- the pool --------------------------------------------------------------------------


async def test_keep_alive_connections_are_reused() -> None:
    async def slow(request: Request, stream: ByteStream) -> Reply:
        await anyio.sleep(0.01)  # long enough for the three to be in flight at once
        return ok()

    async with serving(slow) as server:
        http = transport.HttpClient(server.url, limit=4, keepalive=60, user_agent="test")
        try:
            async with anyio.create_task_group() as tg:  # opens 3 connections
                for _ in range(3):
                    tg.start_soon(lambda: http.request("GET", "/x", headers={}, timeout=5))
            assert server.connections == 3
            for _ in range(4):  # sequential: on the idle ones (aiohttp takes the oldest first)
                await http.request("GET", "/x", headers={}, timeout=5)
        finally:
            await http.aclose()
    assert len(server.requests) == 7 and server.connections == 3


async def test_idle_connections_expire() -> None:
    async with serving(answer_ok) as server:
        http = transport.HttpClient(server.url, limit=4, keepalive=0, user_agent="test")
        try:
            await http.request("GET", "/x", headers={}, timeout=5)
            await http.request("GET", "/x", headers={}, timeout=5)
        finally:
            await http.aclose()
    assert server.connections == 2


async def test_burst_of_100_with_a_watch_open_uses_at_most_4_connections() -> None:
    """A one-driver agent: its slice watch plus `REQUEST_CONCURRENCY` claim reads at a time."""

    async def slow(request: Request, stream: ByteStream) -> Reply:
        if "watch=true" in request.line:
            await stream.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            await anyio.sleep_forever()
        await anyio.sleep(0.001)  # long enough for the other reads to queue up
        return ok()

    async with serving(slow) as server:
        kube = client(server.url)
        kube._info = ServerInfo(1, 34, "v1.34.0", "v1")
        try:
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    async for _ in kube.watch_resource_slices(
                        node_name="n", driver="d", resource_version="1"
                    ):
                        pass

                tg.start_soon(watch)
                async with anyio.create_task_group() as burst:
                    for _ in range(100):
                        burst.start_soon(kube.get_resource_claim, "default", "claim-1")
                tg.cancel_scope.cancel()
        finally:
            await kube.close()
    assert len(server.requests) == 101
    assert server.connections <= REQUEST_CONCURRENCY + 1


async def test_the_pool_bounds_open_connections() -> None:
    async def slow(request: Request, stream: ByteStream) -> Reply:
        await anyio.sleep(0.001)
        return ok()

    async with serving(slow) as server:
        http = transport.HttpClient(server.url, limit=5, keepalive=60, user_agent="test")
        try:
            async with anyio.create_task_group() as tg:
                for _ in range(100):
                    tg.start_soon(lambda: http.request("GET", "/x", headers={}, timeout=5))
        finally:
            await http.aclose()
    assert len(server.requests) == 100
    assert server.connections <= 5 and server.most_open <= 5


# ----- stale keep-alive connections -----------------------------------------------------


def first_answered_then_dropped() -> Handler:
    """Answers the first request of each connection; a second one is read, then dropped unanswered
    (the server's keep-alive timeout racing the client's reuse)."""
    seen: dict[int, int] = {}

    async def handler(request: Request, stream: ByteStream) -> Reply | None:
        key = id(stream)
        seen[key] = seen.get(key, 0) + 1
        return ok() if seen[key] == 1 else None

    return handler


async def test_get_on_a_stale_keep_alive_connection_is_resent_once_on_a_fresh_one() -> None:
    async with serving(first_answered_then_dropped()) as server:
        kube = client(server.url)
        try:
            await kube.request("GET", CLAIM)
            assert await kube.request("GET", CLAIM) == {"kind": "ResourceClaim"}
        finally:
            await kube.close()
    assert len(server.requests) == 3 and server.connections == 2


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE"])
async def test_non_replayable_request_on_a_stale_connection_is_not_resent(method: str) -> None:
    """Go resends only GET/HEAD/OPTIONS/TRACE (the server may have acted on the request)."""
    async with serving(first_answered_then_dropped()) as server:
        kube = client(server.url)
        try:
            await kube.request("GET", CLAIM)
            with pytest.raises(KubeApiError, match=f"{method} /x: API server unreachable") as error:
                await kube.request(method, "/x", body={})
        finally:
            await kube.close()
    assert error.value.status == 0
    assert len(server.requests) == 2 and server.connections == 1


async def test_a_fresh_connection_dropped_unanswered_is_not_resent() -> None:
    async def drop(request: Request, stream: ByteStream) -> None:
        return None

    async with serving(drop) as server:
        kube = client(server.url)
        try:
            with pytest.raises(KubeApiError, match="API server unreachable") as error:
                await kube.request("GET", CLAIM)
        finally:
            await kube.close()
    assert error.value.status == 0 and len(server.requests) == 1


async def test_idle_connection_closed_by_the_server_is_not_used_for_a_post() -> None:
    async def answer_then_close(request: Request, stream: ByteStream) -> Reply:
        return Reply(ok().data, close=True)  # no "Connection: close": the client learns it from the socket

    async with serving(answer_then_close) as server:
        kube = client(server.url)
        try:
            closed = server.closed
            await kube.request("GET", CLAIM)
            await closed.wait()  # the server closed the idle connection (without saying so)
            await anyio.wait_all_tasks_blocked()  # the client's event loop reads the end of the connection
            await kube.request("POST", "/x", body={})
        finally:
            await kube.close()
    assert len(server.requests) == 2 and server.connections == 2


# ----- failures ----------------------------------------------------------------------------


async def test_server_closing_mid_body_is_connection_lost() -> None:
    async def partial(request: Request, stream: ByteStream) -> Reply:
        return Reply(b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"a":', close=True)

    async def partial_chunk(request: Request, stream: ByteStream) -> Reply:
        return Reply(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n10\r\n{", close=True)

    for handler in (partial, partial_chunk):
        async with serving(handler) as server:
            kube = client(server.url)
            try:
                with pytest.raises(KubeApiError, match=f"GET {CLAIM}: API server connection lost") as error:
                    await kube.request("GET", CLAIM)
            finally:
                await kube.close()
        assert error.value.status == 0


async def test_no_answer_within_the_timeout() -> None:
    async def never(request: Request, stream: ByteStream) -> Reply:
        await anyio.sleep_forever()
        raise AssertionError

    async def stalls_mid_body(request: Request, stream: ByteStream) -> Reply:
        await stream.send(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{")
        await anyio.sleep_forever()
        raise AssertionError

    for handler, what in (
        (never, "unreachable: TimeoutError"),
        (stalls_mid_body, "connection lost: TimeoutError"),
    ):
        async with serving(handler) as server:
            kube = KubeClient.from_configuration(configuration(server.url), request_timeout=0.2)
            try:
                with pytest.raises(KubeApiError, match=f"API server {what}") as error:
                    await kube.request("GET", CLAIM)
            finally:
                await kube.close()
        assert error.value.status == 0


async def test_a_reset_mid_body_is_connection_lost_naming_the_reset() -> None:
    """The server resets the connection (RST, not FIN) half-way through the body: the error says so."""

    async def reset(request: Request, stream: ByteStream) -> Reply | None:
        await stream.send(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{")
        raw = stream.extra(SocketAttribute.raw_socket)
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
        return None

    async with serving(reset) as server:
        kube = client(server.url)
        try:
            lost = "API server connection lost: the body did not arrive whole: .*ConnectionResetError"
            with pytest.raises(KubeApiError, match=lost) as error:
                await kube.request("GET", CLAIM)
        finally:
            await kube.close()
    assert error.value.status == 0


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (b"HTTP/1.1 2OO OK\r\n\r\n", "Bad status line: Invalid status code: b'HTTP/1.1 2OO OK'$"),
        (b"ICY 200 OK\r\n\r\n", "Bad status line: Expected HTTP/"),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "Invalid header token"),
        (b"HTTP/1.1 200 OK\r\nBad Name: x\r\n\r\n", "Invalid header token"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "Invalid character in Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2, 3\r\n\r\n{}", "Invalid character in Content-Length"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "Invalid character in chunk size"),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}XX0\r\n\r\n",
            "Expected LF after chunk",
        ),
        (b"HTTP/1.1 200 OK\r\nX: " + b"y" * 70000 + b"\r\n\r\n", "Got more than 8190 bytes"),
    ],
)
async def test_malformed_answers_are_refused(answer: bytes, message: str) -> None:
    async def malformed(request: Request, stream: ByteStream) -> Reply:
        return Reply(answer, close=True)

    async with serving(malformed) as server:
        kube = client(server.url)
        try:
            with pytest.raises(KubeApiError, match=f"API server answer malformed: {message}") as error:
                await kube.request("GET", CLAIM)
        finally:
            await kube.close()
    assert error.value.status == 0


async def test_bodies_over_the_cap_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transport, "MAX_BODY_BYTES", 10)
    answers = [
        ok(b"x" * 11).data,
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n6\r\nxxxxxx\r\n6\r\nxxxxxx\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * 11,
    ]
    for answer in answers:

        async def large(request: Request, stream: ByteStream, answer: bytes = answer) -> Reply:
            return Reply(answer, close=True)

        async with serving(large) as server:
            kube = client(server.url)
            try:
                with pytest.raises(KubeApiError, match="API server answer too large"):
                    await kube.request("GET", CLAIM)
            finally:
                await kube.close()


async def test_a_token_with_a_line_break_is_not_sent() -> None:
    async with serving(answer_ok) as server:
        cfg = configuration(server.url)
        cfg.api_key["BearerToken"] = "Bearer x\r\nX-Injected: 1"
        kube = KubeClient.from_configuration(cfg)
        try:
            with pytest.raises(KubeApiError, match="holds a line break"):
                await kube.request("GET", CLAIM)
        finally:
            await kube.close()
    assert server.requests == []


# ----- the watch ---------------------------------------------------------------------------


def watch_client(url: str) -> KubeClient:
    kube = client(url)
    kube._info = ServerInfo(1, 34, "v1.34.0", "v1")
    return kube


def event(kind: str, name: str, version: str) -> bytes:
    obj = {"metadata": {"name": name, "resourceVersion": version}}
    return json.dumps({"type": kind, "object": obj}).encode() + b"\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def test_watch_events_split_across_chunks_arrive_as_they_come() -> None:
    first, second, third = event("ADDED", "a", "1"), event("MODIFIED", "a", "2"), event("DELETED", "a", "3")
    sent_rest = anyio.Event()
    got_first = anyio.Event()

    async def watch(request: Request, stream: ByteStream) -> Reply:
        await stream.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await stream.send(chunk(first[:10]) + chunk(first[10:]))
        await got_first.wait()  # the first event is delivered before the rest is even sent
        await stream.send(chunk(second + third[:5]) + chunk(third[5:]) + b"0\r\n\r\n")
        sent_rest.set()
        return Reply(b"")

    async with serving(watch) as server:
        kube = watch_client(server.url)
        try:
            events = []
            async for item in kube.watch_resource_slices(node_name="n", driver="d", resource_version="0"):
                events.append((item.type, item.resource_version))
                got_first.set()
            assert sent_rest.is_set()
            await kube.request("GET", CLAIM)  # the ended watch's connection is reused
        finally:
            await kube.close()
    assert events == [("ADDED", "1"), ("MODIFIED", "2"), ("DELETED", "3")]
    assert "watch=true" in server.requests[0].line and "resourceVersion=0" in server.requests[0].line
    assert server.connections == 1


async def test_watch_cut_mid_chunk_is_connection_lost_and_errors_keep_their_status() -> None:
    async def cut(request: Request, stream: ByteStream) -> Reply:
        return Reply(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk(event("ADDED", "a", "1"))[:20],
            True,
        )

    async def gone(request: Request, stream: ByteStream) -> Reply:
        return ok(b'{"reason": "Expired", "message": "too old"}', "410 Gone")

    async with serving(cut) as server:
        kube = watch_client(server.url)
        try:
            with pytest.raises(KubeApiError, match=r"WATCH .*/resourceslices: connection lost") as error:
                async for _ in kube.watch_resource_slices(node_name="n", driver="d", resource_version="0"):
                    pass
        finally:
            await kube.close()
    assert error.value.status == 0
    async with serving(gone) as server:
        kube = watch_client(server.url)
        try:
            with pytest.raises(KubeApiError, match="410 Expired: too old") as error:
                async for _ in kube.watch_resource_slices(node_name="n", driver="d", resource_version="0"):
                    pass
        finally:
            await kube.close()
    assert error.value.status == 410


async def test_streaming_read_idle_timeout() -> None:
    """The watch's read-idle limit (its timeoutSeconds + 30 s in KubeClient), here 0.2 s."""

    async def silent(request: Request, stream: ByteStream) -> Reply:
        await stream.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk(b"{}\n"))
        await anyio.sleep_forever()
        raise AssertionError

    async with serving(silent) as server:
        http = transport.HttpClient(server.url, limit=4, keepalive=60, user_agent="test")
        try:
            async with http.stream("GET", "/w", headers={}, connect_timeout=5, read_timeout=0.2) as answer:
                lines = answer.lines()
                assert await anext(lines) == b"{}"
                with pytest.raises(transport.HttpError, match="connection lost: SocketTimeoutError"):
                    await anext(lines)
        finally:
            await http.aclose()


async def test_a_large_request_body_arrives_whole() -> None:
    body = bytes(range(256)) * (8 * 1024 * 4)  # 8 MiB: over the socket's buffers

    async def count(request: Request, stream: ByteStream) -> Reply:
        return ok(b'{"size": %d}' % len(request.body))

    async with serving(count) as server:
        http = transport.HttpClient(server.url, limit=1, keepalive=60, user_agent="test")
        try:
            answer = await http.request("PUT", "/big", headers={}, body=body, timeout=20)
        finally:
            await http.aclose()
    assert json.loads(answer.body) == {"size": len(body)}
    assert server.requests[0].body == body


# ----- TLS and proxies -------------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def server_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(self.ca))
        context.load_cert_chain(self.server_cert, self.server_key)
        context.verify_mode = ssl.CERT_REQUIRED  # the API server asks for the client certificate
        return context


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A CA, a server certificate for ``api.test`` only (not 127.0.0.1) and a client certificate."""
    root = tmp_path_factory.mktemp("pki")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=root, check=True, capture_output=True, timeout=60)

    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.crt", "-subj", "/CN=test-ca", "-days", "2")
    for name, extensions in (
        ("server", "subjectAltName=DNS:api.test\nextendedKeyUsage=serverAuth\n"),
        ("client", "extendedKeyUsage=clientAuth\n"),
    ):
        (root / f"{name}.ext").write_text("basicConstraints=CA:FALSE\n" + extensions)
        openssl("req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}-dra")
        openssl(
            "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext",
        )  # fmt: skip
    return Pki(*(root / f for f in ("ca.crt", "server.crt", "server.key", "client.crt", "client.key")))


def tls_client(url: str, pki: Pki, **settings: Any) -> KubeClient:
    return client(
        url, ssl_ca_cert=str(pki.ca), cert_file=str(pki.client_cert), key_file=str(pki.client_key), **settings
    )


async def answer_with_the_peer(request: Request, stream: ByteStream) -> Reply:
    certificate: Any = stream.extra(TLSAttribute.peer_certificate)
    subject = dict(item[0] for item in certificate["subject"])
    return ok(json.dumps({"client": subject["commonName"]}).encode())


async def test_tls_with_a_client_certificate_and_the_server_name_override(pki: Pki) -> None:
    async with serving(answer_with_the_peer, tls=pki.server_context()) as server:
        kube = tls_client(server.url, pki, tls_server_name="api.test")
        try:
            assert await kube.request("GET", CLAIM) == {"client": "client-dra"}
            assert await kube.request("GET", CLAIM) == {"client": "client-dra"}
        finally:
            await kube.close()
        assert server.connections == 1
        # Without the override the certificate (for api.test) does not match 127.0.0.1.
        kube = tls_client(server.url, pki)
        try:
            refused = "unreachable: TLS: the API server's certificate was refused: .*SSLCertVerificationError"
            with pytest.raises(KubeApiError, match=refused) as error:
                await kube.request("GET", CLAIM)
        finally:
            await kube.close()
        assert error.value.status == 0


async def test_http_target_through_a_proxy_uses_the_absolute_form() -> None:
    async with serving(answer_ok) as proxy:
        kube = client(
            "http://api.test:8080",
            proxy=proxy.url.replace("://", "://user:p%40ss@"),
            proxy_headers={"X-Via": "1"},
        )
        try:
            await kube.request("GET", CLAIM)
            await kube.request("GET", CLAIM)
        finally:
            await kube.close()
    request = proxy.requests[0]
    assert request.line == f"GET http://api.test:8080{CLAIM} HTTP/1.1"
    assert request.headers["host"] == "api.test:8080"
    assert request.headers["proxy-authorization"] == "Basic dXNlcjpwQHNz"  # user:p@ss
    assert proxy.connections == 1


async def test_the_proxy_from_the_environment_and_no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """``HTTP_PROXY`` as aiohttp reads it (``trust_env``'s lookup); ``NO_PROXY`` hosts: directly."""
    async with serving(answer_ok) as proxy, serving(answer_ok) as server:
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        for target in ("http://api.test:8080", server.url):
            if target == server.url:
                monkeypatch.setenv("NO_PROXY", "127.0.0.1")
            kube = client(target)
            try:
                await kube.request("GET", CLAIM)
            finally:
                await kube.close()
    assert [r.line for r in proxy.requests] == [f"GET http://api.test:8080{CLAIM} HTTP/1.1"]
    assert [r.line for r in server.requests] == [f"GET {CLAIM} HTTP/1.1"]


def tunnel(target_port: int, refuse: bool = False) -> Handler:
    """A CONNECT proxy to 127.0.0.1:`target_port` only (RFC 9110 9.3.6)."""

    async def handler(request: Request, stream: ByteStream) -> None:
        if refuse or request.line != f"CONNECT 127.0.0.1:{target_port} HTTP/1.1":
            await stream.send(b"HTTP/1.1 407 Proxy Authentication Required\r\nContent-Length: 0\r\n\r\n")
            return None
        upstream = await anyio.connect_tcp("127.0.0.1", target_port)
        await stream.send(b"HTTP/1.1 200 Connection established\r\n\r\n")

        async def pipe(source: ByteStream, sink: ByteStream) -> None:
            try:
                async for data in source:
                    await sink.send(data)
            except (anyio.BrokenResourceError, OSError):
                pass
            tg.cancel_scope.cancel()

        async with upstream, anyio.create_task_group() as tg:
            tg.start_soon(pipe, stream, upstream)
            tg.start_soon(pipe, upstream, stream)
        return None

    return handler


async def test_https_target_through_a_connect_tunnel(pki: Pki) -> None:
    async with serving(answer_with_the_peer, tls=pki.server_context()) as server:
        port = int(server.url.rsplit(":", 1)[1])
        async with serving(tunnel(port)) as proxy:
            kube = tls_client(server.url, pki, tls_server_name="api.test", proxy=proxy.url)
            try:
                assert await kube.request("GET", CLAIM) == {"client": "client-dra"}
                assert await kube.request("GET", CLAIM) == {"client": "client-dra"}
            finally:
                await kube.close()
        assert proxy.connections == 1 and server.connections == 1
        async with serving(tunnel(port, refuse=True)) as proxy:
            kube = tls_client(server.url, pki, tls_server_name="api.test", proxy=proxy.url)
            try:
                with pytest.raises(KubeApiError, match="unreachable: the proxy refused the request: 407"):
                    await kube.request("GET", CLAIM)
            finally:
                await kube.close()


def test_only_http_proxies() -> None:
    with pytest.raises(KubeApiError, match="only http:// and https:// proxies"):
        client("https://10.0.0.1", proxy="socks5://proxy:1080")


async def test_a_client_certificate_the_server_refuses_says_tls(pki: Pki) -> None:
    """The API server asks for a client certificate and the kubeconfig has none."""
    async with serving(answer_with_the_peer, tls=pki.server_context()) as server:
        kube = client(server.url, ssl_ca_cert=str(pki.ca), tls_server_name="api.test")
        try:
            with pytest.raises(KubeApiError, match="check the kubeconfig's client-certificate") as error:
                await kube.request("GET", CLAIM)
        finally:
            await kube.close()
    assert error.value.status == 0


async def test_an_https_url_to_a_plain_http_server_says_the_handshake_failed(pki: Pki) -> None:
    async def plain(stream: ByteStream) -> None:  # answers the TLS ClientHello in plain HTTP
        async with stream:
            await stream.send(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    url = f"https://127.0.0.1:{listener.extra(SocketAttribute.local_port)}"
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, plain)
        kube = client(url, ssl_ca_cert=str(pki.ca))
        try:
            with pytest.raises(
                KubeApiError, match=r"unreachable: TLS handshake failed: .*certificate-authority"
            ):
                await kube.request("GET", CLAIM)
        finally:
            await kube.close()
            tg.cancel_scope.cancel()
