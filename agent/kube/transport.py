"""The API client's HTTP/1.1 transport: asyncio protocol callbacks and one bounded keep-alive pool.

Why not aiohttp: importing it costs ~110 ms (its connector builds default SSL contexts at
import), which the kubelet's first prepare after a restart waited for, and its request path
spends more CPU per request than the rest of a claim read. The agent needs little of HTTP: JSON
requests with a Content-Length body; answers delimited by Content-Length, chunked transfer coding
or the end of the connection; one streaming answer (the slice watch); TLS with the kubeconfig's
`ssl.SSLContext`; an HTTP proxy (absolute-form request targets for http, a CONNECT tunnel for
https).

Connections: at most `limit` open at once (idle ones included: a new one is opened only when none
is idle), idle ones reused last-in first-out and closed once idle for `keepalive` seconds (checked
whenever the pool is used, no timer task). A request on a reused connection that the server had
closed (not a byte of an answer came back) is sent once more on a fresh connection where Go's
net/http would resend it (`shouldRetryRequest` in src/net/http/transport.go: a reused connection,
nothing of the answer read, a replayable request: GET, HEAD, OPTIONS or TRACE).
"""

from __future__ import annotations

import asyncio
import select
import socket
import ssl
import time
from base64 import b64encode
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, asynccontextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn, cast
from urllib.parse import quote, unquote, urlencode, urlsplit

import anyio

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

MAX_HEAD_BYTES = 64 * 1024
"""Status line and headers (and chunked trailers) of one answer; the API server sends ~300 bytes."""
MAX_BODY_BYTES = 64 * 1024 * 1024
"""An answer read whole (not the watch stream); an object is at most ~1.5 MB (etcd's limit)."""
REPLAYABLE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
"""What Go's net/http resends after a stale keep-alive connection (`Request.isReplayable`)."""
_CHUNK_LINE_BYTES = 4096
_HEX_DIGITS = frozenset(b"0123456789abcdefABCDEF")
# Not an answer: the connection failed (anyio's errors, OSError, ssl.SSLError, TimeoutError).
_STREAM_ERRORS = (
    OSError,
    anyio.EndOfStream,
    anyio.IncompleteRead,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
)


class HttpError(Exception):
    """An exchange without a (complete, well-formed) answer; `what` says how far it got.

    ``unreachable``: no answer (connect, TLS, proxy, sending, the status line); ``connection lost``:
    the body did not arrive; ``answer malformed`` / ``answer too large``: refused; ``not
    contacted``: the request could not be written (a header with a line break).
    """

    def __init__(self, what: str, detail: str) -> None:
        super().__init__(f"{what}: {detail}")
        self.what = what
        self.detail = detail


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _limit(seconds: float | None) -> AbstractContextManager[object]:
    return anyio.fail_after(seconds) if seconds is not None else nullcontext()


@dataclass(frozen=True)
class Answer:
    """A complete answer: status, headers (lower-case names) and body."""

    status: int
    headers: Mapping[str, str]
    body: bytes


@dataclass(frozen=True)
class _Head:
    status: int
    headers: dict[str, str]
    keep_alive: bool
    chunked: bool
    length: int | None
    """The body's length; None: chunked, or until the server closes the connection."""


_READ_AHEAD_BYTES = 256 * 1024
"""Bytes buffered while nobody reads (a watch between parts) before the socket stops being read."""


