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
- sharing fields the server drops (``DRAConsumableCapacity`` off: ``allowMultipleAllocations``
  and ``requestPolicy``): the shareable devices are published for exclusive use, *unpublishable*
  as shares the same way (reason ``shares_unsupported``, Event ``DeviceSharesUnsupported``).

Each of the three is an `Unsupported` told through one `PoolReport.episode`.

Events go to an `EventQueue`, never awaited here.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from agent.core.logs import log_fields
from agent.health.taints import DeviceTaint
from agent.kube.events import NORMAL, WARNING
from agent.kube.validation import Problem
from agent.observe.metrics import Metrics

log = logging.getLogger("agent.kube.publisher")  # the publisher's own reports: one logger to filter

TAINTS_GATE = "DRADeviceTaints"
COUNTERS_GATE = "DRAPartitionableDevices"
SHARES_GATE = "DRAConsumableCapacity"
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


@dataclass(frozen=True)
class Unsupported:
    """Something the API server drops from slices while a feature gate is off, and how its episode
    is told. The texts are formatted with ``driver``, ``count``, ``names`` and ``gate``."""

    reason: str
    """The ``dra_agent_publish_errors_total`` reason."""
    event: str
    gate: str
    error: str
    """The error logged when the episode starts."""
    event_text: str
    over: str
    """The line logged when the episode ends."""
    detail: str
    """The readiness detail while it lasts."""
    all_names: bool = False
    """Name every device (else a few: a GPU has dozens of placements)."""


TAINTS = Unsupported(
    reason="taints_unsupported",
    event="DeviceTaintUnsupported",
    gate=TAINTS_GATE,
    error="device taints cannot be published: the API server drops taints from ResourceSlices; "
    "enable the {gate} feature gate on kube-apiserver, kube-scheduler and kube-controller-manager. "
    "Until then these devices stay schedulable",
    event_text="{driver}: devices {names} should be tainted but the API server drops device taints "
    "(enable the {gate} feature gate)",
    over="no device waits for an unpublishable taint any more",
    detail="taints of {count} device(s) cannot be published ({names}): enable the {gate} gate",
    all_names=True,
)
COUNTERS = Unsupported(
    reason="counters_unsupported",
    event="DeviceCountersUnsupported",
    gate=COUNTERS_GATE,
    error="partitionable devices cannot be published: the API server drops shared counters from "
    "ResourceSlices; enable the {gate} feature gate on kube-apiserver and kube-scheduler. Until then "
    "only the whole devices are published",
    event_text="{driver}: {count} devices ({names}) are not published: the API server drops shared "
    "counters (enable the {gate} feature gate)",
    over="no device waits for unpublishable counters any more",
    detail="{count} device(s) consuming shared counters cannot be published ({names}): "
    "enable the {gate} gate",
)
SHARES = Unsupported(
    reason="shares_unsupported",
    event="DeviceSharesUnsupported",
    gate=SHARES_GATE,
    error="shareable devices cannot be published as such: the API server drops allowMultipleAllocations "
    "and requestPolicy from ResourceSlices; enable the {gate} feature gate on kube-apiserver, "
    "kube-scheduler, kube-controller-manager and the kubelet. Until then these devices are published "
    "for exclusive use, one claim each",
    event_text="{driver}: {count} devices ({names}) are published for exclusive use: the API server drops "
    "allowMultipleAllocations and requestPolicy (enable the {gate} feature gate)",
    over="no device waits for unpublishable shares any more",
    detail="{count} device(s) cannot be published shareable ({names}): enable the {gate} gate",
)


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
        self._episodes: dict[str, frozenset[str]] = {}
        """Devices affected, per `Unsupported.reason` (empty: no episode)."""
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
        return self.episode(TAINTS, (d for d, ts in taints.items() if ts), server)

    def counters_unpublishable(self, withheld: Sequence[str], server: str) -> str:
        """Devices withheld because the server drops counters; returns the readiness detail."""
        return self.episode(COUNTERS, withheld, server)

    def episode(self, what: Unsupported, devices: Iterable[str], server: str) -> str:
        """`devices` affected by `what` now: an error, a count and an Event when an episode starts,
        a line when it ends; sets the gauge; returns the readiness detail ("" when none)."""
        now = frozenset(devices)
        before = self._episodes.get(what.reason, frozenset())
        texts = {
            "driver": self.driver,
            "count": len(now),
            "names": ", ".join(sorted(now)) if what.all_names else _some(now),
            "gate": what.gate,
        }
        if now and not before:
            log.error(
                what.error.format(**texts),
                extra=log_fields(driver=self.driver, devices=texts["names"], count=len(now), server=server),
            )
            if self._metrics is not None:
                self._metrics.publish_errors.labels(self.driver, what.reason).inc()
            self._event(what.event, what.event_text.format(**texts), WARNING)
        elif before and not now:
            log.info(what.over, extra=log_fields(driver=self.driver))
        self._episodes[what.reason] = now
        self._set_gauge()
        return what.detail.format(**texts) if now else ""

    def _set_gauge(self) -> None:
        if self._metrics is not None:
            self._metrics.unpublishable_devices.labels(self.driver).set(
                len(frozenset().union(*self._episodes.values()))
            )
