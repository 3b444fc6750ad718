"""Scenario files: parsing with clear errors, and the runner on a fake clock."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from agent.core.backend import ConditionKind
from agent.core.model import Severity
from backends.fake.scenario import (
    FaultController,
    Scenario,
    ScenarioError,
    ScenarioResult,
    load_scenario,
    parse_scenario,
    run_scenario,
    scenario_to_data,
)
from tests.fake.helpers import make_backends, settle
from tests.support.clock import FakeClock

SHIPPED = Path(__file__).resolve().parents[2] / "backends" / "fake" / "scenarios"


async def run_on_fake_clock(
    scenario: Scenario, clock: FakeClock, run: FaultController, step: float = 0.005
) -> ScenarioResult:
    """Run `scenario`, advancing `clock` by `step` once the woken tasks have run."""
    result: list[ScenarioResult] = []

    async def go() -> None:
        result.append(await run_scenario(run, scenario, clock))

    async with anyio.create_task_group() as tg:
        tg.start_soon(go)
        while not result:
            await settle()
            if not result:
                clock.advance(step)
    return result[0]


def test_shipped_scenarios_parse() -> None:
    names = sorted(p.name for p in SHIPPED.glob("*.yaml"))
    assert names == ["gpu-lost.yaml", "recovery.yaml", "single-fault.yaml", "xid-storm.yaml"]
    for path in SHIPPED.glob("*.yaml"):
        scenario = load_scenario(path)
        assert scenario.steps and scenario.description
        # Plain data round trip (what the control socket carries).
        assert parse_scenario(scenario_to_data(scenario), "x").steps == scenario.steps


async def test_shipped_scenarios_run_on_the_mixed_profile(fake_clock: FakeClock) -> None:
    for name in ("single-fault", "gpu-lost", "recovery"):
        _, injector = make_backends(clock=fake_clock)
        result = await run_on_fake_clock(load_scenario(SHIPPED / f"{name}.yaml"), fake_clock, injector, 0.5)
        assert result.errors == [], name


async def test_steps_happen_at_their_time(fake_clock: FakeClock) -> None:
    (nvidia, amd), injector = make_backends(clock=fake_clock)
    start = fake_clock.time()
    scenario = parse_scenario(
        {
            "steps": [
                {"at": 2, "recover": {"device": "gpu-3"}},
                {"at": 0.5, "inject": {"device": "gpu-3", "condition": "xid", "value": 79}},
                {"at": 1, "lose": {"device": "gpu-1-128", "driver": "gpu.amd.com"}},
                {
                    "at": 1.5,
                    "inject": {
                        "device": "gpu-0",
                        "condition": "custom",
                        "severity": "critical",
                        "kind": "state",
                        "message": "m",
                    },
                },
            ]
        },
        "test",
    )
    assert [s.action for s in scenario.steps] == ["inject", "lose", "inject", "recover"]
    result = await run_on_fake_clock(scenario, fake_clock, injector, 0.25)
    assert result.as_dict() == {"actions": 4, "events": 2, "errors": []}
    events = list(nvidia._queue)
    assert [(e.condition, e.at - start if e.at else None) for e in events] == [
        ("xid", 0.5),
        ("custom", 1.5),
        ("xid", 2.0),
    ]
    assert events[1].severity is Severity.CRITICAL and events[1].kind is ConditionKind.STATE
    assert "gpu-1-128" in amd.lost


async def test_storm_sends_rate_times_duration(fake_clock: FakeClock) -> None:
    (nvidia, _), injector = make_backends(clock=fake_clock)
    scenario = parse_scenario(
        {
            "steps": [
                {
                    "at": 0,
                    "storm": {
                        "device": "gpu-1",
                        "condition": "xid",
                        "value": 79,
                        "rate": 1000,
                        "duration": 2,
                    },
                },
                {"at": 1, "inject": {"device": "gpu-2", "condition": "xid", "value": 31}},
            ]
        },
        "test",
    )
    result = await run_on_fake_clock(scenario, fake_clock, injector, 0.01)
    assert result.events == 2001
    assert result.errors == []
    storm = [e for e in nvidia._queue if e.device == "gpu-1"]
    assert len(storm) == 2000
    # Spread over the duration, not sent at once.
    assert storm[-1].at is not None and storm[0].at is not None
    assert 1.9 <= storm[-1].at - storm[0].at <= 2.0
    assert nvidia.active[("gpu-1", "xid", "79")].count == 2000


async def test_failures_are_recorded_and_the_run_goes_on(fake_clock: FakeClock) -> None:
    _, injector = make_backends(clock=fake_clock)
    scenario = parse_scenario(
        {
            "steps": [
                {"at": 0, "inject": {"device": "gpu-99", "condition": "xid"}},
                {"at": 0, "storm": {"device": "gpu-98", "condition": "xid", "rate": 10, "duration": 1}},
                {"at": 0.1, "inject": {"device": "gpu-0", "condition": "xid"}},
            ]
        },
        "test",
    )
    result = await run_on_fake_clock(scenario, fake_clock, injector)
    assert result.actions == 1 and result.events == 1
    assert len(result.errors) == 2
    assert "gpu-99" in result.errors[0] and "no device" in result.errors[0]


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ([], "scenario s.yaml: must be a mapping"),
        ({"steps": []}, "scenario s.yaml: steps: [] must be a non-empty list"),
        ({"steps": [], "extra": 1}, "scenario s.yaml: extra: unknown field"),
        ({"steps": [1]}, "steps[0]: 1 must be a mapping"),
        ({"steps": [{"at": 1}]}, "steps[0]: needs exactly one action"),
        ({"steps": [{"at": 1, "inject": {}, "lose": {}}]}, "steps[0]: needs exactly one action"),
        ({"steps": [{"when": 1, "lose": {"device": "gpu-0"}}]}, "steps[0].when: unknown field"),
        (
            {"steps": [{"at": -1, "lose": {"device": "gpu-0"}}]},
            "steps[0].at: -1 must be a number of at least 0",
        ),
        ({"steps": [{"at": "soon", "lose": {"device": "gpu-0"}}]}, "steps[0].at: 'soon' must be a number"),
        ({"steps": [{"lose": "gpu-0"}]}, "steps[0].lose: 'gpu-0' must be a mapping"),
        ({"steps": [{"lose": {"device": 3}}]}, "steps[0].lose.device: 3 must be a device name"),
        ({"steps": [{"lose": {"device": "g", "value": 3}}]}, "steps[0].lose.value: unknown field"),
        ({"steps": [{"inject": {"device": "g"}}]}, "steps[0].inject.condition: None must be a condition"),
        (
            {"steps": [{"inject": {"device": "g", "condition": "xid", "severity": "fatal"}}]},
            "steps[0].inject.severity: 'fatal' must be one of info, warning, critical",
        ),
        (
            {"steps": [{"inject": {"device": "g", "condition": "xid", "kind": "x"}}]},
            "steps[0].inject.kind: 'x' must be one of event, state",
        ),
        (
            {"steps": [{"storm": {"device": "g", "condition": "xid", "rate": 0, "duration": 1}}]},
            "steps[0].storm.rate: 0 must be greater than 0",
        ),
        (
            {"steps": [{"storm": {"device": "g", "condition": "xid", "rate": 10}}]},
            "steps[0].storm.duration: None must be a number",
        ),
        (
            {"steps": [{"recover": {"device": "g", "driver": 1}}]},
            "steps[0].recover.driver: 1 must be a driver",
        ),
    ],
)
def test_bad_scenarios_give_one_clear_line(data: object, expected: str) -> None:
    with pytest.raises(ScenarioError) as caught:
        parse_scenario(data, "s.yaml")
    assert expected in str(caught.value)
    assert "\n" not in str(caught.value)


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match=r"unreadable .* shipped scenario .*xid-storm"):
        load_scenario(tmp_path / "missing.yaml")
    assert load_scenario("xid-storm").steps[0].rate == 1000
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: [\n")
    with pytest.raises(ScenarioError, match="not valid YAML"):
        load_scenario(bad)