class _Connection(asyncio.Protocol):
    """One connection, read through asyncio's protocol callbacks into a buffer.

    Why not anyio's byte streams: each of their sends and receives yields to the event loop once
    more and a receive stops and restarts reading the socket (two system calls): ~25 µs of CPU of
    a claim read's ~95 (`benchmarks.kube_client_bench`). Here a read that finds its bytes buffered
    does not yield at all, and a claim read waits once, for the answer. The receive methods keep
    the semantics of anyio's `BufferedByteReceiveStream` (and its exceptions), which the framing
    code below uses.
    """

    def __init__(self, tls: bool) -> None:
        self.tls = tls
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.fd = -1
        self.reused = False
        self.idle_since = 0.0
        self._eof = False
        self._lost: Exception | None = None
        self._reading_paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._drained: asyncio.Future[None] | None = None

    # ----- asyncio's callbacks ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast("asyncio.Transport", transport)  # (uvloop's is not a subclass)
        raw = transport.get_extra_info("socket")
        self.fd = raw.fileno() if raw is not None else -1

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self._waiter is None and len(self.buffer) > _READ_AHEAD_BYTES and self.transport is not None:
            self.transport.pause_reading()  # resumed by the next read that waits
            self._reading_paused = True
        self._wake()

    def eof_received(self) -> None:
        self._eof = True
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self._eof = True
        self._lost = exc
        self._wake()
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def pause_writing(self) -> None:
        self._drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._drained = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # ----- the byte stream ----------------------------------------------------------------------

    async def send(self, data: bytes) -> None:
        if self._eof or self.transport is None or self.transport.is_closing():
            self._raise_closed(anyio.BrokenResourceError)
        self.transport.write(data)
        if self._drained is not None:  # over the transport's high-water mark: wait until it drains
            await self._drained
            if self._lost is not None or self.transport.is_closing():
                self._raise_closed(anyio.BrokenResourceError)

    async def receive(self, max_bytes: int = 65536) -> bytes:
        """Some bytes (at most `max_bytes`); raises `anyio.EndOfStream` at the end."""
        while not self.buffer:
            if self._eof:
                self._raise_closed(anyio.EndOfStream)
            await self._wait()
        data = bytes(self.buffer[:max_bytes])
        del self.buffer[:max_bytes]
        return data

    async def receive_exactly(self, nbytes: int) -> bytes:
        """Exactly `nbytes`; raises `anyio.IncompleteRead` if the connection ends first."""
        while len(self.buffer) < nbytes:
            if self._eof:
                self._raise_closed(anyio.IncompleteRead)
            await self._wait()
        data = bytes(self.buffer[:nbytes])
        del self.buffer[:nbytes]
        return data

    async def receive_until(self, delimiter: bytes, max_bytes: int) -> bytes:
        """The bytes before `delimiter` (which is consumed); `anyio.DelimiterNotFound` past `max_bytes`."""
        start = 0
        while True:
            index = self.buffer.find(delimiter, start, max_bytes + len(delimiter))
            if index >= 0:
                data = bytes(self.buffer[:index])
                del self.buffer[: index + len(delimiter)]
                return data
            if len(self.buffer) >= max_bytes:
                raise anyio.DelimiterNotFound(max_bytes)
            if self._eof:
                self._raise_closed(anyio.IncompleteRead)
            start = max(len(self.buffer) - len(delimiter) + 1, 0)
            await self._wait()

    async def _wait(self) -> None:
        if self._reading_paused and self.transport is not None:
            self._reading_paused = False
            self.transport.resume_reading()
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _raise_closed(self, kind: type[Exception]) -> NoReturn:
        if isinstance(self._lost, OSError):  # the connection failed (reset, TLS error): say how
            raise self._lost
        raise kind from self._lost

    # ----- the pool's view ----------------------------------------------------------------------

    def peer_closed(self) -> bool:
        """Whether the server closed this idle connection already (one poll, no wait).

        Checked before a reuse, as aiohttp did: otherwise a POST on a connection the server timed
        out would fail, since it may not be resent.
        """
        if self.buffer or self._eof:  # bytes nobody asked for (out of step), or closed
            return True
        if self.fd < 0 or not select.select([self.fd], [], [], 0)[0]:
            return False  # nothing to read: open (the common case)
        if not self.tls:
            return True  # an end of file, or bytes nobody asked for
        # TLS: a session ticket may be waiting; only an end of file means closed. asyncio hands out
        # a socket wrapper without recv(): peek through a view of the file descriptor (detached
        # again, so it is not closed).
        view = socket.socket(fileno=self.fd)
        try:
            return view.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True
        finally:
            view.detach()

    def close(self) -> None:
        """Close at once (HTTP frames its own messages: no TLS close_notify is waited for)."""
        if self.transport is not None:
            self.transport.abort()


class StreamingAnswer:
    """An answer whose body is read as it arrives (the watch); at most `read_timeout` between parts."""

    def __init__(self, connection: _Connection, head: _Head, read_timeout: float) -> None:
        self.status = head.status
        self.headers: Mapping[str, str] = head.headers
        self._connection = connection
        self._head = head
        self._read_timeout = read_timeout
        self._remaining = head.length
        self.complete = False
        """The whole body was read: the connection may serve another request."""

    async def next_part(self) -> bytes | None:
        """The next part of the body as it arrives (a chunk); None at its end."""
        try:
            with anyio.fail_after(self._read_timeout):
                part = await self._read_part()
        except _STREAM_ERRORS as error:
            raise HttpError("connection lost", _describe(error)) from error
        self.complete = part is None
        return part

    async def read(self) -> bytes:
        """The whole body, instead of `next_part` (at most `MAX_BODY_BYTES`)."""
        try:
            with anyio.fail_after(self._read_timeout):
                body = await _read_body(self._connection, self._head)
        except _STREAM_ERRORS as error:
            raise HttpError("connection lost", _describe(error)) from error
        self.complete = True
        return body

    async def _read_part(self) -> bytes | None:
        reader = self._connection
        if self._head.chunked:
            return await _read_chunk(reader)
        if self._remaining == 0:
            return None
        try:
            part = await reader.receive(min(self._remaining or 65536, 65536))
        except anyio.EndOfStream:
            if self._remaining is not None:
                raise
            return None
        if self._remaining is not None:
            self._remaining -= len(part)
        return part


