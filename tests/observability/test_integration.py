"""The server and a telemetry poller together, as `agent.runner` runs them."""

from __future__ import annotations

import aiohttp
import anyio

from agent.core.backend import DeviceTelemetry
from agent.core.inventory import Inventory
from agent.observe.httpserver import MetricsServer
from agent.observe.metrics import Metrics
from agent.observe.readiness import Readiness
from agent.observe.telemetry import TelemetryPoller
from tests.observability.fakes import DRIVER, TelemetryBackend, make_devices
from tests.support.clock import FakeClock


async def test_scrape_shows_polled_telemetry_and_readiness_follows_the_checks() -> None:
    backend = TelemetryBackend([DeviceTelemetry(device="gpu-0", power_watts=100.0)])
    inventory = Inventory(DRIVER)
    inventory.set_devices(make_devices(1))
    metrics, readiness, clock = Metrics(), Readiness(), FakeClock()
    readiness.expect(f"registered/{DRIVER}")
    poller = TelemetryPoller(
        backend, inventory, metrics, node_name="node-a", clock=clock, readiness=readiness
    )
    server = MetricsServer("127.0.0.1:0", metrics, readiness, clock=clock)
    async with anyio.create_task_group() as tg:
        port = await tg.start(server.run)
        tg.start_soon(poller.run)
        with anyio.fail_after(5):
            while backend.reads == 0:
                await anyio.lowlevel.checkpoint()
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
                text = await response.text()
            assert (
                'dra_agent_device_power_watts{UUID="GPU-00000000",device="gpu-0",driver="gpu.example.com"'
                in text
            )
            assert 'pool="node-a"' in text
            async with session.get(f"http://127.0.0.1:{port}/readyz") as response:
                assert response.status == 503
                body = await response.text()
                assert f"[-] registered/{DRIVER}: not reported yet" in body
                assert f"[+] telemetry/{DRIVER}" in body
            readiness.set(f"registered/{DRIVER}", True)
            async with session.get(f"http://127.0.0.1:{port}/readyz") as response:
                assert response.status == 200
        tg.cancel_scope.cancel()
