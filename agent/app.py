"""The agent process: every driver's backend, health, publishing and kubelet services in one task group.

Each long-running part runs under `supervise`: a failure is logged once per attempt, counted and
restarted with capped backoff instead of silently ending the process; a part failing for longer
than `PART_UNHEALTHY_AFTER_SECONDS` makes ``/healthz`` fail (`PartFailures`). Backends marked
optional that have no library or no devices on this node are left out at start. SIGTERM/SIGINT
cancel the task group; each part cleans up in its own ``finally``.
"""

from __future__ import annotations

import functools
import logging
import random
import signal
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio
from anyio.abc import TaskGroup

from agent.config import AgentConfig
from agent.core.backend import (
    Backend,
    BackendOptions,
    PollsHealth,
    declared_checks,
    declared_trends,
    load_backend_factory,
)
from agent.core.clock import Clock, SystemClock
from agent.core.errors import AgentError, ConfigError
from agent.core.exclusion import EXCLUDE_SETTING, exclude_devices, parse_exclusions
from agent.core.inventory import Inventory
from agent.core.logs import log_fields
from agent.core.model import HealthCondition
from agent.health.persist import HEALTH_FILE, HealthFileWriter, restore
from agent.health.taints import TaintPolicy
from agent.health.tracker import HealthTracker
from agent.health.vanished import VanishedDevices
from agent.observe.metrics import Metrics
from agent.observe.readiness import Readiness
from agent.observe.telemetry import MonitorLiveness

log = logging.getLogger("agent.app")

PART_UNHEALTHY_AFTER_SECONDS = 120.0
"""A part failing (restarting) for longer than this makes ``/healthz`` fail (documented in the README)."""
PART_STABLE_AFTER_SECONDS = 60.0
"""A part that ran this long without failing ends its failure episode."""


def create_backends(config: AgentConfig) -> list[Backend]:
    """Instantiate the configured backends; driver names must be unique across them."""
    return create_backend_set(config)[0]


def create_backend_set(config: AgentConfig) -> tuple[list[Backend], frozenset[str]]:
    """The configured backends and the driver names of those marked ``optional=true``."""
    backends: list[Backend] = []
    optional: set[str] = set()
    for spec in config.backends:
        factory = load_backend_factory(spec.name)
        settings = dict(spec.backend_settings)
        excluded = parse_exclusions(settings.pop(EXCLUDE_SETTING, ""))
        options = BackendOptions(
            config.node_name,
            spec.driver_name,
            settings,
            state_dir=config.state_dir,
            health_interval=config.health_interval_seconds,
        )
        created = [exclude_devices(backend, excluded) for backend in factory(options)]
        backends.extend(created)
        if spec.optional:
            optional.update(b.driver_name for b in created)
    seen: set[str] = set()
    for backend in backends:
        if backend.driver_name in seen:
            raise ConfigError(
                "--backend",
                backend.driver_name,
                "a distinct driver name per backend (set one with driver=...)",
            )
        seen.add(backend.driver_name)
    return backends, frozenset(optional)


class PartFailures:
    """Which supervised parts keep failing, for ``/healthz`` (liveness).

    A failure starts an episode; failures less than `stable_after` seconds apart continue it.
    A part whose episode has lasted longer than `unhealthy_after` makes the agent unhealthy, so
    the kubelet restarts a pod stuck on something a restart may fix; a part that then runs
    `stable_after` seconds without failing is healthy again.
    """

    def __init__(
        self,
        clock: Clock,
        *,
        unhealthy_after: float = PART_UNHEALTHY_AFTER_SECONDS,
        stable_after: float = PART_STABLE_AFTER_SECONDS,
    ) -> None:
        self._clock = clock
        self.unhealthy_after = unhealthy_after
        self._stable_after = stable_after
        self._episodes: dict[str, tuple[float, float, str]] = {}  # name -> (since, last, error)

    def failed(self, name: str, error: str) -> None:
        """Record one failure of part `name`."""
        now = self._clock.monotonic()
        since, last, _ = self._episodes.get(name, (now, now, ""))
        if now - last > self._stable_after:
            since = now
        self._episodes[name] = (since, now, error)

    def health(self) -> tuple[bool, str]:
        """(healthy, reason): unhealthy while a part has been failing longer than `unhealthy_after`."""
        now = self._clock.monotonic()
        for name, (since, last, error) in sorted(self._episodes.items()):
            if now - last <= self._stable_after and now - since > self.unhealthy_after:
                return False, f"{name} has been failing for {now - since:.0f}s: {error}"
        return True, ""


