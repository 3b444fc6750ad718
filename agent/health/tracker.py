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
- After a restart: conditions restored from the durable file (`agent.health.persist`) or the
  published taints (`seed`) cannot lift before the backend's first complete health pass has looked
  at their device (`pass_completed`; only for backends that poll, `gate_seeds`). A restored STATE
  condition the pass did not report again counts as cleared at that pass; a restored EVENT
  condition then lifts by its hold as usual. A restored condition keeps the effect it was published
  with (`HealthCondition.held_effect`) until it recurs as a new EVENT.
- Cheap per event: a repeat of an active condition only updates a timestamp; the inventory is
  written only when the set of conditions changes (the publisher debounces API writes), and only
  the changed device's health is rebuilt. A device keeps at most `MAX_CONDITIONS_PER_DEVICE`
  distinct conditions (a storm of ever-new values evicts the mildest, least recently seen one).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace

import anyio

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
    awaiting_pass: bool = False
    """Restored after a restart and not yet looked at by a complete health pass: never lifted."""

    def quiet_since(self) -> float | None:
        """When the hold time started counting; None while it cannot lift (a STATE condition
        still set, or a restored condition no health pass has looked at yet)."""
        if self.awaiting_pass:
            return None
        if self.kind is ConditionKind.STATE:
            return self.cleared_at
        return self.last_seen

    @property
    def recovered(self) -> bool:
        """An EVENT condition the vendor reported recovered: it lifts without waiting for the hold."""
        return self.kind is ConditionKind.EVENT and self.cleared_at is not None and not self.awaiting_pass


@dataclass(frozen=True)
class HeldCondition:
    """A tracked condition with what its hold needs: what `agent.health.persist` keeps across restarts."""

    device: str
    condition: HealthCondition
    kind: ConditionKind
    last_seen: float
    cleared_at: float | None = None


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
        gate_seeds: bool = False,
        trends: Collection[str] = (),
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
        self._gate_seeds = gate_seeds
        self._trends = frozenset(trends)
        self._degraded: set[tuple[str, str]] = set()
        self._changes = 0
        self._changed = anyio.Event()

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
        self._touch()
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
        active.awaiting_pass = False  # the backend has spoken for it
        old = active.condition
        # A recurring EVENT is a new fault: it follows today's policy. A STATE reported again
        # (still lost after a restart) is the fault seen before: it keeps its published effect.
        held_effect = "" if event.kind is ConditionKind.EVENT else old.held_effect
        if (
            old.severity != event.severity
            or old.message != event.message
            or active.kind != event.kind
            or old.held_effect != held_effect
        ):
            active.condition = replace(
                old, severity=event.severity, message=event.message, held_effect=held_effect
            )
            active.kind = event.kind
            self._publish(event.device)
        elif was_cleared:
            log.debug(  # the flap log above already says it at info, once per doubling
                "health condition back before its hold ended",
                extra=log_fields(driver=self.driver, device=event.device, condition=event.condition),
            )

    def seed(
        self,
        device: str,
        condition: HealthCondition,
        *,
        kind: ConditionKind = ConditionKind.EVENT,
        last_seen: float | None = None,
        cleared_at: float | None = None,
        source: str = "the published taints",
    ) -> None:
        """Restore a condition an earlier agent process held (from its file or its taint).

        A published taint is held as an EVENT last seen at ``condition.since`` (its
        ``timeAdded``); the durable file also gives the kind, the last occurrence and a clear.
        With `gate_seeds` it does not lift before a health pass has looked at its device. A
        condition that is already tracked keeps its state, with the earlier ``since``.
        """
        now = self._clock.time()
        since = min(condition.since, now)
        key = (device, condition.condition, condition.value)
        active = self._active.get(key)
        if active is not None:
            if since < active.condition.since:
                active.condition = replace(active.condition, since=since)
                self._touch()
                self._publish(device)
            return
        seen = min(last_seen if last_seen is not None else since, now)
        cleared = min(cleared_at, now) if cleared_at is not None else None
        self._add(
            key,
            _Active(replace(condition, since=since), kind, max(seen, since), cleared, self._gate_seeds),
        )
        self._touch()
        log.info(
            f"health condition restored from {source}",
            extra=log_fields(
                driver=self.driver,
                device=device,
                condition=condition.condition,
                value=condition.value,
                held_until_checked=self._gate_seeds,
            ),
        )
        self._publish(device)

    def pass_completed(self, devices: Collection[str], failed_checks: Collection[str] = ()) -> None:
        """A complete health pass has looked at `devices`: their restored conditions may lift now.

        A restored STATE condition the pass did not report again is over: cleared at this pass,
        lifted after its hold. A restored EVENT condition lifts by its hold from its last occurrence.
        """
        now = self._clock.time()
        looked_at = set(devices)
        for (device, _, _), active in self._active.items():
            if not active.awaiting_pass or device not in looked_at:
                continue
            active.awaiting_pass = False
            self._touch()
            if active.kind is ConditionKind.STATE and active.cleared_at is None:
                active.cleared_at = now

    @property
    def changes(self) -> int:
        """Increases whenever a tracked condition changes (for `agent.health.persist`)."""
        return self._changes

    async def wait_changed(self, seen: int) -> int:
        """Return `changes` once it differs from `seen`."""
        while self._changes == seen:
            await self._changed.wait()
        return self._changes

    def _touch(self) -> None:
        self._changes += 1
        event, self._changed = self._changed, anyio.Event()
        event.set()

    def held(self) -> list[HeldCondition]:
        """Every tracked condition with its hold state, sorted (what a restart must restore)."""
        return [
            HeldCondition(device, a.condition, a.kind, a.last_seen, a.cleared_at)
            for (device, _, _), a in sorted(self._active.items())
        ]

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
                active.awaiting_pass = False
                self._ended[(event.device, condition)] = at
                self._touch()

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
        if lifted:
            self._touch()
        self._forget_old(now)
        forgotten = self._forget_gone(now)
        if forgotten:
            self._touch()
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
        if self._metrics is not None and self._trends:
            self._export_degraded()
        if self._metrics is not None:
            current = self._inventory.health()
            counts = dict.fromkeys(HealthStatus, 0)
            for name in self._inventory.device_names():
                state = current.get(name)
                counts[state.status if state is not None else HealthStatus.HEALTHY] += 1
            for status, count in counts.items():
                self._metrics.devices.labels(self.driver, status.value.lower()).set(count)

    def _export_degraded(self) -> None:
        """``dra_agent_device_degraded``: 1 per device and active trend, 0 for the others, from the
        start (so ``changes()`` sees the first one); series of devices gone are removed."""
        assert self._metrics is not None
        gauge = self._metrics.device_degraded
        names = self._inventory.device_names()
        current = {(d, t) for d in names for t in self._trends}
        for device, trend in self._degraded - current:
            gauge.remove(self.driver, device, trend)
        active = {(d, c) for (d, c, _), a in self._active.items() if c in self._trends}
        for device, trend in current:
            gauge.labels(self.driver, device, trend).set(1 if (device, trend) in active else 0)
        self._degraded = current
