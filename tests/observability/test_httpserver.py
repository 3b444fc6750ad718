from __future__ import annotations

import gzip
import threading
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager

import aiohttp
import anyio
import pytest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from agent.core.clock import SystemClock
from agent.core.errors import ConfigError
from agent.observe.address import parse_address
from agent.observe.httpserver import LoopHeartbeat, MetricsServer
from agent.observe.metrics import Metrics
from agent.observe.readiness import Readiness
from tests.support.clock import FakeClock


async def get(port: int, path: str, headers: dict[str, str] | None = None) -> tuple[int, str, str]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}{path}", headers=headers) as response,
    ):
        return response.status, response.headers.get("Content-Type", ""), await response.text()


class Served:
    def __init__(self, server: MetricsServer, port: int) -> None:
        self.server = server
        self.port = port


@asynccontextmanager
async def serving() -> AsyncIterator[Served]:
    metrics = Metrics()
    metrics.init_driver("gpu.example.com")
    server = MetricsServer("127.0.0.1:0", metrics, Readiness(), clock=FakeClock())
    async with anyio.create_task_group() as tg:
        port = await tg.start(server.run)
        yield Served(server, port)
        tg.cancel_scope.cancel()


def test_parse_address() -> None:
    assert parse_address("0.0.0.0:9478") == ("0.0.0.0", 9478)
    assert parse_address(":9478") == (None, 9478)
    assert parse_address("[::]:9478") == ("::", 9478)
    for bad in ("9478", "host:", "host:99999", "host:http"):
        with pytest.raises(ConfigError, match="HOST:PORT"):
            parse_address(bad)


async def test_metrics_endpoint_serves_the_registry() -> None:
    async with serving() as served:
        served.server.metrics.prepared_claims.labels("gpu.example.com").set(4)
        status, content_type, text = await get(served.port, "/metrics")
        assert status == 200
        assert content_type.startswith("text/plain")
        assert 'dra_agent_prepared_claims{driver="gpu.example.com"} 4.0' in text
        assert "# TYPE dra_agent_devices gauge" in text


async def test_metrics_endpoint_gzips_when_asked() -> None:
    async with serving() as served:
        url = f"http://127.0.0.1:{served.port}/metrics"
        async with aiohttp.ClientSession(auto_decompress=False) as session:
            async with session.get(url, headers={"Accept-Encoding": "gzip"}) as response:
                assert response.headers["Content-Encoding"] == "gzip"
                text = gzip.decompress(await response.read()).decode()
            assert "# TYPE dra_agent_devices gauge" in text
            async with session.get(url, headers={"Accept-Encoding": "identity"}) as response:
                assert "Content-Encoding" not in response.headers
                assert "# TYPE dra_agent_devices gauge" in await response.text()


async def test_metrics_endpoint_speaks_openmetrics_when_asked() -> None:
    async with serving() as served:
        status, content_type, text = await get(
            served.port, "/metrics", {"Accept": "application/openmetrics-text; version=1.0.0"}
        )
        assert status == 200
        assert content_type.startswith("application/openmetrics-text")
        assert text.rstrip().endswith("# EOF")


async def test_readyz_transitions() -> None:
    async with serving() as served:
        readiness = served.server.readiness
        assert (await get(served.port, "/readyz"))[0] == 200
        readiness.expect("registered/gpu.example.com")
        status, _, text = await get(served.port, "/readyz")
        assert status == 503
        assert "[-] registered/gpu.example.com: not reported yet" in text
        assert text.endswith("not ready\n")
        readiness.set("registered/gpu.example.com", True)
        status, _, text = await get(served.port, "/readyz")
        assert (status, text) == (200, "[+] registered/gpu.example.com\nready\n")
        readiness.set("published/gpu.example.com", False, "API server unreachable")
        status, _, text = await get(served.port, "/readyz")
        assert status == 503
        assert "[-] published/gpu.example.com: API server unreachable" in text


async def test_healthz_follows_simulated_loop_lag() -> None:
    async with serving() as served:
        heartbeat = served.server.heartbeat
        clock = heartbeat.clock
        assert isinstance(clock, FakeClock)
        assert (await get(served.port, "/healthz"))[0] == 200
        # Time jumps 10 s while the heartbeat sleeps 1 s: before it runs, it is silent...
        clock.advance(10.0)
        status, _, text = await get(served.port, "/healthz")
        assert status == 503
        assert "heartbeat" in text or "lag" in text
        # ...and once it runs it reports 9 s of lag.
        await wait_for(lambda: heartbeat.lag > 0)
        status, _, text = await get(served.port, "/healthz")
        assert status == 503
        assert "event loop lag 9.000s exceeds 5.000s" in text
        assert served.server.metrics.registry.get_sample_value("dra_agent_event_loop_lag_seconds") == 9.0
        clock.advance(1.0)
        await wait_for(lambda: heartbeat.lag == 0)
        assert (await get(served.port, "/healthz"))[0] == 200


async def test_really_blocked_loop_turns_unhealthy() -> None:
    heartbeat = LoopHeartbeat(SystemClock(), interval=0.01, max_lag=0.05)
    async with anyio.create_task_group() as tg:
        tg.start_soon(heartbeat.run)
        await anyio.sleep(0.02)
        time.sleep(0.3)  # noqa: ASYNC251 - blocks the event loop on purpose
        await wait_for(lambda: heartbeat.lag > 0.05)
        ok, reason = heartbeat.health()
        assert not ok
        assert "exceeds" in reason
        tg.cancel_scope.cancel()


class BlockingCollector(Collector):
    """Blocks collection until released; records the thread that collected."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.threads: list[int] = []

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return []  # so registering does not call collect() on the test's thread

    def collect(self) -> Iterable[GaugeMetricFamily]:
        self.threads.append(threading.get_ident())
        self.entered.set()
        self.release.wait(10)
        yield GaugeMetricFamily("dra_agent_test_blocking", "test", value=1)


async def test_scrape_does_not_block_the_loop() -> None:
    metrics = Metrics()
    collector = BlockingCollector()
    server = MetricsServer("127.0.0.1:0", metrics, Readiness(), clock=FakeClock())
    async with anyio.create_task_group() as tg:
        port = await tg.start(server.run)
        metrics.registry.register(collector)
        scrape: list[tuple[int, str, str]] = []

        async def scrape_once() -> None:
            scrape.append(await get(port, "/metrics"))

        tg.start_soon(scrape_once)
        await anyio.to_thread.run_sync(collector.entered.wait, 10)
        # Collection is stuck in its thread, yet the loop still answers probes.
        assert (await get(port, "/healthz"))[0] == 200
        assert not scrape
        collector.release.set()
        await wait_for(lambda: bool(scrape))
        assert "dra_agent_test_blocking 1.0" in scrape[0][2]
        assert threading.get_ident() not in collector.threads
        tg.cancel_scope.cancel()


async def test_port_in_use_is_a_config_error() -> None:
    async with serving() as served:
        other = MetricsServer(f"127.0.0.1:{served.port}", Metrics(), Readiness(), clock=FakeClock())
        with pytest.raises(ConfigError, match="a free HOST:PORT"):
            await other.run()


async def test_index_and_unknown_paths() -> None:
    async with serving() as served:
        status, _, text = await get(served.port, "/")
        assert status == 200
        assert "/metrics" in text
        assert (await get(served.port, "/nope"))[0] == 404


async def wait_for(condition: object) -> None:
    assert callable(condition)
    with anyio.fail_after(5):
        while not condition():  # noqa: ASYNC110 - polls state the server sets
            await anyio.sleep(0.001)
