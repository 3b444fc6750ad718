"""The agent's HTTP endpoints: ``/metrics`` (Prometheus), ``/healthz`` (liveness), ``/readyz``.

Default port 9478 (`DEFAULT_METRICS_PORT`, in `agent.observe.address`).

A scrape never waits on the event loop: collection, encoding and gzip (when the scraper accepts
it) run in a worker thread (they still hold the GIL while they run: ~5 ms for 16 GPUs). Liveness
means the event loop is responsive: a heartbeat task sleeps a fixed interval and measures how
late it wakes; ``/healthz`` answers 503 when the last lag, or the time since the last beat,
exceeds the threshold (a loop blocked by a stuck vendor call answers late or not at all, and
the kubelet's probe fails either way).
"""

from __future__ import annotations

import gzip
import logging
from collections.abc import Callable

import anyio
from aiohttp import web
from prometheus_client.exposition import choose_encoder

from agent.core.clock import Clock, SystemClock
from agent.core.errors import ConfigError
from agent.core.logs import log_fields
from agent.observe.address import parse_address
from agent.observe.metrics import Metrics
from agent.observe.readiness import Readiness

log = logging.getLogger("agent.observe.httpserver")

DEFAULT_HEARTBEAT_SECONDS = 1.0
DEFAULT_MAX_LOOP_LAG_SECONDS = 5.0


class LoopHeartbeat:
    """Measures event-loop lag: how much later than asked a sleep of `interval` returns."""

    def __init__(
        self,
        clock: Clock,
        *,
        interval: float = DEFAULT_HEARTBEAT_SECONDS,
        max_lag: float = DEFAULT_MAX_LOOP_LAG_SECONDS,
        metrics: Metrics | None = None,
    ) -> None:
        self.clock = clock
        self.interval = interval
        self.max_lag = max_lag
        self.lag = 0.0
        self._metrics = metrics
        self._last_beat = clock.monotonic()

    async def run(self) -> None:
        """Beat until cancelled."""
        while True:
            before = self.clock.monotonic()
            await self.clock.sleep(self.interval)
            now = self.clock.monotonic()
            self.beat(max(0.0, now - before - self.interval), now)

    def beat(self, lag: float, now: float) -> None:
        """Record one heartbeat that came `lag` seconds late."""
        if lag > self.max_lag >= self.lag:
            log.warning("event loop blocked", extra=log_fields(lag_seconds=round(lag, 3)))
        self.lag = lag
        self._last_beat = now
        if self._metrics is not None:
            self._metrics.event_loop_lag.set(lag)

    def health(self) -> tuple[bool, str]:
        """(healthy, reason): unhealthy when the loop was, or still is, late by more than `max_lag`."""
        silent = self.clock.monotonic() - self._last_beat - self.interval
        if silent > self.max_lag:
            return False, f"no event-loop heartbeat for {silent + self.interval:.3f}s"
        if self.lag > self.max_lag:
            return False, f"event loop lag {self.lag:.3f}s exceeds {self.max_lag:.3f}s"
        return True, f"event loop lag {self.lag:.3f}s"


class MetricsServer:
    """aiohttp server for ``/metrics``, ``/healthz`` and ``/readyz``; `run` until cancelled."""

    def __init__(
        self,
        address: str,
        metrics: Metrics,
        readiness: Readiness,
        *,
        clock: Clock | None = None,
        heartbeat_interval: float = DEFAULT_HEARTBEAT_SECONDS,
        max_loop_lag: float = DEFAULT_MAX_LOOP_LAG_SECONDS,
        liveness: Callable[[], tuple[bool, str]] | None = None,
    ) -> None:
        self.host, self.port = parse_address(address)
        self.liveness = liveness
        """More of ``/healthz``: (healthy, reason), e.g. parts of the agent failing for too long."""
        self.metrics = metrics
        self.readiness = readiness
        self.heartbeat = LoopHeartbeat(
            clock or SystemClock(), interval=heartbeat_interval, max_lag=max_loop_lag, metrics=metrics
        )

    def application(self) -> web.Application:
        """The aiohttp application (without the heartbeat task)."""
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/", self._index)
        return app

    async def run(self, *, task_status: anyio.abc.TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; reports the bound port through `task_status`."""
        # No access log: the kubelet probes every few seconds.
        runner = web.AppRunner(self.application(), access_log=None, handle_signals=False)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.host, self.port, reuse_address=True)
            try:
                await site.start()
            except OSError as error:
                raise ConfigError(
                    "--metrics-address",
                    f"{self.host or ''}:{self.port}",
                    f"a free HOST:PORT (binding failed: {error.strerror or error})",
                ) from error
            port = _bound_port(runner, self.port)
            log.info("serving metrics and probes", extra=log_fields(host=self.host or "*", port=port))
            task_status.started(port)
            await self.heartbeat.run()
        finally:
            with anyio.CancelScope(shield=True):
                await runner.cleanup()

    async def _metrics(self, request: web.Request) -> web.Response:
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        compress = "gzip" in request.headers.get("Accept-Encoding", "")
        registry = self.metrics.registry

        def encode() -> bytes:
            body: bytes = encoder(registry)
            # Text compresses ~10x (41 kB -> 3 kB for 16 GPUs); Prometheus asks for gzip.
            return gzip.compress(body, compresslevel=6) if compress else body

        # Collection is synchronous in prometheus-client: collect and compress off the event loop.
        body = await anyio.to_thread.run_sync(encode)
        response = web.Response(body=body)
        response.headers["Content-Type"] = content_type
        if compress:
            response.headers["Content-Encoding"] = "gzip"
        return response

    async def _healthz(self, _request: web.Request) -> web.Response:
        ok, reason = self.heartbeat.health()
        if ok and self.liveness is not None:
            live, why = self.liveness()
            if not live:
                ok, reason = False, why
        return web.Response(status=200 if ok else 503, text=("ok: " if ok else "unhealthy: ") + reason + "\n")

    async def _readyz(self, _request: web.Request) -> web.Response:
        ok, checks = self.readiness.ready()
        lines = [
            f"[{'+' if check_ok else '-'}] {name}" + (f": {detail}" if detail else "")
            for name, (check_ok, detail) in checks.items()
        ]
        lines.append("ready" if ok else "not ready")
        return web.Response(status=200 if ok else 503, text="\n".join(lines) + "\n")

    async def _index(self, _request: web.Request) -> web.Response:
        return web.Response(text="dra-agent: /metrics /healthz /readyz\n")


def _bound_port(runner: web.AppRunner, asked: int) -> int:
    for address in runner.addresses:
        # TCP addresses are (host, port) or (host, port, flowinfo, scope_id).
        if isinstance(address, tuple) and len(address) >= 2 and isinstance(address[1], int):
            port: int = address[1]
            return port
    return asked
