"""In-process checks of the lifecycle rules the process tests rely on: restored taints, optional
backends, the ``/healthz`` bound for failing parts, the start-up checks and their bad values."""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from agent.app import Agent, Part, PartFailures
from agent.config import AgentConfig, build_config, parse_backend_spec
from agent.core.backend import ClaimRef, ContainerEdits, DeviceTelemetry, HealthEvent, HealthSink
from agent.core.errors import AgentError, BackendError, ConfigError
from agent.core.inventory import Inventory
from agent.core.model import Device, HealthCondition, Severity
from agent.health.tracker import HealthTracker
from agent.kube.published import parse_time, slice_taints
from agent.observe.httpserver import MetricsServer
from agent.observe.metrics import Metrics
from agent.observe.readiness import Readiness
from agent.preflight import preflight
from tests.support.clock import FakeClock

DRIVER = "gpu.example.com"
NODE = "node-1"

# --- restored taints ------------------------------------------------------------------------------


def tracker(clock: FakeClock, hold: float = 10.0) -> tuple[Inventory, HealthTracker]:
    inventory = Inventory(DRIVER)
    inventory.set_devices([Device(f"gpu-{i}", DRIVER) for i in range(2)])
    return inventory, HealthTracker(inventory, clock, hold)


def xid79(since: float) -> HealthCondition:
    return HealthCondition("xid", Severity.CRITICAL, "79", "held from before the agent restarted", since)


def test_a_restored_taint_is_held_from_its_time_added_then_lifted(fake_clock: FakeClock) -> None:
    inventory, health = tracker(fake_clock)
    health.seed("gpu-0", xid79(fake_clock.time() - 4))
    assert [c.condition for c in inventory.health()["gpu-0"].conditions] == ["xid"]
    (active,) = health.active()
    assert active.lifts_at == fake_clock.time() + 6
    fake_clock.advance(5.9)
    health.expire()
    assert "gpu-0" in inventory.health()
    fake_clock.advance(0.2)
    health.expire()
    assert "gpu-0" not in inventory.health()


def test_a_restored_taint_reported_again_is_held_from_the_new_report(fake_clock: FakeClock) -> None:
    inventory, health = tracker(fake_clock)
    since = fake_clock.time() - 9
    health.seed("gpu-0", xid79(since))
    health.record(HealthEvent("gpu-0", "xid", Severity.CRITICAL, "79"))
    fake_clock.advance(5)
    health.expire()
    assert "gpu-0" in inventory.health()  # 14 s after timeAdded, 5 s after the report
    assert inventory.health()["gpu-0"].conditions[0].since == since  # timeAdded does not churn


def test_seeding_a_tracked_condition_keeps_it_with_the_earlier_since(fake_clock: FakeClock) -> None:
    _, health = tracker(fake_clock)
    health.record(HealthEvent("gpu-1", "xid", Severity.CRITICAL, "79"))
    health.seed("gpu-1", xid79(fake_clock.time() - 3))
    health.seed("gpu-1", xid79(fake_clock.time() + 100))  # a clock skewed into the future: now
    (active,) = health.active()
    assert active.condition.since == fake_clock.time() - 3
    assert active.condition.message == ""  # the live report's state is kept


def _slice(generation: int, pool: str, devices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"spec": {"pool": {"name": pool, "generation": generation}, "devices": devices}}


def test_published_taints_are_read_from_the_current_generation_of_our_pool() -> None:
    taint = {
        "key": f"{DRIVER}/xid",
        "value": "79",
        "effect": "NoSchedule",
        "timeAdded": "2026-01-02T03:04:05Z",
    }
    items = [
        _slice(2, NODE, [{"name": "gpu-0", "taints": [taint]}]),
        # v1beta1 shape
        _slice(2, NODE, [{"name": "gpu-1", "basic": {"taints": [{**taint, "timeAdded": "bad"}]}}]),
        _slice(1, NODE, [{"name": "gpu-2", "taints": [taint]}]),  # an older layout
        _slice(3, "other-pool", [{"name": "gpu-3", "taints": [taint]}]),
    ]
    found = slice_taints(items, NODE)
    assert [(t.device, t.key, t.value, t.effect) for t in found] == [
        ("gpu-0", f"{DRIVER}/xid", "79", "NoSchedule"),
        ("gpu-1", f"{DRIVER}/xid", "79", "NoSchedule"),
    ]
    assert found[0].time_added == parse_time("2026-01-02T03:04:05.250Z") == 1767323045.0
    assert found[1].time_added is None
    assert parse_time(None) is None and parse_time("2026-01-02T03:04:05+01:00") is None


# --- optional backends ----------------------------------------------------------------------------


class StubBackend:
    """A backend that starts, fails to start, or has no devices."""

    def __init__(self, driver: str, *, devices: int = 2, start_error: str = "") -> None:
        self._driver = driver
        self._devices = devices
        self._start_error = start_error
        self.stopped = False

    @property
    def driver_name(self) -> str:
        return self._driver

    async def start(self) -> None:
        if self._start_error:
            raise BackendError(self._start_error)

    async def stop(self) -> None:
        self.stopped = True

    async def discover(self) -> Sequence[Device]:
        return [Device(f"gpu-{i}", self._driver) for i in range(self._devices)]

    async def monitor_health(self, sink: HealthSink) -> None:
        await anyio.sleep_forever()

    async def prepare(self, device: str, claim: ClaimRef) -> ContainerEdits:
        return ContainerEdits()

    async def unprepare(self, device: str, claim: ClaimRef) -> None:
        pass

    async def telemetry(self) -> Sequence[DeviceTelemetry]:
        return []


