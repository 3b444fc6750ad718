"""Health tracking: backend health events to device health, with a hold time and flap damping.

Rules (one driver's devices; conditions are keyed by device, condition and value):

- An event makes its condition active at once (``since`` = first occurrence of the episode, which
  stays put while the condition keeps coming back, so taint ``timeAdded`` does not churn).
- Recovery: a condition is lifted once it has been quiet for the hold time (default 60 s). EVENT
  conditions (an XID, an ECC error) count from their last occurrence, unless the vendor reports
  recovery (a clear): then they lift at once. STATE conditions (GPU lost, unmonitored) count from
  the backend's clear and never lift before it. A clear with an empty value clears every value of
  that condition on the device.
- Flap damping: a condition that comes back within `flap_window_seconds` (10 min) of its last
  clear or lift counts as a flap; its hold doubles per flap in the window, capped at
  `max_hold_factor` (8x). Flaps older than the window are forgotten.
- Forgetting: a device that has left the inventory keeps its conditions for one hold time (it may
  come straight back, e.g. a GPU reset), then they are forgotten with its flap history, so a
  device that comes back later starts healthy instead of with conditions nobody will clear.
- Cheap per event: a repeat of an active condition only updates a timestamp; the inventory is
  written only when the set of conditions changes (the publisher debounces API writes), and only
  the changed device's health is rebuilt. A device keeps at most `MAX_CONDITIONS_PER_DEVICE`
  distinct conditions (a storm of ever-new values evicts the mildest, least recently seen one).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, replace

from agent.core.backend import ConditionKind, HealthEvent
from agent.core.clock import Clock
from agent.core.inventory import Inventory
from agent.core.logs import log_fields
from agent.core.model import DeviceHealth, HealthCondition, HealthStatus
from agent.observe.metrics import Metrics

log = logging.getLogger("agent.health.tracker")

DEFAULT_FLAP_WINDOW_SECONDS = 600.0
DEFAULT_MAX_HOLD_FACTOR = 8.0
MAX_CONDITIONS_PER_DEVICE = 64
_MAX_FLAPS_KEPT = 32  # 2**32 is beyond any hold factor; bounds memory and the exponent


@dataclass
class _Active:
    condition: HealthCondition
    kind: ConditionKind
    last_seen: float
    cleared_at: float | None = None

    def quiet_since(self) -> float | None:
        """When the hold time started counting; None while a STATE condition is still set."""
        if self.kind is ConditionKind.STATE:
            return self.cleared_at
        return self.last_seen

    @property
    def recovered(self) -> bool:
        """An EVENT condition the vendor reported recovered: it lifts without waiting for the hold."""
        return self.kind is ConditionKind.EVENT and self.cleared_at is not None


@dataclass(frozen=True)
class ActiveCondition:
    """A tracked condition, for inspection: when it lifts (None: not before a clear)."""

    device: str
    condition: HealthCondition
    kind: ConditionKind
    lifts_at: float | None


class HealthTracker:
    """Keeps the active conditions of one driver's devices and writes their health to the inventory."""

    def __init__(
        self,
        inventory: Inventory,
        clock: Clock,
        hold_seconds: float = 60.0,
        *,
        metrics: Metrics | None = None,
        flap_window_seconds: float = DEFAULT_FLAP_WINDOW_SECONDS,
        max_hold_factor: float = DEFAULT_MAX_HOLD_FACTOR,
        tick_seconds: float | None = None,
    ) -> None:
        self._inventory = inventory
        self._clock = clock
        self._hold = hold_seconds
        self._metrics = metrics
        self._window = flap_window_seconds
        self._max_factor = max(1.0, max_hold_factor)
        self._tick = tick_seconds if tick_seconds is not None else min(1.0, max(hold_seconds / 10, 0.01))
        self._active: dict[tuple[str, str, str], _Active] = {}
        self._by_device: dict[str, dict[tuple[str, str], _Active]] = {}
        self._health: dict[str, DeviceHealth] = {}
        self._evicted = 0
        self._ended: dict[tuple[str, str], float] = {}
        self._flaps: dict[tuple[str, str], deque[float]] = {}
        self._gone_since: dict[str, float] = {}
        self._published_version = -1

    @property
    def driver(self) -> str:
        return self._inventory.driver

    # -- events ---------------------------------------------------------------------------------

    async def handle(self, event: HealthEvent) -> None:
        """The `HealthSink` given to the backend."""
        self.record(event)

    def record(self, event: HealthEvent) -> None:
        """Apply one event (synchronous; `handle` is the async sink around it)."""
        now = self._clock.time()
        at = min(event.at, now) if event.at is not None else now
        if self._metrics is not None:
            self._metrics.health_events.labels(self.driver, event.condition).inc()
        if event.cleared:
            self._clear(event, at)
            return
        key = (event.device, event.condition, event.value)
        active = self._active.get(key)
        if active is None or active.cleared_at is not None:
            self._note_return(event.device, event.condition, at)
        if active is None:
            condition = HealthCondition(event.condition, event.severity, event.value, event.message, at)
            self._add(key, _Active(condition, event.kind, at))
            log.info(
                "health condition raised",
                extra=log_fields(
                    driver=self.driver,
                    device=event.device,
                    condition=event.condition,
                    value=event.value,
                    severity=event.severity.label,
                ),
            )
            self._publish(event.device)
            return
        was_cleared = active.cleared_at is not None
        active.last_seen = max(active.last_seen, at)
        active.cleared_at = None
        old = active.condition
        if old.severity != event.severity or old.message != event.message or active.kind != event.kind:
            active.condition = replace(old, severity=event.severity, message=event.message)
            active.kind = event.kind
            self._publish(event.device)
        elif was_cleared:
            log.debug(  # the flap log above already says it at info, once per doubling
                "health condition back before its hold ended",
                extra=log_fields(driver=self.driver, device=event.device, condition=event.condition),
            )

    def seed(self, device: str, condition: HealthCondition) -> None:
        """Restore a condition an earlier agent process published (its taint, found at start).

        It is held as an EVENT last seen at ``condition.since`` (the taint's ``timeAdded``):
        lifted once the hold time has passed since then, unless the backend reports it again. A
        condition that is already tracked keeps its state, with the earlier ``since``.
        """
        since = min(condition.since, self._clock.time())
        key = (device, condition.condition, condition.value)
        active = self._active.get(key)
        if active is not None:
            if since < active.condition.since:
                active.condition = replace(active.condition, since=since)
                self._publish(device)
            return
        self._add(key, _Active(replace(condition, since=since), ConditionKind.EVENT, since))
        log.info(
            "health condition restored from the published taints",
            extra=log_fields(
                driver=self.driver, device=device, condition=condition.condition, value=condition.value
            ),
        )
        self._publish(device)

    def _add(self, key: tuple[str, str, str], active: _Active) -> None:
        device, condition, value = key
        conditions = self._by_device.setdefault(device, {})
        if len(conditions) >= MAX_CONDITIONS_PER_DEVICE:
            victim = min(conditions.items(), key=lambda kv: (kv[1].condition.severity, kv[1].last_seen))[0]
            del conditions[victim]
            del self._active[(device, *victim)]
            self._evicted += 1
            if self._evicted == 1:
                log.warning(
                    "too many distinct health conditions on a device; dropping the mildest",
                    extra=log_fields(driver=self.driver, device=device, limit=MAX_CONDITIONS_PER_DEVICE),
                )
        conditions[(condition, value)] = active
        self._active[key] = active

    def _remove(self, key: tuple[str, str, str]) -> None:
        device, condition, value = key
        del self._active[key]
        conditions = self._by_device[device]
        del conditions[(condition, value)]
        if not conditions:
            del self._by_device[device]

    def _clear(self, event: HealthEvent, at: float) -> None:
        for (condition, value), active in self._by_device.get(event.device, {}).items():
            if condition != event.condition or (event.value and value != event.value):
                continue
            if active.cleared_at is None:
                active.cleared_at = at
                self._ended[(event.device, condition)] = at

    def _note_return(self, device: str, condition: str, at: float) -> None:
        """Count a flap when a condition returns within the window of its last clear or lift."""
        ended = self._ended.get((device, condition))
        if ended is None or at - ended > self._window:
            return
        before = self.hold_for(device, condition, at)
        # The factor caps after a few flaps: older ones need not be kept.
        flaps = self._flaps.setdefault((device, condition), deque(maxlen=_MAX_FLAPS_KEPT))
        flaps.append(at)
        if self.hold_for(device, condition, at) == before:
            return  # already at the cap: a flap storm logs once, not once per flap
        log.info(
            "health condition flapping; holding longer",
            extra=log_fields(
                driver=self.driver,
                device=device,
                condition=condition,
                hold_seconds=self.hold_for(device, condition, at),
            ),
        )

    # -- hold and expiry ------------------------------------------------------------------------

    def hold_for(self, device: str, condition: str, at: float) -> float:
        """The hold time of `condition` on `device` for a quiet period starting at `at`."""
        flaps = self._flaps.get((device, condition))
        if not flaps:
            return self._hold
        count = sum(1 for t in flaps if at - self._window <= t <= at)
        return self._hold * min(2.0 ** min(count, _MAX_FLAPS_KEPT), self._max_factor)

    def expire(self) -> None:
        """Lift the conditions whose hold time has passed; refresh the inventory when needed."""
        now = self._clock.time()
        lifted = []
        for key, active in self._active.items():
            quiet = active.quiet_since()
            if active.recovered or (
                quiet is not None and now - quiet >= self.hold_for(key[0], key[1], quiet)
            ):
                lifted.append(key)
        for key in lifted:
            device, condition, value = key
            self._remove(key)
            self._ended[(device, condition)] = now
            log.info(
                "health condition lifted",
                extra=log_fields(driver=self.driver, device=device, condition=condition, value=value),
            )
        self._forget_old(now)
        forgotten = self._forget_gone(now)
        if lifted or forgotten or self._inventory.version != self._published_version:
            self._publish(*{key[0] for key in lifted}, *forgotten)

    def _forget_old(self, now: float) -> None:
        horizon = now - self._window
        for key in [k for k, t in self._ended.items() if t < horizon]:
            del self._ended[key]
        for key, flaps in list(self._flaps.items()):
            while flaps and flaps[0] < horizon:
                flaps.popleft()
            if not flaps:
                del self._flaps[key]

    def _forget_gone(self, now: float) -> list[str]:
        """Forget the conditions of devices out of the inventory for longer than the hold time."""
        if not self._inventory.discovered:
            return []  # nothing is known to be gone before the first discovery
        present = self._inventory.device_names()
        for device in [d for d in self._gone_since if d in present or d not in self._by_device]:
            del self._gone_since[device]
        forgotten = []
        for device in [d for d in self._by_device if d not in present]:
            gone = self._gone_since.setdefault(device, now)
            if now - gone < self._hold:
                continue
            for condition, value in list(self._by_device[device]):
                self._remove((device, condition, value))
                self._ended.pop((device, condition), None)
                self._flaps.pop((device, condition), None)
            del self._gone_since[device]
            forgotten.append(device)
            log.info(
                "health conditions of a vanished device forgotten",
                extra=log_fields(driver=self.driver, device=device, gone_seconds=round(now - gone, 1)),
            )
        return forgotten

    async def run(self) -> None:
        """Expire conditions until cancelled."""
        while True:
            await self._clock.sleep(self._tick)
            self.expire()

    # -- output ---------------------------------------------------------------------------------

    def active(self) -> list[ActiveCondition]:
        """The tracked conditions, sorted by device, for inspection and tests."""
        out = []
        for (device, condition, _), active in sorted(self._active.items()):
            quiet = active.quiet_since()
            lifts_at = None if quiet is None else quiet + self.hold_for(device, condition, quiet)
            out.append(ActiveCondition(device, active.condition, active.kind, lifts_at))
        return out

    def health(self) -> Mapping[str, DeviceHealth]:
        """Device health from the active conditions (worst first, then by name and value)."""
        return dict(self._health)

    def _device_health(self, device: str) -> DeviceHealth | None:
        conditions = [a.condition for a in self._by_device.get(device, {}).values()]
        if not conditions:
            return None
        return DeviceHealth(tuple(sorted(conditions, key=lambda c: (-c.severity, c.condition, c.value))))

    def _publish(self, *devices: str) -> None:
        """Rebuild the health of `devices` (only they changed) and hand it all to the inventory."""
        for device in devices:
            health = self._device_health(device)
            if health is None:
                self._health.pop(device, None)
            else:
                self._health[device] = health
        self._inventory.set_health(self._health)
        self._published_version = self._inventory.version
        if self._metrics is not None:
            current = self._inventory.health()
            counts = dict.fromkeys(HealthStatus, 0)
            for name in self._inventory.device_names():
                state = current.get(name)
                counts[state.status if state is not None else HealthStatus.HEALTHY] += 1
            for status, count in counts.items():
                self._metrics.devices.labels(self.driver, status.value.lower()).set(count)
