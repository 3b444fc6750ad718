"""The API client's HTTP: one aiohttp session, and the little it does not do for us.

aiohttp does the HTTP/1.1 (framing, keep-alive), TLS with the kubeconfig's `ssl.SSLContext`,
proxies (the kubeconfig's ``proxy-url``, else ``HTTPS_PROXY``/``HTTP_PROXY``/``NO_PROXY`` read by
aiohttp's own `get_env_proxy_for_url`, what ``trust_env=True`` would do, but once: with
``trust_env`` aiohttp looks up the proxy and ``~/.netrc`` in a worker thread for every request,
which tripled a claim read's CPU, 157 -> 566 µs in `benchmarks.kube_client_bench`) and one pool
of at most `limit` connections, idle ones closed after `keepalive` seconds. Ours, on top:

- **The resend after a stale keep-alive connection**, where Go's net/http would resend
  (`shouldRetryRequest` in src/net/http/transport.go): a reused connection, nothing of the answer
  read, a replayable request (GET, HEAD, OPTIONS or TRACE). aiohttp's own resend (any idempotent
  method, PUT and DELETE included, fresh connections too) is switched off: a PUT of a slice or a
  DELETE with preconditions sent twice answers 409 or 404 for what succeeded.
- **Bounded answers**: a body read whole is at most `MAX_BODY_BYTES`, a watch line too.
- **The watch stream's line framing** (`StreamingAnswer.lines`).
- **Errors as `HttpError`**, saying how far the exchange got and, for TLS, what to check.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager, suppress
from dataclasses import dataclass
from types import SimpleNamespace
from urllib.parse import quote, urlencode

import aiohttp
from aiohttp.helpers import get_env_proxy_for_url
from yarl import URL

MAX_BODY_BYTES = 64 * 1024 * 1024
"""An answer read whole, or one watch event; an object is at most ~1.5 MB (etcd's limit)."""
REPLAYABLE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
"""What Go's net/http resends after a stale keep-alive connection (`Request.isReplayable`)."""
_TLS_HINT = (
    " (check the kubeconfig's certificate-authority / certificate-authority-data and tls-server-name, "
    "or the service account's ca.crt)"
)
_CLIENT_CERTIFICATE_HINT = (
    " (closed without an answer: a TLS server that refuses the client certificate does this; check the "
    "kubeconfig's client-certificate / client-key)"
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


@dataclass(frozen=True)
class Answer:
    """A complete answer: status and body."""

    status: int
    body: bytes


def _failure(error: BaseException, *, answered: bool, tls: bool = False) -> HttpError:
    """`error` (aiohttp's, an OSError, a timeout) as an `HttpError` naming how far it got."""
    detail = f"{type(error).__name__}: {error}"
    if tls and not answered and isinstance(error, aiohttp.ServerDisconnectedError):
        # TLS 1.3: a server refusing the client certificate says so after the client's handshake.
        detail += _CLIENT_CERTIFICATE_HINT
    if isinstance(error, aiohttp.ClientConnectorCertificateError):
        return HttpError("unreachable", f"TLS: the API server's certificate was refused: {error}{_TLS_HINT}")
    if isinstance(error, aiohttp.ClientConnectorSSLError):
        return HttpError("unreachable", f"TLS handshake failed: {error}{_TLS_HINT}")
    if isinstance(error, aiohttp.ClientHttpProxyError):
        return HttpError("unreachable", f"the proxy refused the request: {error.status} {error.message}")
    if isinstance(error, aiohttp.ClientResponseError):  # aiohttp's parser refused the answer
        return HttpError("answer malformed", _one_line(str(error.message or error)))
    if isinstance(error, aiohttp.ClientPayloadError):
        return HttpError("connection lost", f"the body did not arrive whole: {error}")
    return HttpError("connection lost" if answered else "unreachable", detail)


def _one_line(text: str) -> str:
    """aiohttp's parser errors span lines (the bad bytes, a caret under them): one line for the log."""
    return " ".join(part.strip() for part in text.splitlines() if part.strip() not in ("", "^"))


async def _read_body(response: aiohttp.ClientResponse) -> bytes:
    """The whole body, at most `MAX_BODY_BYTES` (refused before reading when its length says so)."""
    length = response.content_length
    if length is not None:
        if length > MAX_BODY_BYTES:
            raise HttpError("answer too large", f"{length} bytes (at most {MAX_BODY_BYTES})")
        return await response.read()
    parts: list[bytes] = []
    size = 0
    while part := await response.content.readany():
        size += len(part)
        if size > MAX_BODY_BYTES:
            raise HttpError("answer too large", f"over {MAX_BODY_BYTES} bytes")
        parts.append(part)
    return b"".join(parts)


class StreamingAnswer:
    """An answer whose body is read as it arrives (the watch); at most `read_timeout` between parts."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.status = response.status
        self._response = response

    async def read(self) -> bytes:
        """The whole body (an error's), at most `MAX_BODY_BYTES`."""
        try:
            return await _read_body(self._response)
        except (aiohttp.ClientError, OSError) as error:
            raise _failure(error, answered=True) from error

    async def lines(self) -> AsyncIterator[bytes]:
        """The body's non-blank lines as they arrive (JSON watch events), each at most `MAX_BODY_BYTES`."""
        content = self._response.content
        buffer = b""
        try:
            while part := await content.readany():
                buffer += part
                if b"\n" not in part:
                    if len(buffer) > MAX_BODY_BYTES:
                        raise HttpError("answer too large", f"a line over {MAX_BODY_BYTES} bytes")
                    continue
                *complete, buffer = buffer.split(b"\n")
                for line in complete:
                    if line.strip():
                        yield line
        except (aiohttp.ClientError, OSError) as error:
            raise _failure(error, answered=True) from error
        if buffer.strip():
            yield buffer


class HttpClient:
    """HTTP requests to one server (`base_url`), through a keep-alive pool of `limit` connections."""

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
        """`ssl_context`: the kubeconfig's TLS (None: aiohttp's default verification, for https).

        Must be created inside the running event loop (aiohttp's session is bound to it).
        """
        if proxy and not proxy.startswith(("http://", "https://")):
            raise ValueError(f"proxy {proxy!r}: only http:// and https:// proxies are supported")
        self._tls = base_url.startswith("https:")
        self._base = base_url.rstrip("/")  # a server behind a path (e.g. Rancher's /k8s/clusters/ID)
        self._server_name = server_name or None
        self._proxy: str | URL | None = proxy or None
        self._proxy_auth: aiohttp.BasicAuth | None = None
        self._proxy_headers = dict(proxy_headers or {}) or None
        if self._proxy is None:
            with suppress(LookupError):  # none set, or NO_PROXY names the server
                self._proxy, self._proxy_auth = get_env_proxy_for_url(URL(self._base))
        tracing = aiohttp.TraceConfig()
        tracing.on_connection_reuseconn.append(_mark_reused)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=limit, keepalive_timeout=keepalive, ssl=ssl_context if ssl_context is not None else True
            ),
            headers={"User-Agent": user_agent},
            timeout=aiohttp.ClientTimeout(total=None),  # each request says its own
            cookie_jar=aiohttp.DummyCookieJar(),
            trace_configs=[tracing],
        )
        # Ours resends only where Go would (see the module's docstring); aiohttp has no parameter.
        self._session._retry_connection = False

    async def aclose(self) -> None:
        """Close the session and its connections."""
        await self._session.close()

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
        url = self._url(path, query, headers)
        answered = False
        try:
            async with self._send(
                method, url, headers, body, aiohttp.ClientTimeout(total=timeout)
            ) as response:
                answered = True
                content = await _read_body(response)
        except (aiohttp.ClientError, OSError) as error:  # (TimeoutError is an OSError)
            raise _failure(error, answered=answered, tls=self._tls) from error
        return Answer(response.status, content)

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
        """Send one request; the answer's body is read as it arrives (`StreamingAnswer.lines`)."""
        url = self._url(path, query, headers)
        limits = aiohttp.ClientTimeout(total=None, connect=connect_timeout, sock_read=read_timeout)
        async with AsyncExitStack() as stack:
            try:
                response = await stack.enter_async_context(self._send(method, url, headers, None, limits))
            except (aiohttp.ClientError, OSError) as error:
                raise _failure(error, answered=False, tls=self._tls) from error
            yield StreamingAnswer(response)

    @asynccontextmanager
    async def _send(
        self,
        method: str,
        url: URL,
        headers: Mapping[str, str],
        body: bytes | None,
        limits: aiohttp.ClientTimeout,
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """The answer once its head arrived, the request resent while Go would resend it."""
        while True:
            attempt = SimpleNamespace(reused=False)
            try:
                response = await self._session.request(
                    method,
                    url,
                    headers=headers,
                    data=body,
                    proxy=self._proxy,
                    proxy_auth=self._proxy_auth,
                    proxy_headers=self._proxy_headers,
                    server_hostname=self._server_name,
                    allow_redirects=False,
                    trace_request_ctx=attempt,
                    timeout=limits,
                )
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):  # (not a timeout)
                if attempt.reused and method in REPLAYABLE_METHODS:
                    continue  # the stale connection is closed: the next attempt takes another one
                raise
            async with response:
                yield response
            return

    def _url(self, path: str, query: Sequence[tuple[str, str]], headers: Mapping[str, str]) -> URL:
        for name, value in headers.items():
            if "\r" in value or "\n" in value:  # a token with a line break would split the request
                raise HttpError("not contacted", f"header {name} holds a line break: refused to send it")
        target = self._base + quote(path, safe="/%:@!$&'()*+,;=")
        if query:
            target += "?" + urlencode(query)
        return URL(target, encoded=True)


async def _mark_reused(session: object, context: SimpleNamespace, params: object) -> None:
    """aiohttp's signal that the request got a pooled connection: a failure may be a stale one."""
    context.trace_request_ctx.reused = True