async def test_optional_backends_without_library_or_devices_are_left_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="agent.app")
    served = StubBackend("gpu.nvidia.com")
    no_library = StubBackend("gpu.amd.com", start_error="amdsmi cannot be imported")
    no_devices = StubBackend("gpu.example.com", devices=0)
    agent = Agent(
        AgentConfig(),
        backends=[served, no_library, no_devices],
        optional={"gpu.amd.com", "gpu.example.com"},
    )
    async with anyio.create_task_group() as tg:
        tg.start_soon(agent.run)
        with anyio.fail_after(5):
            await agent.started.wait()
        tg.cancel_scope.cancel()
    assert list(agent.drivers) == ["gpu.nvidia.com"]
    assert no_devices.stopped  # started, then released at once
    lines = [
        r.getMessage() for r in caplog.records if r.getMessage() == "optional backend not served on this node"
    ]
    assert len(lines) == 2


async def test_a_required_backend_that_cannot_start_stops_the_agent() -> None:
    agent = Agent(AgentConfig(), backends=[StubBackend("gpu.amd.com", start_error="no amdsmi")])
    with pytest.raises(AgentError, match="no amdsmi"):
        await agent.run()


def test_the_optional_setting_is_the_agents_own() -> None:
    spec = parse_backend_spec("amd:optional=true,poll-interval=5")
    assert spec.optional and spec.backend_settings == {"poll-interval": "5"}
    assert not parse_backend_spec("amd:optional=false").optional
    with pytest.raises(ConfigError, match="optional=true or optional=false"):
        parse_backend_spec("amd:optional=maybe")


# --- /healthz when a part keeps failing -------------------------------------------------------------


def test_a_part_failing_longer_than_the_bound_is_unhealthy(fake_clock: FakeClock) -> None:
    failures = PartFailures(fake_clock, unhealthy_after=120, stable_after=60)
    for _ in range(5):
        failures.failed("gpu.example.com/kubelet", "FileLockError: cannot open lock file")
        fake_clock.advance(30)
    ok, reason = failures.health()
    assert not ok and "gpu.example.com/kubelet has been failing for 150s: FileLockError" in reason
    fake_clock.advance(61)  # ran a minute without failing: the episode is over
    assert failures.health() == (True, "")
    failures.failed("gpu.example.com/kubelet", "again")
    assert failures.health()[0]  # a new episode starts now


async def test_healthz_fails_while_a_part_keeps_failing() -> None:
    async def broken() -> None:
        raise OSError("no such directory")

    agent = Agent(
        AgentConfig(),
        backends=[StubBackend(DRIVER)],
        parts=lambda _: [Part("broken", broken)],
        unhealthy_after=0.3,
    )
    async with anyio.create_task_group() as tg:
        tg.start_soon(agent.run)
        with anyio.fail_after(10):
            while agent.failures.health()[0]:  # noqa: ASYNC110
                await anyio.sleep(0.02)
        tg.cancel_scope.cancel()
    server = MetricsServer("127.0.0.1:0", Metrics(), Readiness(), liveness=agent.failures.health)
    response = await server._healthz(None)  # type: ignore[arg-type]
    assert response.status == 503
    assert "broken has been failing" in str(response.text) and "no such directory" in str(response.text)


# --- start-up checks ------------------------------------------------------------------------------


def test_preflight_creates_every_missing_directory(tmp_path: Path) -> None:
    config = AgentConfig(
        registry_dir=tmp_path / "a" / "registry",
        plugins_dir=tmp_path / "a" / "plugins",
        cdi_root=tmp_path / "cdi",
        state_dir=tmp_path / "b" / "c" / "state",
        metrics_address="127.0.0.1:0",
    )
    preflight(config)
    assert all(
        p.is_dir() for p in (config.registry_dir, config.plugins_dir, config.cdi_root, config.state_dir)
    )


def test_preflight_refuses_a_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        config = AgentConfig(cdi_root=tmp_path / "c", state_dir=tmp_path / "s", serve_kubelet=False)
        with pytest.raises(ConfigError, match=r"--metrics-address \(\$DRA_AGENT_METRICS_ADDRESS\).*free"):
            preflight(AgentConfig(**{**config.__dict__, "metrics_address": f"127.0.0.1:{port}"}))
    assert not (tmp_path / "c").exists()  # nothing created before every check passed


@pytest.mark.parametrize("variable", ["DRA_AGENT_TAINT_HOLD_SECONDS", "DRA_AGENT_HEALTH_DEBOUNCE_SECONDS"])
@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "Infinity"])
def test_infinite_seconds_are_refused(variable: str, value: str) -> None:
    with pytest.raises(ConfigError, match="a finite number of seconds"):
        build_config({}, {variable: value})
