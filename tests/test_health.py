"""The health tracker: conditions raised at once, lifted after the hold, flapping held longer."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest

from agent.core.backend import ConditionKind, HealthEvent
from agent.core.inventory import Inventory
from agent.core.model import Device, HealthStatus, Severity
from agent.health.taints import ClusterTaintSupport, DeviceTaint, TaintPolicy
from agent.health.tracker import HealthTracker
from agent.observe.metrics import Metrics
from tests.support.clock import FakeClock

DRIVER = "gpu.example.com"


def make(clock: FakeClock, hold: float = 60.0, **kwargs: float) -> tuple[Inventory, HealthTracker]:
    inventory = Inventory(DRIVER)
    inventory.set_devices([Device(f"gpu-{i}", DRIVER) for i in range(4)])
    return inventory, HealthTracker(inventory, clock, hold, **kwargs)  # type: ignore[arg-type]


def xid(value: str = "79", device: str = "gpu-1", severity: Severity = Severity.CRITICAL) -> HealthEvent:
    return HealthEvent(device, "xid", severity, value)


def lost(device: str = "gpu-2", cleared: bool = False) -> HealthEvent:
    return HealthEvent(device, "gpu-lost", Severity.CRITICAL, kind=ConditionKind.STATE, cleared=cleared)


def conditions(inventory: Inventory, device: str) -> list[tuple[str, str]]:
    health = inventory.health().get(device)
    return [(c.condition, c.value) for c in health.conditions] if health else []


async def test_event_condition_raised_then_lifted_after_hold(fake_clock: FakeClock) -> None:
    inventory, tracker = make(fake_clock)
    start = fake_clock.time()
    await tracker.handle(xid())
    assert conditions(inventory, "gpu-1") == [("xid", "79")]
    assert inventory.health()["gpu-1"].status is HealthStatus.UNHEALTHY
    assert inventory.health()["gpu-1"].conditions[0].since == start
    fake_clock.advance(30)
    await tracker.handle(xid())  # a repeat pushes the hold out, keeps `since`
    fake_clock.advance(59)
    tracker.expire()
    assert conditions(inventory, "gpu-1") == [("xid", "79")]
    assert inventory.health()["gpu-1"].conditions[0].since == start
    fake_clock.advance(1)
    tracker.expire()
    assert "gpu-1" not in inventory.health()


async def test_state_condition_waits_for_its_clear(fake_clock: FakeClock) -> None:
    inventory, tracker = make(fake_clock, hold=10)
    await tracker.handle(lost())
    fake_clock.advance(1000)
    tracker.expire()
    assert conditions(inventory, "gpu-2") == [("gpu-lost", "")]
    await tracker.handle(lost(cleared=True))
    fake_clock.advance(9.5)
    tracker.expire()
    assert conditions(inventory, "gpu-2") == [("gpu-lost", "")]
    fake_clock.advance(0.5)
    tracker.expire()
    assert "gpu-2" not in inventory.health()


async def test_clear_without_value_clears_every_value(fake_clock: FakeClock) -> None:
    inventory, tracker = make(fake_clock, hold=5)
    for value in ("a", "b"):
        await tracker.handle(HealthEvent("gpu-0", "ecc", Severity.CRITICAL, value, kind=ConditionKind.STATE))
    await tracker.handle(
        HealthEvent("gpu-0", "ecc", Severity.CRITICAL, "b", kind=ConditionKind.STATE, cleared=True)
    )
    fake_clock.advance(5)
    tracker.expire()
    assert conditions(inventory, "gpu-0") == [("ecc", "a")]
    await tracker.handle(
        HealthEvent("gpu-0", "ecc", Severity.CRITICAL, kind=ConditionKind.STATE, cleared=True)
    )
    fake_clock.advance(5)
    tracker.expire()
    assert "gpu-0" not in inventory.health()


async def test_clear_of_an_unknown_condition_is_harmless(fake_clock: FakeClock) -> None:
    inventory, tracker = make(fake_clock)
    version = inventory.version
    await tracker.handle(lost("gpu-3", cleared=True))
    tracker.expire()
    assert inventory.version == version
    assert not tracker.active()


async def test_worst_first_and_status(fake_clock: FakeClock) -> None:
    inventory, tracker = make(fake_clock)
    await tracker.handle(HealthEvent("gpu-0", "thermal-throttle", Severity.INFO))
    assert inventory.health()["gpu-0"].status is HealthStatus.HEALTHY
    await tracker.handle(HealthEvent("gpu-0", "unmonitored", Severity.WARNING, kind=ConditionKind.STATE))
    assert inventory.health()["gpu-0"].status is HealthStatus.UNKNOWN
    await tracker.handle(xid(device="gpu-0"))
    health = inventory.health()["gpu-0"]
    assert health.status is HealthStatus.UNHEALTHY
    assert [c.condition for c in health.conditions] == ["xid", "unmonitored", "thermal-throttle"]
    assert health.message.startswith("xid=79")


async def test_severity_change_is_published(fake_clock: FakeClock) -> None:
    inventory, tracker = make(fake_clock)
    await tracker.handle(xid("13", severity=Severity.INFO))
    await tracker.handle(xid("13", severity=Severity.CRITICAL))
    assert inventory.health()["gpu-1"].conditions[0].severity is Severity.CRITICAL


async def test_future_timestamps_are_clamped(fake_clock: FakeClock) -> None:
    inventory, tracker = make(fake_clock, hold=10)
    await tracker.handle(HealthEvent("gpu-1", "xid", Severity.CRITICAL, "79", at=fake_clock.time() + 3600))
    assert inventory.health()["gpu-1"].conditions[0].since == fake_clock.time()
    fake_clock.advance(10)
    tracker.expire()
    assert not inventory.health()


async def test_past_timestamps_count(fake_clock: FakeClock) -> None:
    inventory, tracker = make(fake_clock, hold=10)
    await tracker.handle(HealthEvent("gpu-1", "xid", Severity.CRITICAL, "79", at=fake_clock.time() - 8))
    fake_clock.advance(2)
    tracker.expire()
    assert not inventory.health()


async def test_flapping_is_held_longer_and_capped(fake_clock: FakeClock) -> None:
    inventory, tracker = make(fake_clock, hold=10)
    holds = []
    for _ in range(6):
        await tracker.handle(xid())
        (active,) = tracker.active()
        assert active.lifts_at is not None
        holds.append(round(active.lifts_at - fake_clock.time()))
        fake_clock.advance(active.lifts_at - fake_clock.time())
        tracker.expire()
        assert not inventory.health()
        fake_clock.advance(5)  # back within the window
    assert holds == [10, 20, 40, 80, 80, 80]


async def test_flaps_are_forgotten_after_the_window(fake_clock: FakeClock) -> None:
    _, tracker = make(fake_clock, hold=10, flap_window_seconds=100)
    await tracker.handle(xid())
    fake_clock.advance(10)
    tracker.expire()
    await tracker.handle(xid())
    assert tracker.active()[0].lifts_at == fake_clock.time() + 20
    fake_clock.advance(20)
    tracker.expire()
    fake_clock.advance(101)
    tracker.expire()
    await tracker.handle(xid())
    assert tracker.active()[0].lifts_at == fake_clock.time() + 10


async def test_state_flapping_during_the_hold(fake_clock: FakeClock) -> None:
    inventory, tracker = make(fake_clock, hold=10)
    since = fake_clock.time()
    await tracker.handle(lost())
    await tracker.handle(lost(cleared=True))
    fake_clock.advance(5)
    await tracker.handle(lost())  # back before the hold ended: a flap
    await tracker.handle(lost(cleared=True))
    (active,) = tracker.active()
    assert active.lifts_at == fake_clock.time() + 20
    assert active.condition.since == since  # never lifted: timeAdded stays
    fake_clock.advance(19)
    tracker.expire()
    assert conditions(inventory, "gpu-2") == [("gpu-lost", "")]
    fake_clock.advance(1)
    tracker.expire()
    assert not inventory.health()


async def test_storm_is_cheap_and_writes_once(fake_clock: FakeClock) -> None:
    inventory, tracker = make(fake_clock)
    version = inventory.version
    for i in range(10_000):
        await tracker.handle(xid())
        if i % 1000 == 0:
            fake_clock.advance(1)
    assert inventory.version == version + 1
    assert len(tracker.active()) == 1


async def test_metrics(fake_clock: FakeClock) -> None:
    metrics = Metrics()
    inventory = Inventory(DRIVER)
    inventory.set_devices([Device(f"gpu-{i}", DRIVER) for i in range(4)])
    tracker = HealthTracker(inventory, fake_clock, 10, metrics=metrics)
    await tracker.handle(xid())
    await tracker.handle(xid())
    await tracker.handle(HealthEvent("gpu-0", "unmonitored", Severity.WARNING, kind=ConditionKind.STATE))

    def sample(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, {"driver": DRIVER, **labels})

    assert sample("dra_agent_health_events_total", condition="xid") == 2
    assert sample("dra_agent_devices", health="unhealthy") == 1
    assert sample("dra_agent_devices", health="unknown") == 1
    assert sample("dra_agent_devices", health="healthy") == 2
    fake_clock.advance(10)
    tracker.expire()
    assert sample("dra_agent_devices", health="unhealthy") == 0
    assert sample("dra_agent_devices", health="healthy") == 3


async def test_rediscovered_device_gets_its_health_back(fake_clock: FakeClock) -> None:
    inventory, tracker = make(fake_clock)
    await tracker.handle(lost("gpu-3"))
    inventory.set_devices([Device(f"gpu-{i}", DRIVER) for i in range(3)])  # fell off the bus
    tracker.expire()
    assert "gpu-3" not in inventory.health()
    await tracker.handle(lost("gpu-3", cleared=True))
    inventory.set_devices([Device(f"gpu-{i}", DRIVER) for i in range(4)])  # back
    tracker.expire()
    assert conditions(inventory, "gpu-3") == [("gpu-lost", "")]  # held after the recovery


async def test_run_expires_on_its_tick(fake_clock: FakeClock) -> None:
    inventory, tracker = make(fake_clock, hold=1)
    await tracker.handle(xid())
    async with anyio.create_task_group() as tg:
        tg.start_soon(tracker.run)
        for _ in range(12):
            for _ in range(5):
                await anyio.lowlevel.checkpoint()
            fake_clock.advance(0.1)
        for _ in range(5):
            await anyio.lowlevel.checkpoint()
        assert not inventory.health()
        tg.cancel_scope.cancel()


@pytest.mark.parametrize("hold", [0.05, 60.0, 3600.0])
def test_tick_is_bounded(fake_clock: FakeClock, hold: float) -> None:
    _, tracker = make(fake_clock, hold=hold)
    assert 0.01 <= tracker._tick <= 1.0


async def test_fake_fault_to_taint_and_back(fake_clock: FakeClock) -> None:
    """inject -> HealthEvent -> tracker -> inventory health -> taints; lifted after the hold."""
    from tests.fake.helpers import make_backends, settle

    (nvidia, _), injector = make_backends(clock=fake_clock)
    inventory = Inventory(nvidia.driver_name)
    inventory.set_devices(await nvidia.discover())
    tracker = HealthTracker(inventory, fake_clock, 60)
    policy = TaintPolicy.default()
    support = ClusterTaintSupport(4, False)
    async with anyio.create_task_group() as tg:
        tg.start_soon(nvidia.monitor_health, tracker.handle)
        await injector.inject("gpu-3", "xid", "79")
        await injector.inject("gpu-2", "xid", "13")  # application XID: informational
        await settle()
        taints = policy.taint_map(inventory.devices(), support)
        assert taints == {
            "gpu-3": (DeviceTaint("gpu.nvidia.com/xid", "NoSchedule", "79", "2023-11-14T22:13:20Z"),)
        }
        await injector.lose("gpu-1")
        await settle()
        assert set(policy.taint_map(inventory.devices(), support)) == {"gpu-1", "gpu-3"}
        await injector.recover("gpu-1")
        await injector.recover("gpu-3")
        await settle()
        # A recovery report lifts the XID (an event) at once; the lost GPU (a state) waits the hold.
        tracker.expire()
        assert set(policy.taint_map(inventory.devices(), support)) == {"gpu-1"}
        fake_clock.advance(59)
        tracker.expire()
        assert set(policy.taint_map(inventory.devices(), support)) == {"gpu-1"}
        fake_clock.advance(1)
        tracker.expire()
        assert policy.taint_map(inventory.devices(), support) == {}
        tg.cancel_scope.cancel()


async def test_ever_new_values_are_capped_per_device(
    fake_clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    from agent.health.tracker import MAX_CONDITIONS_PER_DEVICE

    inventory, tracker = make(fake_clock)
    await tracker.handle(lost("gpu-1"))
    for i in range(MAX_CONDITIONS_PER_DEVICE * 3):
        await tracker.handle(xid(str(i), severity=Severity.WARNING))
        fake_clock.advance(0.01)
    health = inventory.health()["gpu-1"]
    assert len(health.conditions) == MAX_CONDITIONS_PER_DEVICE
    assert health.conditions[0].condition == "gpu-lost"  # the critical one is kept
    assert {c.value for c in health.conditions[1:]} == {str(i) for i in range(129, 192)}
    assert sum("too many distinct health conditions" in r.getMessage() for r in caplog.records) == 1
    fake_clock.advance(60)
    tracker.expire()
    assert conditions(inventory, "gpu-1") == [("gpu-lost", "")]


async def test_vendor_recovery_report_lifts_an_event_condition_at_once(fake_clock: FakeClock) -> None:
    inventory, tracker = make(fake_clock)
    await tracker.handle(xid())
    await tracker.handle(HealthEvent("gpu-1", "xid", Severity.CRITICAL, "79", cleared=True))
    tracker.expire()
    assert "gpu-1" not in inventory.health()
    # Coming back after the report is a flap: the next hold is longer.
    await tracker.handle(xid())
    assert tracker.active()[0].lifts_at == fake_clock.time() + 120


async def test_endless_flapping_neither_overflows_nor_floods_the_log(
    fake_clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    inventory, tracker = make(fake_clock, hold=1)
    caplog.set_level("INFO", logger="agent.health.tracker")
    for _ in range(2000):
        await tracker.handle(lost())
        await tracker.handle(lost(cleared=True))
        fake_clock.advance(0.1)
    (active,) = tracker.active()
    assert active.lifts_at is not None and active.lifts_at - fake_clock.time() <= 8.0
    flapping = [r for r in caplog.records if "flapping" in r.getMessage()]
    assert 1 <= len(flapping) <= 3  # once per doubling, then quiet at the cap
    assert conditions(inventory, "gpu-2") == [("gpu-lost", "")]


async def test_conditions_of_a_device_gone_longer_than_the_hold_are_forgotten(fake_clock: FakeClock) -> None:
    """Issue 13: a device back after the hold starts healthy (nobody would clear what it had).

    Like the kubelet's own cache (``pkg/kubelet/cm/dra/healthinfo.go``: devices a plugin stops
    reporting become Unknown, entries older than the health timeout count as Unknown), health of
    a device that is gone is not kept for ever.
    """
    inventory, tracker = make(fake_clock, hold=60)
    await tracker.handle(lost("gpu-3"))
    await tracker.handle(xid(device="gpu-3"))
    inventory.set_devices([Device(f"gpu-{i}", DRIVER) for i in range(3)])  # fell off the bus
    tracker.expire()
    fake_clock.advance(59)
    tracker.expire()
    assert [a.device for a in tracker.active()] == ["gpu-3", "gpu-3"]  # may still come straight back
    fake_clock.advance(1)
    tracker.expire()
    assert tracker.active() == []
    fake_clock.advance(3600)
    inventory.set_devices([Device(f"gpu-{i}", DRIVER) for i in range(4)])  # back, reset
    tracker.expire()
    assert conditions(inventory, "gpu-3") == []
    # A fresh episode: no flap from the forgotten one.
    await tracker.handle(xid(device="gpu-3"))
    assert tracker.hold_for("gpu-3", "xid", fake_clock.time()) == 60


async def test_absence_counts_from_when_it_was_seen_and_resets_on_return(fake_clock: FakeClock) -> None:
    inventory, tracker = make(fake_clock, hold=60)
    await tracker.handle(lost("gpu-3"))
    all_four = [Device(f"gpu-{i}", DRIVER) for i in range(4)]
    inventory.set_devices(all_four[:3])
    tracker.expire()
    fake_clock.advance(40)
    inventory.set_devices(all_four)  # back within the hold: kept
    tracker.expire()
    fake_clock.advance(40)
    inventory.set_devices(all_four[:3])  # gone again: counts afresh
    tracker.expire()
    fake_clock.advance(40)
    tracker.expire()
    assert [a.device for a in tracker.active()] == ["gpu-3"]
    fake_clock.advance(20)
    tracker.expire()
    assert tracker.active() == []


async def test_nothing_is_forgotten_before_the_first_discovery(fake_clock: FakeClock) -> None:
    inventory = Inventory(DRIVER)
    tracker = HealthTracker(inventory, fake_clock, 60)
    await tracker.handle(lost("gpu-3"))
    fake_clock.advance(3600)
    tracker.expire()
    assert [a.device for a in tracker.active()] == ["gpu-3"]
    inventory.set_devices([Device("gpu-3", DRIVER)])
    tracker.expire()
    assert conditions(inventory, "gpu-3") == [("gpu-lost", "")]
