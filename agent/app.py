"""The agent process: every driver's backend, health, publishing and kubelet services in one task group.

Each long-running part runs under `supervise`: a failure is logged once per attempt, counted and
restarted with capped backoff instead of silently ending the process. SIGTERM/SIGINT cancel the
task group; each part cleans up in its own ``finally``.
"""

from __future__ import annotations

import logging
import random
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import anyio
from anyio.abc import TaskGroup

from agent.config import AgentConfig
from agent.core.backend import Backend, BackendOptions, load_backend_factory
from agent.core.clock import Clock, SystemClock
from agent.core.errors import AgentError, ConfigError
from agent.core.exclusion import EXCLUDE_SETTING, exclude_devices, parse_exclusions
from agent.core.inventory import Inventory
from agent.core.logs import log_fields
from agent.health.tracker import HealthTracker
from agent.observe.metrics import Metrics
from agent.observe.readiness import Readiness
from agent.observe.telemetry import MonitorLiveness

log = logging.getLogger("agent.app")


def create_backends(config: AgentConfig) -> list[Backend]:
    """Instantiate the configured backends; driver names must be unique across them."""
    backends: list[Backend] = []
    for spec in config.backends:
        factory = load_backend_factory(spec.name)
        settings = dict(spec.settings)
        excluded = parse_exclusions(settings.pop(EXCLUDE_SETTING, ""))
        options = BackendOptions(config.node_name, spec.driver_name, settings, state_dir=config.state_dir)
        backends.extend(exclude_devices(backend, excluded) for backend in factory(options))
    seen: set[str] = set()
    for backend in backends:
        if backend.driver_name in seen:
            raise ConfigError(
                "--backend",
                backend.driver_name,
                "a distinct driver name per backend (set one with driver=...)",
            )
        seen.add(backend.driver_name)
    return backends


async def supervise(
    name: str,
    run: Callable[[], Awaitable[None]],
    clock: Clock,
    *,
    initial_backoff: float = 0.5,
    max_backoff: float = 30.0,
) -> None:
    """Run `run` until cancelled; restart it with capped, jittered backoff when it fails or returns."""
    backoff = initial_backoff
    while True:
        started = clock.monotonic()
        try:
            await run()
            log.warning("component stopped; restarting", extra=log_fields(component=name))
        except Exception as error:
            log.error(
                "component failed; restarting",
                extra=log_fields(
                    component=name, error=f"{type(error).__name__}: {error}", retry_in=round(backoff, 2)
                ),
            )
        if clock.monotonic() - started > max_backoff:
            backoff = initial_backoff
        await clock.sleep(backoff * (0.8 + 0.4 * random.random()))
        backoff = min(backoff * 2, max_backoff)


@dataclass
class DriverRuntime:
    """Everything the agent runs for one driver name."""

    backend: Backend
    inventory: Inventory
    tracker: HealthTracker

    @property
    def driver(self) -> str:
        return self.backend.driver_name


@dataclass(frozen=True)
class Part:
    """A long-running part of the agent, run under `supervise`."""

    name: str
    run: Callable[[], Awaitable[None]]


PartsFactory = Callable[["Agent"], Sequence[Part]]


class Agent:
    """The whole agent: construct with a config, then `await run()` until cancelled."""

    def __init__(
        self,
        config: AgentConfig,
        *,
        backends: Sequence[Backend] | None = None,
        metrics: Metrics | None = None,
        clock: Clock | None = None,
        parts: PartsFactory | None = None,
        readiness: Readiness | None = None,
    ) -> None:
        self.config = config
        self.readiness = readiness
        self.clock = clock or SystemClock()
        self.metrics = metrics or Metrics()
        self.backends = list(backends) if backends is not None else create_backends(config)
        self.drivers: dict[str, DriverRuntime] = {}
        for backend in self.backends:
            inventory = Inventory(backend.driver_name)
            tracker = HealthTracker(inventory, self.clock, config.taint_hold_seconds, metrics=self.metrics)
            self.drivers[backend.driver_name] = DriverRuntime(backend, inventory, tracker)
        self._parts = parts
        self.started = anyio.Event()

    async def run(self) -> None:
        """Start every backend and part; return only when cancelled (or a backend cannot start)."""
        started: list[Backend] = []
        try:
            for runtime in self.drivers.values():
                try:
                    await runtime.backend.start()
                except AgentError:
                    raise
                except Exception as error:
                    raise AgentError(f"backend for {runtime.driver} failed to start: {error}") from error
                started.append(runtime.backend)
                runtime.inventory.set_devices(await runtime.backend.discover())
                log.info(
                    "backend started",
                    extra=log_fields(driver=runtime.driver, devices=len(runtime.inventory.device_names())),
                )
            async with anyio.create_task_group() as tg:
                for runtime in self.drivers.values():
                    self._start_driver(tg, runtime)
                for part in self._parts(self) if self._parts else ():
                    tg.start_soon(supervise, part.name, part.run, self.clock, name=part.name)
                self.started.set()
        finally:
            with anyio.CancelScope(shield=True):
                for backend in reversed(started):
                    try:
                        await backend.stop()
                    except Exception as error:  # stop must not mask the real exit reason
                        log.warning(
                            "backend stop failed",
                            extra=log_fields(driver=backend.driver_name, error=str(error)),
                        )

    def _start_driver(self, tg: TaskGroup, runtime: DriverRuntime) -> None:
        driver = runtime.driver
        # ``monitor/<driver>`` and the monitor's last-seen gauge follow the health monitor itself.
        liveness = MonitorLiveness(driver, self.metrics, self.clock, self.readiness)

        async def monitor() -> None:
            await liveness.run(runtime.backend.monitor_health, runtime.tracker.handle)

        async def rediscover() -> None:
            while True:
                await self.clock.sleep(self.config.resync_seconds)
                runtime.inventory.set_devices(await runtime.backend.discover())

        parts: list[tuple[str, Callable[[], Awaitable[None]]]] = [
            ("health-monitor", monitor),
            ("health-liveness", liveness.watch),
            ("health-tracker", runtime.tracker.run),
            ("rediscovery", rediscover),
        ]
        for name, part in parts:
            tg.start_soon(supervise, f"{driver}/{name}", part, self.clock, name=f"{driver}/{name}")


async def run_until_signal(agent: Agent) -> None:
    """Run the agent until SIGTERM or SIGINT, then shut it down cleanly."""
    async with anyio.create_task_group() as tg:

        async def watch_signals() -> None:
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    log.info("shutting down", extra=log_fields(signal=signal.Signals(signum).name))
                    tg.cancel_scope.cancel()
                    return

        tg.start_soon(watch_signals)
        await agent.run()
        tg.cancel_scope.cancel()
