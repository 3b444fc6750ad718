"""Held conditions across restarts (issue 23 points 4-6): the first health pass gates what was
restored, a stricter policy never acts on the past, the durable file, vanished devices, pass metrics.

Upstream facts used: the kubelet deletes a node's ResourceSlices of a driver 30 s after its plugin
deregistered (pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go, cleanupResourcesWithDelay), which
is why the taints alone cannot carry held conditions over a longer outage; a device taint's effect
drives the eviction controller (pkg/controller/devicetainteviction/device_taint_eviction.go).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest
from prometheus_client import generate_latest

from agent.core.backend import GPU_LOST, ConditionKind, HealthEvent, report_pass
from agent.core.inventory import Inventory
from agent.core.model import Device, HealthCondition, Severity
from agent.health.persist import HealthFileWriter, encode_held, load_held, restore
from agent.health.taints import (
    EFFECT_NO_EXECUTE,
    EFFECT_NO_SCHEDULE,
    EFFECT_NONE,
    TaintPolicy,
    TaintPolicyError,
)
from agent.health.tracker import HealthTracker
from agent.health.vanished import VanishedDevices
from agent.observe.metrics import Metrics
from agent.observe.telemetry import MonitorLiveness
from tests.support.clock import FakeClock

DRIVER = "gpu.example.com"
HOLD = 10.0


def tracker(
    clock: FakeClock, *, gate: bool = True, metrics: Metrics | None = None
) -> tuple[Inventory, HealthTracker]:
    inventory = Inventory(DRIVER)
    inventory.set_devices([Device(f"gpu-{i}", DRIVER) for i in range(2)])
    trends = ("ecc-correctable-rate",) if metrics is not None else ()
    return inventory, HealthTracker(inventory, clock, HOLD, gate_seeds=gate, metrics=metrics, trends=trends)


def lost(since: float, effect: str = "") -> HealthCondition:
    return HealthCondition(GPU_LOST, Severity.CRITICAL, "", "held", since, held_effect=effect)


def xid79(since: float, effect: str = "") -> HealthCondition:
    return HealthCondition("xid", Severity.CRITICAL, "79", "held", since, held_effect=effect)


def conditions(inventory: Inventory, device: str) -> list[str]:
    health = inventory.health().get(device)
    return [c.condition for c in health.conditions] if health else []


# --- point 4: a restored condition waits for the first health pass ------------------------------


def test_a_restored_gpu_lost_older_than_the_hold_stays_until_a_pass_has_looked(fake_clock: FakeClock) -> None:
    inventory, health = tracker(fake_clock)
    health.seed("gpu-0", lost(fake_clock.time() - 3 * HOLD))
    fake_clock.advance(5 * HOLD)
    health.expire()
    assert conditions(inventory, "gpu-0") == [GPU_LOST]  # before the fix: lifted at the first tick
    health.pass_completed(["gpu-1"])  # a pass that did not reach gpu-0
    fake_clock.advance(HOLD)
    health.expire()
    assert conditions(inventory, "gpu-0") == [GPU_LOST]


def test_a_restored_state_the_pass_did_not_report_is_cleared_at_the_pass_then_held(
    fake_clock: FakeClock,
) -> None:
    inventory, health = tracker(fake_clock)
    health.seed("gpu-0", lost(fake_clock.time() - 100), kind=ConditionKind.STATE)
    health.pass_completed(["gpu-0", "gpu-1"])
    fake_clock.advance(HOLD - 0.1)
    health.expire()
    assert conditions(inventory, "gpu-0") == [GPU_LOST]
    fake_clock.advance(0.2)
    health.expire()
    assert conditions(inventory, "gpu-0") == []


def test_a_restored_state_the_pass_reports_again_stays(fake_clock: FakeClock) -> None:
    inventory, health = tracker(fake_clock)
    health.seed("gpu-0", lost(fake_clock.time() - 100))
    health.record(HealthEvent("gpu-0", GPU_LOST, Severity.CRITICAL, kind=ConditionKind.STATE))
    health.pass_completed(["gpu-0", "gpu-1"])
    fake_clock.advance(10 * HOLD)
    health.expire()
    assert conditions(inventory, "gpu-0") == [GPU_LOST]


def test_a_restored_event_lifts_by_its_hold_once_looked_at(fake_clock: FakeClock) -> None:
    inventory, health = tracker(fake_clock)
    health.seed("gpu-0", xid79(fake_clock.time() - 100))
    health.expire()
    assert conditions(inventory, "gpu-0") == ["xid"]
    health.pass_completed(["gpu-0"])
    health.expire()
    assert conditions(inventory, "gpu-0") == []


def test_without_passes_a_restored_condition_lifts_by_its_hold_as_before(fake_clock: FakeClock) -> None:
    inventory, health = tracker(fake_clock, gate=False)
    health.seed("gpu-0", lost(fake_clock.time() - 100))
    health.expire()
    assert conditions(inventory, "gpu-0") == []


# --- point 5: a policy change never acts on the past ---------------------------------------------

STRICT = TaintPolicy.from_data({"rules": [{"condition": "xid", "value": 79, "effect": "NoExecute"}]})


def test_a_stricter_policy_keeps_the_published_effect_of_a_held_condition() -> None:
    assert STRICT.effect_for(DRIVER, xid79(0, EFFECT_NO_SCHEDULE)) == EFFECT_NO_SCHEDULE
    assert STRICT.policy_effect(DRIVER, xid79(0, EFFECT_NO_SCHEDULE)) == EFFECT_NO_EXECUTE
    assert STRICT.effect_for(DRIVER, xid79(0)) == EFFECT_NO_EXECUTE  # a new fault


def test_a_looser_policy_applies_to_a_held_condition_at_once() -> None:
    loose = TaintPolicy.from_data({"rules": [{"condition": "xid", "value": 79, "effect": "None"}]})
    assert loose.effect_for(DRIVER, xid79(0, EFFECT_NO_SCHEDULE)) == EFFECT_NONE
    ignore = TaintPolicy.from_data({"rules": [{"condition": "xid", "ignore": True}]})
    assert ignore.effect_for(DRIVER, xid79(0, EFFECT_NO_SCHEDULE)) is None


def test_a_recurring_event_is_a_new_fault_and_a_state_reported_again_is_not(fake_clock: FakeClock) -> None:
    inventory, health = tracker(fake_clock)
    health.seed("gpu-0", xid79(fake_clock.time(), EFFECT_NO_SCHEDULE))
    health.seed("gpu-1", lost(fake_clock.time(), EFFECT_NO_SCHEDULE))
    health.record(HealthEvent("gpu-0", "xid", Severity.CRITICAL, "79"))
    health.record(HealthEvent("gpu-1", GPU_LOST, Severity.CRITICAL, kind=ConditionKind.STATE))
    held = {h.device: h.condition.held_effect for h in health.held()}
    assert held == {"gpu-0": "", "gpu-1": EFFECT_NO_SCHEDULE}
    (device,) = [d for d in inventory.devices() if d.name == "gpu-0"]
    assert STRICT.effect_for(DRIVER, device.health.conditions[0]) == EFFECT_NO_EXECUTE


def test_a_policy_naming_a_condition_no_backend_reports_is_refused() -> None:
    policy = TaintPolicy.from_data({"rules": [{"condition": "ecc-uncorectable", "effect": "NoExecute"}]})
    with pytest.raises(TaintPolicyError, match=r"ecc-uncorectable.*expected.*ecc-uncorrectable"):
        policy.check_conditions({DRIVER: ("xid", "ecc-uncorrectable")})
    scoped = TaintPolicy.from_data({"rules": [{"condition": "xid", "driver": "gpu.amd.com", "ignore": True}]})
    with pytest.raises(TaintPolicyError, match=r"driver gpu\.amd\.com"):
        scoped.check_conditions({"gpu.amd.com": ("gpu-reset",), DRIVER: ("xid",)})
    # A backend that declares nothing: rules without a driver cannot be checked.
    policy.check_conditions({DRIVER: ("xid",)}, complete=False)
    TaintPolicy.from_data({"rules": [{"condition": "xid", "ignore": True}]}).check_conditions(
        {DRIVER: ("xid",)}
    )


# --- point 6: the durable file -------------------------------------------------------------------


def effect(device: str, condition: HealthCondition) -> str | None:
    return TaintPolicy.default().effect_for(DRIVER, condition)


def test_the_file_round_trips_kind_times_clear_and_effect(fake_clock: FakeClock, tmp_path: Path) -> None:
    _, health = tracker(fake_clock)
    health.record(HealthEvent("gpu-0", "xid", Severity.CRITICAL, "79", "GPU error"))
    health.record(HealthEvent("gpu-1", GPU_LOST, Severity.CRITICAL, kind=ConditionKind.STATE))
    health.record(HealthEvent("gpu-1", GPU_LOST, Severity.CRITICAL, kind=ConditionKind.STATE, cleared=True))
    path = tmp_path / "health.json"
    path.write_bytes(encode_held(DRIVER, health.held(), effect))
    loaded = load_held(path, DRIVER)
    assert loaded.problem == ""
    assert [(h.device, h.condition.condition, h.kind, h.cleared_at is not None) for h in loaded.held] == [
        ("gpu-0", "xid", ConditionKind.EVENT, False),
        ("gpu-1", GPU_LOST, ConditionKind.STATE, True),
    ]
    assert {h.condition.held_effect for h in loaded.held} == {EFFECT_NO_SCHEDULE}


async def test_restore_seeds_a_fresh_tracker_that_then_waits_for_the_pass(
    fake_clock: FakeClock, tmp_path: Path
) -> None:
    _, before = tracker(fake_clock)
    before.record(HealthEvent("gpu-0", GPU_LOST, Severity.CRITICAL, kind=ConditionKind.STATE))
    path = tmp_path / DRIVER / "health.json"
    writer = HealthFileWriter(before, path, effect, fake_clock)
    await writer.write_now()
    fake_clock.advance(1000)
    inventory, after = tracker(fake_clock)
    assert await restore(after, path, fake_clock) == 1
    after.expire()
    assert conditions(inventory, "gpu-0") == [GPU_LOST]
    (held,) = after.held()
    assert held.kind is ConditionKind.STATE and held.condition.held_effect == EFFECT_NO_SCHEDULE


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"\xff\xfe",
        json.dumps({"version": 2, "driver": DRIVER, "conditions": []}).encode(),
        json.dumps({"version": 1, "driver": "other.example.com", "conditions": []}).encode(),
        json.dumps({"version": 1, "driver": DRIVER, "conditions": [{"device": "gpu-0"}]}).encode(),
        json.dumps({"version": 1, "driver": DRIVER, "conditions": "x"}).encode(),
        b"[" * 10_000,
    ],
)
def test_an_unusable_file_is_moved_aside_with_a_reason(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "health.json"
    path.write_bytes(content)
    loaded = load_held(path, DRIVER, now=1234)
    assert loaded.held == () and loaded.problem
    assert loaded.moved_to == tmp_path / "health.json.corrupt-1234"
    assert not path.exists() and loaded.moved_to.read_bytes() == content


def test_an_oversized_file_is_moved_aside_unread(tmp_path: Path) -> None:
    path = tmp_path / "health.json"
    path.write_bytes(b" " * (5 * 1024 * 1024))
    loaded = load_held(path, DRIVER, now=1)
    assert "larger than" in loaded.problem and loaded.moved_to is not None


def test_no_file_is_nothing_held(tmp_path: Path) -> None:
    assert load_held(tmp_path / "health.json", DRIVER) == load_held(tmp_path / "absent", DRIVER)
    assert load_held(tmp_path / "health.json", DRIVER).held == ()


async def test_the_writer_writes_each_change_once(fake_clock: FakeClock, tmp_path: Path) -> None:
    _, health = tracker(fake_clock)
    path = tmp_path / "d" / "health.json"
    writer = HealthFileWriter(health, path, effect, fake_clock)
    async with anyio.create_task_group() as tg:
        tg.start_soon(writer.run)
        health.record(HealthEvent("gpu-0", "xid", Severity.CRITICAL, "79"))
        with anyio.fail_after(5):
            while not path.exists() or b"xid" not in path.read_bytes():  # noqa: ASYNC110 (a file, no event)
                await anyio.sleep(0.01)
        assert oct(path.stat().st_mode & 0o777) == "0o600"
        tg.cancel_scope.cancel()


# --- no silent loss: a device rediscovery no longer finds -----------------------------------------


def dev(name: str, parent: str = "") -> Device:
    return Device(name, DRIVER, parent=parent)


def test_a_whole_gpu_not_found_again_stays_with_gpu_lost_until_it_is_back() -> None:
    vanished = VanishedDevices(DRIVER)
    published = [dev("gpu-0"), dev("gpu-1-mig-0", "gpu-1"), dev("gpu-1-mig-1", "gpu-1"), dev("gpu-2")]
    devices, events = vanished.merge(published, [dev("gpu-0"), dev("gpu-2")], at=5)
    assert [d.name for d in devices] == ["gpu-0", "gpu-2", "gpu-1-mig-0", "gpu-1-mig-1"]
    assert [(e.device, e.condition, e.kind, e.cleared) for e in events] == [
        ("gpu-1-mig-0", GPU_LOST, ConditionKind.STATE, False),
        ("gpu-1-mig-1", GPU_LOST, ConditionKind.STATE, False),
    ]
    devices, events = vanished.merge(devices, [dev("gpu-0"), dev("gpu-2")], at=6)
    assert len(devices) == 4 and events == []  # raised once
    devices, events = vanished.merge(devices, published, at=7)
    assert [d.name for d in devices] == [d.name for d in published]
    assert [(e.device, e.cleared) for e in events] == [("gpu-1-mig-0", True), ("gpu-1-mig-1", True)]


def test_a_mig_device_removed_while_its_gpu_answers_goes() -> None:
    vanished = VanishedDevices(DRIVER)
    devices, events = vanished.merge([dev("gpu-1-mig-0", "gpu-1")], [dev("gpu-1-mig-3", "gpu-1")], at=1)
    assert [d.name for d in devices] == ["gpu-1-mig-3"] and events == []


# --- the pass's metrics and failed checks ---------------------------------------------------------


def test_a_pass_stamps_its_time_counts_failed_checks_and_logs_each_episode_once(
    fake_clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    metrics = Metrics()
    liveness = MonitorLiveness(DRIVER, metrics, fake_clock, checks=("answers", "row-remap"), pass_interval=5)
    text = generate_latest(metrics.registry).decode()
    assert f'dra_agent_health_pass_interval_seconds{{driver="{DRIVER}"}} 5.0' in text
    assert f'dra_agent_health_check_failures_total{{check="row-remap",driver="{DRIVER}"}} 0.0' in text
    seen: list[tuple[list[str], list[str]]] = []
    sink = liveness.sink(lambda e: anyio.lowlevel.checkpoint(), lambda d, f: seen.append((list(d), list(f))))
    with caplog.at_level(logging.INFO):
        for _ in range(3):
            report_pass(sink, ["gpu-0"], failed_checks=["row-remap"])
        report_pass(sink, ["gpu-0", "gpu-1"])
    assert seen[-1] == (["gpu-0", "gpu-1"], [])
    text = generate_latest(metrics.registry).decode()
    assert f'dra_agent_health_check_failures_total{{check="row-remap",driver="{DRIVER}"}} 3.0' in text
    stamp = metrics.registry.get_sample_value(
        "dra_agent_health_pass_last_completed_timestamp_seconds", {"driver": DRIVER}
    )
    assert stamp == fake_clock.time()
    assert len([r for r in caplog.records if r.message.startswith("health check failing")]) == 1
    assert len([r for r in caplog.records if r.message == "health check works again"]) == 1


def test_degraded_is_exported_per_device_and_trend_from_the_start(fake_clock: FakeClock) -> None:
    metrics = Metrics()
    _, health = tracker(fake_clock, metrics=metrics)
    health.expire()
    sample = 'dra_agent_device_degraded{{condition="ecc-correctable-rate",device="gpu-0",driver="{d}"}} {v}'
    assert sample.format(d=DRIVER, v="0.0") in generate_latest(metrics.registry).decode()
    health.record(HealthEvent("gpu-0", "ecc-correctable-rate", Severity.INFO, "", "", ConditionKind.STATE))
    assert sample.format(d=DRIVER, v="1.0") in generate_latest(metrics.registry).decode()


# --- bad input: one line, exit 2, before anything starts ------------------------------------------


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan", "soon"])
def test_a_bad_health_interval_is_one_line_and_exit_2(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    from agent.cli import main

    assert main(["run", "--kube", "none", "--health-interval", value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--health-interval" in err and "seconds" in err, err


def test_a_policy_naming_an_unknown_condition_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from agent.cli import main

    path = tmp_path / "policy.yaml"
    path.write_text("rules:\n  - condition: row-remap-pendign\n    effect: NoExecute\n")
    code = main(
        [
            "run",
            "--kube",
            "none",
            "--backend",
            "fake:profile=nvidia-a100-8x,control=off",
            "--taint-policy",
            str(path),
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'row-remap-pendign'" in err and "gpu-lost" in err, err


def test_an_unknown_lost_device_of_the_fake_is_a_config_error() -> None:
    from agent.core.backend import BackendOptions
    from agent.core.errors import ConfigError
    from backends.fake import create_backend

    with pytest.raises(ConfigError, match="setting lost"):
        create_backend(
            BackendOptions("node", settings={"profile": "nvidia-a100-8x", "control": "off", "lost": "gpu-99"})
        )
