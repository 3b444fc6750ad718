"""What the publisher tells operators after each pass: logs, Events, metrics, readiness detail.

- a device left out of the slices (it breaks an API rule): logged, counted and an Event, once
  per distinct problem;
- a taint added or lifted: logged and an Event;
- taints the server drops (``DRADeviceTaints`` off): the devices are *unpublishable*. One episode
  lasts while at least one device has a taint that cannot be published: it starts with one
  error log naming the gate, one Event and one count of
  ``dra_agent_publish_errors_total{reason="taints_unsupported"}``; the gauge
  ``dra_agent_unpublishable_devices`` says how many devices wait, and the ``published/``
  readiness check carries the detail (the pool itself is published, so it stays ready).
- counters the server drops (``DRAPartitionableDevices`` off): the devices that consume them
  and carry none (MIG placements) are withheld, *unpublishable* the same way (reason
  ``counters_unsupported``, Event ``DeviceCountersUnsupported``), and share the gauge.

Events go to an `EventQueue`, never awaited here.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Protocol

from agent.core.logs import log_fields
from agent.health.taints import DeviceTaint
from agent.kube.events import NORMAL, WARNING
from agent.kube.validation import Problem
from agent.observe.metrics import Metrics

log = logging.getLogger("agent.kube.publisher")  # the publisher's own reports: one logger to filter

TAINTS_GATE = "DRADeviceTaints"
COUNTERS_GATE = "DRAPartitionableDevices"
_NAMES_SHOWN = 5


def _some(names: frozenset[str]) -> str:
    """Up to a few names: a GPU has dozens of placements."""
    shown = sorted(names)[:_NAMES_SHOWN]
    more = len(names) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more else "")


class EventSink(Protocol):
    """Where Events go (`agent.kube.events.EventQueue`)."""

    def post(self, reason: str, message: str, type: str = NORMAL) -> bool: ...


def taint_text(taint: DeviceTaint) -> str:
    """``key=value:Effect``, as kubectl shows taints."""
    return f"{taint.key}{'=' + taint.value if taint.value else ''}:{taint.effect}"


class PoolReport:
    """Reports of one driver's pool; remembers what it already said."""

    def __init__(
        self, driver: str, *, metrics: Metrics | None = None, events: EventSink | None = None
    ) -> None:
        self.driver = driver
        self._metrics = metrics
        self._events = events
        self._rejected: dict[str, str] = {}
        self._published: dict[str, frozenset[DeviceTaint]] = {}
        self._unpublishable: frozenset[str] = frozenset()
        self._withheld: frozenset[str] = frozenset()
        self._gauge_keys: set[tuple[str, str]] = set()

    def _event(self, reason: str, message: str, type: str) -> None:
        if self._events is not None:
            self._events.post(reason, message, type)

    def rejected(self, problems: Sequence[Problem]) -> None:
        """Devices left out of the slices; each distinct problem is reported once."""
        now = {p.device: str(p) for p in problems}
        for problem in problems:
            if self._rejected.get(problem.device) == str(problem):
                continue
            log.error(
                "device left out of the ResourceSlice: it breaks an API server rule",
                extra=log_fields(driver=self.driver, device=problem.device, problem=str(problem)),
            )
            if self._metrics is not None:
                self._metrics.rejected_devices.labels(self.driver, problem.reason).inc()
            self._event(
                "DeviceRejected",
                f"{self.driver}: device {problem.device} is not published: {problem}",
                WARNING,
            )
        self._rejected = now

    def published(self, taints: Mapping[str, Sequence[DeviceTaint]], why: Mapping[str, str]) -> None:
        """The taints now in the slices: log and Event each one added or lifted; set the gauges.

        `why` holds each present device's health message (a device missing from it is gone).
        """
        # Identity without timeAdded, which the API server fills in.
        now = {
            d: frozenset(DeviceTaint(t.key, t.effect, t.value) for t in ts) for d, ts in taints.items() if ts
        }
        for device in sorted(set(now) | set(self._published)):
            before, after = self._published.get(device, frozenset()), now.get(device, frozenset())
            for taint in sorted(after - before, key=taint_text):
                fields = log_fields(
                    driver=self.driver, device=device, taint=taint.key, value=taint.value, effect=taint.effect
                )
                log.info("device tainted", extra=fields)
                message = why.get(device, "")
                self._event(
                    "DeviceTainted",
                    f"{self.driver}: device {device} tainted {taint_text(taint)}"
                    + (f": {message}" if message else ""),
                    WARNING,
                )
            for taint in sorted(before - after, key=taint_text):
                fields = log_fields(
                    driver=self.driver, device=device, taint=taint.key, value=taint.value, effect=taint.effect
                )
                log.info("device taint lifted", extra=fields)
                reason = "the condition cleared" if device in why else "the device is gone"
                self._event(
                    "DeviceTaintLifted",
                    f"{self.driver}: device {device} taint {taint_text(taint)} lifted: {reason}",
                    NORMAL,
                )
        self._published = now
        if self._metrics is not None:
            counts: dict[tuple[str, str], int] = {}
            for device_taints in now.values():
                for t in device_taints:
                    counts[(t.key, t.effect)] = counts.get((t.key, t.effect), 0) + 1
            for key in self._gauge_keys | set(counts):
                self._metrics.taints.labels(self.driver, key[0], key[1]).set(counts.get(key, 0))
            self._gauge_keys |= set(counts)

    def unpublishable(self, taints: Mapping[str, Sequence[DeviceTaint]], server: str) -> str:
        """Devices whose taints the server drops; returns the readiness detail ("" when none)."""
        now = frozenset(d for d, ts in taints.items() if ts)
        names = ", ".join(sorted(now))
        if now and not self._unpublishable:
            log.error(
                f"device taints cannot be published: the API server drops taints from ResourceSlices; "
                f"enable the {TAINTS_GATE} feature gate on kube-apiserver, kube-scheduler and "
                "kube-controller-manager. Until then these devices stay schedulable",
                extra=log_fields(driver=self.driver, devices=names, server=server),
            )
            if self._metrics is not None:
                self._metrics.publish_errors.labels(self.driver, "taints_unsupported").inc()
            self._event(
                "DeviceTaintUnsupported",
                f"{self.driver}: devices {names} should be tainted but the API server drops device taints "
                f"(enable the {TAINTS_GATE} feature gate)",
                WARNING,
            )
        elif self._unpublishable and not now:
            log.info(
                "no device waits for an unpublishable taint any more", extra=log_fields(driver=self.driver)
            )
        self._unpublishable = now
        self._set_gauge()
        if not now:
            return ""
        return f"taints of {len(now)} device(s) cannot be published ({names}): enable the {TAINTS_GATE} gate"

    def counters_unpublishable(self, withheld: Sequence[str], server: str) -> str:
        """Devices withheld because the server drops counters; returns the readiness detail."""
        now = frozenset(withheld)
        names = _some(now)
        if now and not self._withheld:
            log.error(
                "partitionable devices cannot be published: the API server drops shared counters from "
                f"ResourceSlices; enable the {COUNTERS_GATE} feature gate on kube-apiserver and "
                "kube-scheduler. Until then only the whole devices are published",
                extra=log_fields(driver=self.driver, devices=names, count=len(now), server=server),
            )
            if self._metrics is not None:
                self._metrics.publish_errors.labels(self.driver, "counters_unsupported").inc()
            self._event(
                "DeviceCountersUnsupported",
                f"{self.driver}: {len(now)} devices ({names}) are not published: the API server drops "
                f"shared counters (enable the {COUNTERS_GATE} feature gate)",
                WARNING,
            )
        elif self._withheld and not now:
            log.info(
                "no device waits for unpublishable counters any more", extra=log_fields(driver=self.driver)
            )
        self._withheld = now
        self._set_gauge()
        if not now:
            return ""
        return (
            f"{len(now)} device(s) consuming shared counters cannot be published ({names}): "
            f"enable the {COUNTERS_GATE} gate"
        )

    def _set_gauge(self) -> None:
        if self._metrics is not None:
            self._metrics.unpublishable_devices.labels(self.driver).set(
                len(self._unpublishable | self._withheld)
            )
