"""KubeClient's HTTP transport: one bounded keep-alive pool, credentials and token refresh, proxy, TLS.

A small aiohttp server stands in for the API server where the emulator cannot show what is
checked (connections per client port, request headers). The Authorization header and the
watch/list query shapes are what client-go sends (staging/src/k8s.io/client-go/transport/round_trippers.go:
``bearerAuthRoundTripper`` sets ``Authorization: Bearer <token>`` on every request).
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from aiohttp import web

from agent.core.errors import KubeApiError
from agent.kube.client import REQUEST_CONCURRENCY, KubeClient, _ssl_context

CLAIM_PATH = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/claim-1"


def configuration(host: str) -> Any:
    from kubernetes_asyncio.client.configuration import Configuration

    return Configuration(host=host)


class FakeServer:
    """Records client ports, request headers and the most requests in flight at once."""

    def __init__(self) -> None:
        self.peers: set[tuple[str, int]] = set()
        self.headers: list[dict[str, str]] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        peer = request.transport.get_extra_info("peername") if request.transport else None
        if peer is not None:
            self.peers.add((peer[0], peer[1]))
        self.headers.append(dict(request.headers))
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await anyio.sleep(0.01)  # long enough for the other requests to queue up
        finally:
            self.in_flight -= 1
        if request.path == "/version":
            return web.json_response({"major": "1", "minor": "34", "gitVersion": "v1.34.0"})
        if request.path == "/apis/resource.k8s.io":
            return web.json_response({"versions": [{"version": "v1"}, {"version": "v1beta2"}]})
        if request.path == "/apis/resource.k8s.io/v1beta2":
            return web.json_response({"resources": [{"name": "resourceslices"}]})
        if request.path in ("/status-500", "/apis/resource.k8s.io/v1"):
            return web.json_response({"reason": "InternalError", "message": "boom"}, status=500)
        return web.json_response(
            {"metadata": {"name": "claim-1", "uid": "u1"}, "selector": request.query.get("fieldSelector")}
        )


@pytest.fixture
async def server() -> AsyncIterator[FakeServer]:
    fake = FakeServer()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fake.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    fake.url = f"http://127.0.0.1:{port}"
    try:
        yield fake
    finally:
        await runner.cleanup()


async def test_a_burst_of_claim_reads_shares_a_few_keep_alive_connections(server: FakeServer) -> None:
    """100 concurrent reads (100 pods starting at once): at most REQUEST_CONCURRENCY connections."""
    kube = KubeClient.from_configuration(configuration(server.url))
    try:
        async with anyio.create_task_group() as tg:
            for _ in range(100):
                tg.start_soon(kube.request, "GET", CLAIM_PATH)
        assert server.most_in_flight <= REQUEST_CONCURRENCY
        assert len(server.peers) <= REQUEST_CONCURRENCY
        # Later requests reuse the kept-alive connections.
        before = set(server.peers)
        await kube.request("GET", CLAIM_PATH)
        assert server.peers == before
    finally:
        await kube.close()


async def test_bearer_token_is_sent_and_refreshed_per_request(server: FakeServer) -> None:
    cfg = configuration(server.url)
    cfg.api_key["BearerToken"] = "first"
    cfg.api_key_prefix["BearerToken"] = "Bearer"
    tokens = iter(["first", "second"])

    def refresh(config: Any) -> None:  # as the in-cluster loader's hook: re-reads the token file
        config.api_key["BearerToken"] = next(tokens)

    cfg.refresh_api_key_hook = refresh
    kube = KubeClient.from_configuration(cfg)
    try:
        await kube.request("GET", CLAIM_PATH)
        await kube.request("GET", CLAIM_PATH)
    finally:
        await kube.close()
    assert [h.get("Authorization") for h in server.headers] == ["Bearer first", "Bearer second"]
    assert all(h["Accept"] == "application/json" for h in server.headers)


async def test_no_token_sends_no_authorization(server: FakeServer) -> None:
    kube = KubeClient.from_configuration(configuration(server.url))
    try:
        await kube.request("GET", CLAIM_PATH)
    finally:
        await kube.close()
    assert "Authorization" not in server.headers[0]


async def test_query_and_errors(server: FakeServer) -> None:
    kube = KubeClient.from_configuration(configuration(server.url + "/"))
    try:
        answer = await kube.request(
            "GET", "/list", query=[("fieldSelector", "spec.nodeName=n,spec.driver=d")]
        )
        assert answer["selector"] == "spec.nodeName=n,spec.driver=d"
        with pytest.raises(KubeApiError, match="500 InternalError: boom") as error:
            await kube.request("GET", "/status-500")
        assert error.value.status == 500
    finally:
        await kube.close()


async def test_discovery_lists_versions_at_once_and_reports_one_failure(server: FakeServer) -> None:
    kube = KubeClient.from_configuration(configuration(server.url))
    try:
        with pytest.raises(KubeApiError, match=r"/apis/resource\.k8s\.io/v1: 500") as error:
            await kube.discover()
        assert error.value.status == 500
    finally:
        await kube.close()


async def test_closed_port_is_status_zero() -> None:
    kube = KubeClient.from_configuration(configuration("http://127.0.0.1:1"), request_timeout=2)
    try:
        with pytest.raises(KubeApiError, match="API server unreachable") as error:
            await kube.request("GET", CLAIM_PATH)
        assert error.value.status == 0
    finally:
        await kube.close()


def test_tls_settings_come_from_the_configuration(tmp_path: Path) -> None:
    cfg = configuration("https://10.0.0.1")
    assert _ssl_context(cfg).verify_mode is ssl.CERT_REQUIRED
    cfg.verify_ssl = False
    context = _ssl_context(cfg)
    assert context.verify_mode is ssl.CERT_NONE and not context.check_hostname
    cfg.ssl_ca_cert = str(tmp_path / "missing-ca.crt")
    with pytest.raises(OSError):
        _ssl_context(cfg)
