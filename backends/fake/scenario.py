"""Scripted fault scenarios for the fake backend: faults at given times, storms, losses, recoveries.

A scenario file::

    description: an XID storm on gpu-1, then recovery
    steps:
      - at: 0.5                       # seconds from the start
        inject: {device: gpu-3, condition: xid, value: 79}
      - at: 1
        storm: {device: gpu-1, condition: xid, value: 79, rate: 1000, duration: 10}
      - at: 2
        lose: {device: gpu-2}
      - at: 12
        recover: {device: gpu-3}      # optional condition; driver optional everywhere

`run_scenario(controller, scenario, clock)` runs it against any `FaultController` (the fake
backends' `FaultInjector`, in process) on any clock; storms run alongside the later steps.
``dra-agent fake scenario FILE`` sends it to a running agent over the control socket.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

import anyio

from agent.core.backend import ConditionKind
from agent.core.boundedfile import MIB, BoundedFileError, parse_yaml, read_text
from agent.core.clock import Clock
from agent.core.errors import BackendError
from agent.core.model import Severity

ACTIONS = ("inject", "recover", "lose", "storm")
_FIELDS: dict[str, frozenset[str]] = {
    "inject": frozenset({"device", "condition", "value", "driver", "severity", "kind", "message"}),
    "recover": frozenset({"device", "condition", "driver"}),
    "lose": frozenset({"device", "driver"}),
    "storm": frozenset({"device", "condition", "value", "driver", "severity", "kind", "rate", "duration"}),
}
STORM_TICK_SECONDS = 0.005
"""How often a storm injects the events that are due (several per tick at high rates)."""
MAX_SCENARIO_BYTES = 1 * MIB
"""Thousands of steps fit in a few hundred KiB."""


class ScenarioError(BackendError):
    """A scenario file is invalid; the message names the file, the field path and the value."""

    def __init__(self, source: str, path: str, problem: str) -> None:
        super().__init__(f"scenario {source}: {path}: {problem}" if path else f"scenario {source}: {problem}")


class FaultController(Protocol):
    """What a scenario drives: the fake backends' fault injection."""

    async def inject(
        self,
        device: str,
        condition: str,
        value: str = "",
        *,
        driver: str | None = None,
        severity: Severity | None = None,
        kind: ConditionKind | None = None,
        message: str = "",
    ) -> list[str]: ...

    async def recover(
        self, device: str, condition: str | None = None, *, driver: str | None = None
    ) -> list[str]: ...

    async def lose(self, device: str, *, driver: str | None = None) -> list[str]: ...


@dataclass(frozen=True)
class Step:
    """One action at a time (seconds from the scenario start)."""

    at: float
    action: str
    device: str
    condition: str | None = None
    value: str = ""
    driver: str | None = None
    severity: Severity | None = None
    kind: ConditionKind | None = None
    message: str = ""
    rate: float = 0.0
    duration: float = 0.0


@dataclass(frozen=True)
class Scenario:
    """A parsed scenario: steps sorted by time."""

    source: str
    description: str
    steps: tuple[Step, ...]


@dataclass
class ScenarioResult:
    """What a run did: actions carried out, events injected, failures (the run goes on after one)."""

    actions: int = 0
    events: int = 0
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        return {"actions": self.actions, "events": self.events, "errors": list(self.errors)}