class HttpClient:
    """HTTP/1.1 requests to one server (`base_url`), through a keep-alive pool of `limit` connections."""

    def __init__(
        self,
        base_url: str,
        *,
        ssl_context: ssl.SSLContext | None = None,
        server_name: str | None = None,
        proxy: str | None = None,
        proxy_headers: Mapping[str, str] | None = None,
        limit: int,
        keepalive: float,
        user_agent: str,
    ) -> None:
        url = urlsplit(base_url)
        self._tls = url.scheme == "https"
        if self._tls and ssl_context is None:
            raise ValueError(f"{base_url}: an https server needs an SSL context")
        self._ssl = ssl_context
        self._host = url.hostname or ""
        self._port = url.port or (443 if self._tls else 80)
        self._authority = url.netloc.rpartition("@")[2]
        self._prefix = url.path.rstrip("/")  # a server behind a path (e.g. Rancher's /k8s/clusters/ID)
        self._server_name = server_name or self._host
        self._proxy: tuple[str, int] | None = None
        self._proxy_lines: list[str] = []
        if proxy:
            self._proxy, self._proxy_lines = _parse_proxy(proxy, proxy_headers or {})
        # An http server through a proxy gets absolute-form targets; https goes through a tunnel.
        self._absolute = f"http://{self._authority}" if self._proxy and not self._tls else ""
        self._fixed_headers = f"Host: {self._authority}\r\nUser-Agent: {user_agent}\r\n"
        if self._absolute:
            self._fixed_headers += "".join(f"{line}\r\n" for line in self._proxy_lines)
        self._keepalive = keepalive
        # fast_acquire: no trip through the event loop when a slot is free (one less per request).
        self._slots = anyio.Semaphore(limit, fast_acquire=True)
        self._idle: list[_Connection] = []  # oldest first: reuse from the end, expire from the start
        self._closed = False

    async def aclose(self) -> None:
        """Close the idle connections; those in use close when their request ends."""
        self._closed = True
        idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()

    async def request(
        self,
        method: str,
        path: str,
        *,
        query: Sequence[tuple[str, str]] = (),
        headers: Mapping[str, str],
        body: bytes | None = None,
        timeout: float,  # noqa: ASYNC109 - the whole exchange's limit, passed on per request
    ) -> Answer:
        """Send one request and read its whole answer within `timeout` seconds."""
        data = self._encode(method, path, query, headers, body)
        async with self._slots:
            connection: _Connection | None = None
            try:
                with anyio.fail_after(timeout):
                    connection, head = await self._send(method, data)
                    content = await _read_body(connection, head)
            except BaseException as error:
                if connection is not None:  # (`_send` closes its connection when it fails)
                    connection.close()
                if isinstance(error, _STREAM_ERRORS):
                    what = "unreachable" if connection is None else "connection lost"
                    raise HttpError(what, _describe(error)) from error
                raise
            await self._release(connection, head.keep_alive)
        return Answer(head.status, head.headers, content)

    @asynccontextmanager
    async def stream(
        self,
        method: str,
        path: str,
        *,
        query: Sequence[tuple[str, str]] = (),
        headers: Mapping[str, str],
        connect_timeout: float,
        read_timeout: float,
    ) -> AsyncIterator[StreamingAnswer]:
        """Send one request; the answer's body is read part by part (`StreamingAnswer.next_part`)."""
        data = self._encode(method, path, query, headers, None)
        async with self._slots:
            try:
                connection, head = await self._send(method, data, connect_timeout, read_timeout)
            except _STREAM_ERRORS as error:
                raise HttpError("unreachable", _describe(error)) from error
            answer = StreamingAnswer(connection, head, read_timeout)
            try:
                yield answer
            except BaseException:
                connection.close()
                raise
            await self._release(connection, head.keep_alive and answer.complete)

    # ----- connections --------------------------------------------------------------------

    async def _send(
        self,
        method: str,
        data: bytes,
        connect_timeout: float | None = None,
        read_timeout: float | None = None,
    ) -> tuple[_Connection, _Head]:
        """Write the request and read the answer's head, resending it once where Go would."""
        for fresh in (False, True):
            with _limit(connect_timeout):
                connection = await (self._connect() if fresh else self._acquire())
            try:
                await connection.send(data)
                with _limit(read_timeout):
                    head = await _read_head(connection, method)
            except _STREAM_ERRORS as error:
                connection.close()
                stale = connection.reused and not connection.buffer
                if fresh or not stale or method not in REPLAYABLE_METHODS or isinstance(error, TimeoutError):
                    raise
                continue
            except BaseException:
                connection.close()
                raise
            return connection, head
        raise AssertionError("unreachable: the fresh connection's attempt returns or raises")

    async def _acquire(self) -> _Connection:
        """The most recently used live idle connection, else a new one."""
        while self._idle:
            connection = self._idle.pop()
            if time.monotonic() - connection.idle_since < self._keepalive and not connection.peer_closed():
                connection.reused = True
                return connection
            connection.close()
        return await self._connect()

    async def _release(self, connection: _Connection, reusable: bool) -> None:
        now = time.monotonic()
        while self._idle and now - self._idle[0].idle_since >= self._keepalive:
            self._idle.pop(0).close()
        if not reusable or self._closed or connection.buffer:
            connection.close()
            return
        connection.idle_since = now
        self._idle.append(connection)

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        host, port = self._proxy or (self._host, self._port)
        direct_tls = self._tls and not self._proxy
        _, connection = await loop.create_connection(
            lambda: _Connection(self._tls),
            host,
            port,
            ssl=self._ssl if direct_tls else None,
            server_hostname=self._server_name if direct_tls else None,
        )
        try:
            if self._tls and self._proxy:
                await self._tunnel(connection)
                assert connection.transport is not None and self._ssl is not None
                connection.transport = await loop.start_tls(
                    connection.transport, connection, self._ssl, server_hostname=self._server_name
                )
        except BaseException:
            connection.close()
            raise
        return connection

    async def _tunnel(self, connection: _Connection) -> None:
        """Ask the proxy for a tunnel to the API server (CONNECT, RFC 9110 9.3.6)."""
        lines = [f"CONNECT {self._host_port()} HTTP/1.1", f"Host: {self._host_port()}", *self._proxy_lines]
        await connection.send(("\r\n".join(lines) + "\r\n\r\n").encode())
        head = await _read_head(connection, "CONNECT")
        if not 200 <= head.status <= 299:
            raise HttpError("unreachable", f"the proxy refused CONNECT {self._host_port()}: {head.status}")
        if connection.buffer:  # the API server speaks only after the TLS handshake
            raise HttpError("answer malformed", "the proxy sent data after its CONNECT answer")

    def _host_port(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"{host}:{self._port}"

    def _encode(
        self,
        method: str,
        path: str,
        query: Sequence[tuple[str, str]],
        headers: Mapping[str, str],
        body: bytes | None,
    ) -> bytes:
        target = self._absolute + self._prefix + quote(path, safe="/%:@!$&'()*+,;=")
        if query:
            target += "?" + urlencode(query)
        parts = [f"{method} {target} HTTP/1.1\r\n", self._fixed_headers]
        for name, value in headers.items():
            if "\r" in value or "\n" in value:  # a token with a line break would split the request
                raise HttpError("not contacted", f"header {name} holds a line break: refused to send it")
            parts.append(f"{name}: {value}\r\n")
        if body is not None or method in ("POST", "PUT", "PATCH"):
            parts.append(f"Content-Length: {len(body or b'')}\r\n")
        parts.append("\r\n")
        return "".join(parts).encode() + (body or b"")


def _parse_proxy(proxy: str, proxy_headers: Mapping[str, str]) -> tuple[tuple[str, int], list[str]]:
    url = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    if url.scheme != "http" or not url.hostname:
        raise ValueError(f"proxy {proxy!r}: only http://HOST:PORT proxies are supported")
    lines = [f"{name}: {value}" for name, value in proxy_headers.items()]
    if url.username is not None and not any(n.lower() == "proxy-authorization" for n in proxy_headers):
        user = f"{unquote(url.username)}:{unquote(url.password or '')}"
        lines.append(f"Proxy-Authorization: Basic {b64encode(user.encode()).decode()}")
    return (url.hostname, url.port or 80), lines


async def _read_head(reader: _Connection, method: str) -> _Head:
    """Status line and headers of the final answer (interim 1xx answers are skipped)."""
    while True:
        try:
            raw = await reader.receive_until(b"\r\n\r\n", MAX_HEAD_BYTES)
        except anyio.DelimiterNotFound:
            raise HttpError(
                "answer malformed", f"status line and headers over {MAX_HEAD_BYTES} bytes"
            ) from None
        head = _parse_head(raw, method)
        if head.status >= 200:
            return head


def _parse_head(raw: bytes, method: str) -> _Head:
    status_line, *lines = raw.decode("latin-1").split("\r\n")
    version, _, rest = status_line.partition(" ")
    code = rest[:3]
    if (
        version not in ("HTTP/1.1", "HTTP/1.0")
        or len(code) != 3
        or not (code.isascii() and code.isdigit())
        or rest[3:4] not in ("", " ")
    ):
        raise HttpError("answer malformed", f"bad status line {status_line[:100]!r}")
    status = int(code)
    headers: dict[str, str] = {}
    for line in lines:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip() or " " in name or "\t" in name:
            raise HttpError("answer malformed", f"bad header line {line[:100]!r}")
        key = name.lower()
        value = value.strip()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    connection = {token.strip().lower() for token in headers.get("connection", "").split(",")}
    keep_alive = version == "HTTP/1.1" and "close" not in connection
    chunked, length = False, None
    transfer = headers.get("transfer-encoding")
    if method == "HEAD" or status in (204, 304) or status < 200 or (method == "CONNECT" and status < 300):
        length = 0
    elif transfer is not None:
        # RFC 9112 6.3: chunked last, else the body runs to the end of the connection.
        chunked = transfer.rsplit(",", 1)[-1].strip().lower() == "chunked"
        keep_alive = keep_alive and chunked
    elif "content-length" in headers:
        lengths = {v.strip() for v in headers["content-length"].split(",")}  # repeated: must agree
        text = lengths.pop() if len(lengths) == 1 else ""
        if not (text.isascii() and text.isdigit()):
            raise HttpError("answer malformed", f"bad Content-Length {headers['content-length'][:50]!r}")
        length = int(text)
    else:
        keep_alive = False  # the body ends when the server closes the connection
    return _Head(status, headers, keep_alive, chunked, length)


async def _read_chunk(reader: _Connection) -> bytes | None:
    """One chunk's data (extensions ignored); None after the last chunk and its trailers."""
    try:
        line = await reader.receive_until(b"\r\n", _CHUNK_LINE_BYTES)
    except anyio.DelimiterNotFound:
        raise HttpError("answer malformed", "chunk size line too long") from None
    size_text = line.split(b";", 1)[0].strip()
    if not size_text or len(size_text) > 15 or not _HEX_DIGITS.issuperset(size_text):
        raise HttpError("answer malformed", f"bad chunk size line {line[:50]!r}")
    size = int(size_text, 16)
    if size > MAX_BODY_BYTES:
        raise HttpError("answer too large", f"a chunk of {size} bytes (at most {MAX_BODY_BYTES})")
    if size == 0:
        trailers = 0
        while trailer := await reader.receive_until(b"\r\n", MAX_HEAD_BYTES):  # trailers: ignored
            trailers += len(trailer)
            if trailers > MAX_HEAD_BYTES:
                raise HttpError("answer malformed", f"trailers over {MAX_HEAD_BYTES} bytes")
        return None
    data = await reader.receive_exactly(size)
    if await reader.receive_exactly(2) != b"\r\n":
        raise HttpError("answer malformed", f"chunk of {size} bytes not followed by CRLF")
    return data


async def _read_body(reader: _Connection, head: _Head) -> bytes:
    """The whole body as `head` frames it, at most `MAX_BODY_BYTES`."""
    if head.length is not None:
        if head.length > MAX_BODY_BYTES:
            raise HttpError("answer too large", f"{head.length} bytes (at most {MAX_BODY_BYTES})")
        return await reader.receive_exactly(head.length) if head.length else b""
    parts: list[bytes] = []
    size = 0
    while True:
        part: bytes | None
        if head.chunked:
            part = await _read_chunk(reader)
        else:
            try:
                part = await reader.receive()
            except anyio.EndOfStream:
                part = None
        if part is None:
            return b"".join(parts)
        size += len(part)
        if size > MAX_BODY_BYTES:
            raise HttpError("answer too large", f"over {MAX_BODY_BYTES} bytes")
        parts.append(part)
