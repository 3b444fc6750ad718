"""Telemetry poller and health-monitor liveness of one driver.

`TelemetryPoller` reads a backend's device counters on an interval into the Prometheus gauges.
The backend does its vendor calls in a worker thread, so a slow read delays only the next read,
never a prepare call. Gauges carry ``driver, pool, device, UUID, pci_bus_id, product`` (pool =
node name; the rest from the inventory's `Device`). A field the device cannot report (None)
has no series rather than a stale one; series of vanished devices are removed; when a read
fails, the driver's telemetry series are removed too (stale figures mislead more than gaps).
Three failed reads in a row turn the readiness check ``telemetry/<driver>`` false.

`MonitorLiveness` follows the health monitor itself: every event and every turn of its loop
(`agent.core.backend.report_alive`) stamps ``dra_agent_health_monitor_last_seen_timestamp_seconds``
and makes ``monitor/<driver>`` ready; a monitor that fails, stops or stays silent for
`SILENCE_LIMIT` seconds turns it false.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection, Sequence

from prometheus_client import Gauge

from agent.core.backend import Backend, DeviceTelemetry, HealthEvent, HealthSink, declared_conditions
from agent.core.clock import Clock, SystemClock
from agent.core.inventory import Inventory
from agent.core.logs import log_fields
from agent.observe.metrics import HEALTH_LABELS, Metrics
from agent.observe.readiness import Readiness

log = logging.getLogger("agent.observe.telemetry")

LabelValues = tuple[str, str, str, str, str, str]
PassCallback = Callable[[Collection[str], Collection[str]], None]
"""Told of each complete health pass: the devices it looked at, the checks that failed."""
FAILURES_BEFORE_NOT_READY = 3
SILENCE_LIMIT = 60.0
"""Seconds without a sign of life after which the health monitor counts as hung (monitors
report on every turn of their loop: every event wait, about twice a second)."""


def _fields(metrics: Metrics) -> tuple[tuple[Gauge, Callable[[DeviceTelemetry], float | None]], ...]:
    return (
        (metrics.gpu_utilization, lambda t: t.utilization_ratio),
        (metrics.memory_used, lambda t: t.memory_used_bytes),
        (metrics.memory_total, lambda t: t.memory_total_bytes),
        (metrics.temperature, lambda t: t.temperature_celsius),
        (metrics.power, lambda t: t.power_watts),
        (metrics.ecc_corrected, lambda t: t.ecc_corrected_total),
        (metrics.ecc_uncorrected, lambda t: t.ecc_uncorrected_total),
        (metrics.last_error_code, lambda t: t.last_error_code),
    )


def update_device_counts(metrics: Metrics, inventory: Inventory) -> None:
    """Set `metrics.devices` for the inventory's driver: devices by health (all labels, zeros too)."""
    counts = dict.fromkeys(HEALTH_LABELS, 0)
    for device in inventory.devices():
        counts[device.health.status.value.lower()] += 1
    for health, count in counts.items():
        metrics.devices.labels(inventory.driver, health).set(count)


class MonitorLiveness:
    """Whether one driver's health monitor works: ``monitor/<driver>`` and its last-seen gauge."""

    def __init__(
        self,
        driver: str,
        metrics: Metrics,
        clock: Clock,
        readiness: Readiness | None = None,
        *,
        silence_limit: float = SILENCE_LIMIT,
        checks: Sequence[str] = (),
        pass_interval: float | None = None,
    ) -> None:
        self.driver = driver
        self.metrics = metrics
        self.clock = clock
        self.readiness = readiness
        self.silence_limit = silence_limit
        self._last: float | None = None
        self._failing: set[str] = set()
        if readiness is not None:
            readiness.expect(self.check)
        for check in checks:
            metrics.health_check_failures.labels(driver, check)
        if checks and pass_interval is not None:
            # Only backends that poll have passes: the stale-pass alert compares the two.
            metrics.health_pass_interval.labels(driver).set(pass_interval)
            metrics.health_pass_completed.labels(driver)

    @property
    def check(self) -> str:
        """The readiness check: ``monitor/<driver>``."""
        return f"monitor/{self.driver}"

    def alive(self) -> None:
        """The monitor answered (an event, or a turn of its loop)."""
        self._last = self.clock.monotonic()
        self.metrics.monitor_last_seen.labels(self.driver).set(self.clock.time())
        if self.readiness is not None:
            self.readiness.set(self.check, True)

    def pass_completed(self, devices: Collection[str], failed_checks: Collection[str]) -> None:
        """A health pass ended (`agent.core.backend.report_pass`): stamp it, count its failed checks."""
        self.alive()
        self.metrics.health_pass_completed.labels(self.driver).set(self.clock.time())
        failed = set(failed_checks)
        for check in sorted(failed):
            self.metrics.health_check_failures.labels(self.driver, check).inc()
        for check in sorted(failed - self._failing):
            log.warning(
                "health check failing (the check, not the GPU: a vendor call hung or errored)",
                extra=log_fields(driver=self.driver, check=check),
            )
        for check in sorted(self._failing - failed):
            log.info("health check works again", extra=log_fields(driver=self.driver, check=check))
        self._failing = failed

    def sink(self, sink: HealthSink, on_pass: PassCallback | None = None) -> HealthSink:
        """`sink`, with each event and each `report_alive` marking the monitor alive, and each
        `report_pass` stamped here and handed to `on_pass`."""
        return _LiveSink(self, sink, on_pass)

    async def run(
        self,
        monitor: Callable[[HealthSink], Awaitable[None]],
        sink: HealthSink,
        *,
        on_pass: PassCallback | None = None,
    ) -> None:
        """Run `monitor(self.sink(sink))`; its failure or return turns the check false (and goes on up)."""
        try:
            await monitor(self.sink(sink, on_pass))
        except Exception as error:
            self._not_ready(f"the health monitor failed: {type(error).__name__}: {error}")
            raise
        self._not_ready("the health monitor stopped")

    async def watch(self) -> None:
        """Until cancelled: turn the check false when the monitor is silent longer than `silence_limit`."""
        while True:
            await self.clock.sleep(self.silence_limit / 4)
            if self._last is not None and self.clock.monotonic() - self._last > self.silence_limit:
                self._not_ready(f"no sign of life from the health monitor for over {self.silence_limit:g} s")

    def _not_ready(self, detail: str) -> None:
        self._last = None  # until it answers again
        if self.readiness is not None:
            self.readiness.set(self.check, False, detail)