def shipped_scenarios() -> list[str]:
    """Names of the example scenarios shipped with the package."""
    folder = resources.files("backends.fake").joinpath("scenarios")
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file (or a shipped scenario by name, e.g. ``xid-storm``)."""
    try:
        if not Path(path).exists() and str(path) in shipped_scenarios():
            text = resources.files("backends.fake").joinpath("scenarios", f"{path}.yaml").read_text()
        else:
            text = read_text(path, max_bytes=MAX_SCENARIO_BYTES, what="YAML scenario")
        data = parse_yaml(text, path, what="YAML scenario")
    except BoundedFileError as error:
        hint = f"expected {error.accepted}"
        if error.reason == "unreadable":
            hint = f"give a file or a shipped scenario ({', '.join(shipped_scenarios())})"
        raise ScenarioError(str(path), "", f"{error.problem}; {hint}") from None
    return parse_scenario(data, str(path))


def parse_scenario(data: object, source: str) -> Scenario:
    """Validate scenario data (already parsed from YAML or JSON)."""
    if not isinstance(data, dict):
        raise ScenarioError(source, "", "must be a mapping with 'steps'")
    for key in data:
        if key not in ("description", "steps"):
            raise ScenarioError(source, str(key), "unknown field (allowed: description, steps)")
    raw_steps = data.get("steps")
    if not isinstance(raw_steps, list) or not raw_steps:
        raise ScenarioError(source, "steps", f"{raw_steps!r} must be a non-empty list")
    steps = [_step(source, f"steps[{i}]", raw) for i, raw in enumerate(raw_steps)]
    return Scenario(source, str(data.get("description", "")), tuple(sorted(steps, key=lambda s: s.at)))


def _number(source: str, path: str, raw: object, *, positive: bool = False) -> float:
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not math.isfinite(raw) or raw < 0:
        raise ScenarioError(source, path, f"{raw!r} must be a number of at least 0")
    if positive and raw <= 0:
        raise ScenarioError(source, path, f"{raw!r} must be greater than 0")
    return float(raw)


def _step(source: str, path: str, raw: object) -> Step:
    if not isinstance(raw, dict):
        raise ScenarioError(source, path, f"{raw!r} must be a mapping such as {{at: 1, inject: {{...}}}}")
    actions = [a for a in ACTIONS if a in raw]
    unknown = [k for k in raw if k not in (*ACTIONS, "at")]
    if unknown:
        allowed = ", ".join(ACTIONS)
        raise ScenarioError(source, f"{path}.{unknown[0]}", f"unknown field (allowed: at, {allowed})")
    if len(actions) != 1:
        raise ScenarioError(source, path, f"needs exactly one action of {', '.join(ACTIONS)}")
    action = actions[0]
    at = _number(source, f"{path}.at", raw.get("at", 0))
    args = raw[action]
    where = f"{path}.{action}"
    if not isinstance(args, dict):
        raise ScenarioError(source, where, f"{args!r} must be a mapping such as {{device: gpu-0}}")
    for key in args:
        if key not in _FIELDS[action]:
            raise ScenarioError(
                source, f"{where}.{key}", f"unknown field (allowed: {', '.join(sorted(_FIELDS[action]))})"
            )
    device = args.get("device")
    if not isinstance(device, str) or not device:
        raise ScenarioError(source, f"{where}.device", f"{device!r} must be a device name")
    condition = args.get("condition")
    if action in ("inject", "storm") and not isinstance(condition, str):
        raise ScenarioError(source, f"{where}.condition", f"{condition!r} must be a condition such as xid")
    if condition is not None and not isinstance(condition, str):
        raise ScenarioError(source, f"{where}.condition", f"{condition!r} must be a string")
    driver = args.get("driver")
    if driver is not None and not isinstance(driver, str):
        raise ScenarioError(source, f"{where}.driver", f"{driver!r} must be a driver name")
    return Step(
        at=at,
        action=action,
        device=device,
        condition=condition,
        value="" if args.get("value") is None else str(args["value"]),
        driver=driver,
        severity=_enum_arg(source, f"{where}.severity", args.get("severity"), Severity),
        kind=_enum_arg(source, f"{where}.kind", args.get("kind"), ConditionKind),
        message=str(args.get("message", "")),
        rate=_number(source, f"{where}.rate", args.get("rate"), positive=True) if action == "storm" else 0.0,
        duration=_number(source, f"{where}.duration", args.get("duration"), positive=True)
        if action == "storm"
        else 0.0,
    )


def parse_severity(raw: object) -> Severity | None:
    """``info``/``warning``/``critical`` (any case) -> Severity; None stays None; else ValueError."""
    if raw is None:
        return None
    return Severity[str(raw).upper()]


def parse_kind(raw: object) -> ConditionKind | None:
    """``event``/``state`` -> ConditionKind; None stays None; else ValueError."""
    if raw is None:
        return None
    return ConditionKind(str(raw).lower())


def _enum_arg(source: str, path: str, raw: object, enum_type: type[Severity] | type[ConditionKind]) -> Any:
    try:
        return parse_severity(raw) if enum_type is Severity else parse_kind(raw)
    except (KeyError, ValueError):
        choices = "info, warning, critical" if enum_type is Severity else "event, state"
        raise ScenarioError(source, path, f"{raw!r} must be one of {choices}") from None


def scenario_to_data(scenario: Scenario) -> dict[str, Any]:
    """A scenario as plain data (for the control socket); `parse_scenario` reads it back."""
    steps: list[dict[str, Any]] = []
    for s in scenario.steps:
        args: dict[str, Any] = {"device": s.device}
        if s.condition is not None:
            args["condition"] = s.condition
        if s.driver is not None:
            args["driver"] = s.driver
        if s.action in ("inject", "storm"):
            if s.value:
                args["value"] = s.value
            if s.severity is not None:
                args["severity"] = s.severity.label
            if s.kind is not None:
                args["kind"] = s.kind.value
        if s.action == "inject" and s.message:
            args["message"] = s.message
        if s.action == "storm":
            args["rate"], args["duration"] = s.rate, s.duration
        steps.append({"at": s.at, s.action: args})
    return {"description": scenario.description, "steps": steps}


async def run_scenario(controller: FaultController, scenario: Scenario, clock: Clock) -> ScenarioResult:
    """Run every step at its time; a failing step is recorded in the result and the run goes on."""
    result = ScenarioResult()
    start = clock.monotonic()

    async def attempt(step: Step, call: Mapping[str, Any]) -> None:
        try:
            if step.action == "inject":
                await controller.inject(step.device, step.condition or "", step.value, **call)
                result.events += 1
            elif step.action == "recover":
                await controller.recover(step.device, step.condition, driver=step.driver)
            elif step.action == "lose":
                await controller.lose(step.device, driver=step.driver)
            result.actions += 1
        except BackendError as error:
            result.errors.append(f"at {step.at:g}s {step.action} {step.device}: {error}")

    async def storm(step: Step, call: Mapping[str, Any]) -> None:
        total = max(1, round(step.rate * step.duration))
        began = clock.monotonic()
        sent = 0
        try:
            while sent < total:
                due = min(total, math.floor((clock.monotonic() - began) * step.rate) + 1)
                while sent < due:
                    await controller.inject(step.device, step.condition or "", step.value, **call)
                    sent += 1
                if sent < total:
                    await clock.sleep(max(STORM_TICK_SECONDS, 1 / step.rate))
            result.actions += 1
        except BackendError as error:
            result.errors.append(f"at {step.at:g}s storm {step.device}: {error}")
        finally:
            result.events += sent

    async with anyio.create_task_group() as tg:
        for step in scenario.steps:
            wait = start + step.at - clock.monotonic()
            if wait > 0:
                await clock.sleep(wait)
            call = {
                "driver": step.driver,
                "severity": step.severity,
                "kind": step.kind,
                "message": step.message,
            }
            if step.action == "storm":
                tg.start_soon(storm, step, call)
            else:
                await attempt(step, call)
    return result