async def supervise(
    name: str,
    run: Callable[[], Awaitable[None]],
    clock: Clock,
    *,
    initial_backoff: float = 0.5,
    max_backoff: float = 30.0,
    failures: PartFailures | None = None,
) -> None:
    """Run `run` until cancelled; restart it with capped, jittered backoff when it fails or returns."""
    backoff = initial_backoff
    while True:
        started = clock.monotonic()
        try:
            await run()
            log.warning("component stopped; restarting", extra=log_fields(component=name))
            if failures is not None:
                failures.failed(name, "stopped")
        except Exception as error:
            if failures is not None:
                failures.failed(name, f"{type(error).__name__}: {error}")
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
    health_file: Path
    """Where the driver's held health conditions are kept across restarts (`agent.health.persist`)."""

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
        optional: Collection[str] = (),
        unhealthy_after: float = PART_UNHEALTHY_AFTER_SECONDS,
        policy: TaintPolicy | None = None,
    ) -> None:
        self.config = config
        self.readiness = readiness
        self.clock = clock or SystemClock()
        self.metrics = metrics or Metrics()
        if backends is None:
            backends, optional = create_backend_set(config)
        self.backends = list(backends)
        self.optional = frozenset(optional)
        """Driver names that are skipped, not fatal, when their library or devices are absent."""
        self.failures = PartFailures(self.clock, unhealthy_after=unhealthy_after)
        self.policy = policy or TaintPolicy.default()
        self.drivers: dict[str, DriverRuntime] = {}
        for backend in self.backends:
            inventory = Inventory(backend.driver_name)
            tracker = HealthTracker(
                inventory,
                self.clock,
                config.taint_hold_seconds,
                metrics=self.metrics,
                gate_seeds=isinstance(backend, PollsHealth),
                trends=declared_trends(backend),
            )
            health_file = config.state_dir / backend.driver_name / HEALTH_FILE
            self.drivers[backend.driver_name] = DriverRuntime(backend, inventory, tracker, health_file)
        self._parts = parts
        self.started = anyio.Event()

    async def run(self) -> None:
        """Start every backend and part; return only when cancelled (or a required backend cannot start)."""
        started: list[Backend] = []
        try:
            for runtime in list(self.drivers.values()):
                try:
                    await runtime.backend.start()
                    started.append(runtime.backend)
                    devices = await runtime.backend.discover()
                except Exception as error:
                    if runtime.driver in self.optional:
                        # A misconfiguration (e.g. a vendor binding that does not match the host's
                        # library) is worth a warning; a node without the vendor's stack is not.
                        level = logging.WARNING if isinstance(error, ConfigError) else logging.INFO
                        await self._skip(runtime, f"backend cannot start: {error}", started, level)
                        continue
                    if isinstance(error, AgentError):
                        raise
                    raise AgentError(f"backend for {runtime.driver} failed to start: {error}") from error
                if not devices and runtime.driver in self.optional:
                    await self._skip(runtime, "no devices on this node", started)
                    continue
                runtime.inventory.set_devices(devices)
                # Before the monitor's first event: what an earlier process held (a restart after
                # the kubelet wiped the slices has nothing else to restore it from).
                await restore(runtime.tracker, runtime.health_file, self.clock)
                log.info(
                    "backend started",
                    extra=log_fields(driver=runtime.driver, devices=len(runtime.inventory.device_names())),
                )
            if not self.drivers:
                log.warning("no backend serves this node: every backend is optional and absent")
            async with anyio.create_task_group() as tg:
                for runtime in self.drivers.values():
                    self._start_driver(tg, runtime)
                for part in self._parts(self) if self._parts else ():
                    tg.start_soon(self._supervise, part.name, part.run, name=part.name)
                self.started.set()
        finally:
            with anyio.CancelScope(shield=True):
                for backend in reversed(started):
                    await _stop_backend(backend)

    async def _skip(
        self, runtime: DriverRuntime, reason: str, started: list[Backend], level: int = logging.INFO
    ) -> None:
        """Leave out an optional backend that has nothing to serve on this node (said once)."""
        log.log(
            level,
            "optional backend not served on this node",
            extra=log_fields(driver=runtime.driver, reason=reason),
        )
        del self.drivers[runtime.driver]
        self.backends.remove(runtime.backend)
        if runtime.backend in started:
            started.remove(runtime.backend)
            await _stop_backend(runtime.backend)

    async def _supervise(self, name: str, run: Callable[[], Awaitable[None]]) -> None:
        await supervise(name, run, self.clock, failures=self.failures)

    def _start_driver(self, tg: TaskGroup, runtime: DriverRuntime) -> None:
        driver = runtime.driver
        # ``monitor/<driver>`` and the monitor's last-seen gauge follow the health monitor itself.
        liveness = MonitorLiveness(
            driver,
            self.metrics,
            self.clock,
            self.readiness,
            checks=declared_checks(runtime.backend),
            pass_interval=self.config.health_interval_seconds,
        )
        vanished = VanishedDevices(driver)
        writer = HealthFileWriter(
            runtime.tracker,
            runtime.health_file,
            functools.partial(self._effect_of, driver),
            self.clock,
        )

        async def monitor() -> None:
            await liveness.run(
                runtime.backend.monitor_health, runtime.tracker.handle, on_pass=runtime.tracker.pass_completed
            )

        async def rediscover() -> None:
            while True:
                # Spread over [0.5, 1.5) of the interval, as the publisher's resync: out of step in a fleet.
                await self.clock.sleep(self.config.resync_seconds * random.uniform(0.5, 1.5))
                discovered = await runtime.backend.discover()
                devices, events = vanished.merge(
                    runtime.inventory.discovered_devices(), discovered, self.clock.time()
                )
                runtime.inventory.set_devices(devices)
                for event in events:
                    runtime.tracker.record(event)

        parts: list[tuple[str, Callable[[], Awaitable[None]]]] = [
            ("health-monitor", monitor),
            ("health-liveness", liveness.watch),
            ("health-tracker", runtime.tracker.run),
            ("health-file", writer.run),
            ("rediscovery", rediscover),
        ]
        for name, part in parts:
            tg.start_soon(self._supervise, f"{driver}/{name}", part, name=f"{driver}/{name}")

    def _effect_of(self, driver: str, device: str, condition: HealthCondition) -> str | None:
        del device  # the policy is per driver and condition
        return self.policy.effect_for(driver, condition)


async def _stop_backend(backend: Backend) -> None:
    try:
        await backend.stop()
    except Exception as error:  # stop must not mask the real exit reason
        log.warning("backend stop failed", extra=log_fields(driver=backend.driver_name, error=str(error)))


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