class _LiveSink:
    """A `HealthSink` that marks the monitor alive on every event and every `report_alive`."""

    def __init__(self, liveness: MonitorLiveness, sink: HealthSink, on_pass: PassCallback | None) -> None:
        self._liveness = liveness
        self._sink = sink
        self._on_pass = on_pass

    async def __call__(self, event: HealthEvent) -> None:
        self._liveness.alive()
        await self._sink(event)

    def alive(self) -> None:
        self._liveness.alive()

    def pass_completed(self, devices: Collection[str], failed_checks: Collection[str]) -> None:
        self._liveness.pass_completed(devices, failed_checks)
        if self._on_pass is not None:
            self._on_pass(devices, failed_checks)


class TelemetryPoller:
    """Polls one backend's telemetry into `Metrics`; `run` until cancelled."""

    def __init__(
        self,
        backend: Backend,
        inventory: Inventory,
        metrics: Metrics,
        *,
        node_name: str,
        interval: float = 10.0,
        clock: Clock | None = None,
        readiness: Readiness | None = None,
    ) -> None:
        self.backend = backend
        self.inventory = inventory
        self.metrics = metrics
        self.node_name = node_name
        self.interval = interval
        self.clock = clock or SystemClock()
        self.readiness = readiness
        self.failures = 0
        self._series: dict[Gauge, set[LabelValues]] = {}
        self._fields = _fields(metrics)
        metrics.init_driver(backend.driver_name, declared_conditions(backend))
        if readiness is not None:
            readiness.expect(self.check)

    @property
    def check(self) -> str:
        """The readiness check this poller sets: ``telemetry/<driver>``."""
        return f"telemetry/{self.backend.driver_name}"

    async def run(self) -> None:
        """Poll every `interval` seconds until cancelled; a failed read is logged and retried."""
        while True:
            await self.poll_once()
            await self.clock.sleep(self.interval)

    async def poll_once(self) -> bool:
        """Read the telemetry once and update the gauges; False when the read failed."""
        driver = self.backend.driver_name
        update_device_counts(self.metrics, self.inventory)
        started = self.clock.monotonic()
        try:
            readings = await self.backend.telemetry()
        except Exception as error:
            self.failures += 1
            self.metrics.telemetry_errors.labels(driver).inc()
            self._replace_series({})
            log.warning(
                "telemetry read failed",
                extra=log_fields(
                    driver=driver, error=f"{type(error).__name__}: {error}", failures=self.failures
                ),
            )
            if self.readiness is not None and self.failures >= FAILURES_BEFORE_NOT_READY:
                self.readiness.set(
                    self.check, False, f"{self.failures} telemetry reads failed in a row: {error}"
                )
            return False
        finally:
            self.metrics.telemetry_read_seconds.labels(driver).observe(self.clock.monotonic() - started)
        self.failures = 0
        if self.readiness is not None:
            self.readiness.set(self.check, True)
        self._replace_series(self._values(readings))
        return True

    def _values(self, readings: Sequence[DeviceTelemetry]) -> dict[Gauge, dict[LabelValues, float]]:
        devices = {d.name: d for d in self.inventory.devices()}
        values: dict[Gauge, dict[LabelValues, float]] = {gauge: {} for gauge, _ in self._fields}
        for reading in readings:
            device = devices.get(reading.device)
            if device is None:
                # Telemetry of a device not (or no longer) published: no labels to give it.
                log.debug(
                    "telemetry for an unknown device ignored",
                    extra=log_fields(driver=self.backend.driver_name, device=reading.device),
                )
                continue
            labels: LabelValues = (
                self.backend.driver_name,
                self.node_name,
                device.name,
                device.uuid,
                device.pci_bus_id,
                device.product,
            )
            for gauge, read in self._fields:
                value = read(reading)
                if value is not None:
                    values[gauge][labels] = float(value)
        return values

    def _replace_series(self, values: dict[Gauge, dict[LabelValues, float]]) -> None:
        for gauge, _ in self._fields:
            current = values.get(gauge, {})
            for labels in self._series.get(gauge, set()) - current.keys():
                gauge.remove(*labels)
            for labels, value in current.items():
                gauge.labels(*labels).set(value)
            self._series[gauge] = set(current)
