"""Health conditions to device taints: the policy table, user overrides and the cluster's limits.

Default policy (vendor-neutral, from severity): each condition of a device becomes the taint
``<driver>/<condition>`` with the condition's value; CRITICAL and WARNING -> ``NoSchedule``;
INFO -> ``None`` (informational) where the cluster accepts it (1.35+), dropped otherwise. With the
backends' severities this gives: ``gpu.nvidia.com/xid=79:NoSchedule``, application XIDs
(13, 31, 43, 45, 68, 109) informational, ``gpu-lost`` ``NoSchedule``, and ``unmonitored`` (a warning)
informational through the built-in rule `DEFAULT_RULES`, which a user rule can override.

User overrides (``--taint-policy FILE``)::

    severities:               # effect per severity: NoSchedule, NoExecute, None or ignore
      critical: NoSchedule
    rules:                    # the most specific matching rule wins (value, then driver)
      - condition: xid
        values: [79]          # or value: 79; optional
        driver: gpu.nvidia.com   # optional
        ignore: true          # no taint at all
      - condition: xid
        value: 13
        effect: NoSchedule    # force an application XID back on

Limits: at most `ClusterTaintSupport.max_taints_per_device` taints (4 on 1.34, 16 on 1.35): the
strongest effect wins, then the higher severity, then the most recent. Keys must be qualified
label names (the condition part is sanitized, else the taint is skipped); a value that is not a
label value is left out. ``timeAdded`` is the condition's ``since`` in RFC 3339 UTC seconds, so it
is stable between resyncs.
"""

from __future__ import annotations

import re
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from agent.core.boundedfile import MIB, BoundedFileError, load_yaml
from agent.core.errors import ConfigError
from agent.core.model import Device, HealthCondition, Severity, is_dns_subdomain

EFFECT_NO_SCHEDULE = "NoSchedule"
EFFECT_NO_EXECUTE = "NoExecute"
EFFECT_NONE = "None"
EFFECTS = (EFFECT_NO_SCHEDULE, EFFECT_NO_EXECUTE, EFFECT_NONE)
IGNORE = "ignore"
_EFFECT_RANK = {EFFECT_NO_EXECUTE: 3, EFFECT_NO_SCHEDULE: 2, EFFECT_NONE: 1}

_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_BAD_NAME_CHARS = re.compile(r"[^-A-Za-z0-9_.]+")
MAX_LABEL_LENGTH = 63
MAX_PREFIX_LENGTH = 253
MAX_POLICY_BYTES = 1 * MIB
"""A policy of thousands of rules fits in a few hundred KiB."""

DEFAULT_SEVERITY_EFFECTS: Mapping[Severity, str | None] = MappingProxyType(
    {Severity.CRITICAL: EFFECT_NO_SCHEDULE, Severity.WARNING: EFFECT_NO_SCHEDULE, Severity.INFO: EFFECT_NONE}
)


@dataclass(frozen=True)
class DeviceTaint:
    """A taint on one device, as written to ``spec.devices[].taints``."""

    key: str
    effect: str
    value: str = ""
    time_added: str = ""


@dataclass(frozen=True)
class ClusterTaintSupport:
    """What the cluster accepts: 4 taints per device and no ``None`` effect before 1.35."""

    max_taints_per_device: int = 4
    none_effect: bool = False


class TaintPolicyError(ConfigError):
    """A taint policy file is invalid: names the file, the field and the value."""


def is_label_value(value: str) -> bool:
    """A Kubernetes label value: at most 63 characters of ``[A-Za-z0-9_.-]``, alphanumeric at both ends."""
    return len(value) <= MAX_LABEL_LENGTH and _LABEL_VALUE.match(value) is not None


def is_label_name(value: str) -> bool:
    """A qualified label name: optional DNS-subdomain prefix and '/', then a name of at most 63 characters."""
    prefix, sep, name = value.rpartition("/")
    if sep and (len(prefix) > MAX_PREFIX_LENGTH or not is_dns_subdomain(prefix)):
        return False
    return len(name) <= MAX_LABEL_LENGTH and _LABEL_NAME.match(name) is not None


def taint_key(driver: str, condition: str) -> str | None:
    """``<driver>/<condition>`` as a valid label name (bad characters become '-'), or None."""
    name = _BAD_NAME_CHARS.sub("-", condition)[:MAX_LABEL_LENGTH]
    name = name.strip("-_.")
    key = f"{driver}/{name}"
    return key if name and is_label_name(key) else None


def rfc3339(timestamp: float) -> str:
    """Unix time as RFC 3339 UTC with seconds precision (``2026-01-02T03:04:05Z``)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(timestamp)))


@dataclass(frozen=True)
class TaintRule:
    """One user override: a condition (optionally of one driver and some values) -> effect or ignore."""

    condition: str
    driver: str | None = None
    values: frozenset[str] | None = None
    effect: str | None = None
    ignore: bool = False

    def matches(self, driver: str, condition: HealthCondition) -> bool:
        return (
            self.condition == condition.condition
            and (self.driver is None or self.driver == driver)
            and (self.values is None or condition.value in self.values)
        )

    @property
    def specificity(self) -> int:
        return (2 if self.values is not None else 0) + (1 if self.driver is not None else 0)


# A device the backend cannot watch is not faulty: say so without keeping work off it.
DEFAULT_RULES: tuple[TaintRule, ...] = (TaintRule("unmonitored", effect=EFFECT_NONE),)


class TaintPolicy:
    """Maps health conditions to taints: severity defaults plus user rules."""

    def __init__(
        self,
        rules: Sequence[TaintRule] = (),
        severity_effects: Mapping[Severity, str | None] = DEFAULT_SEVERITY_EFFECTS,
    ) -> None:
        # Most specific first; among equals, the later rule wins (user rules come after the defaults).
        indexed = list(enumerate((*DEFAULT_RULES, *rules)))
        self.rules = tuple(r for _, r in sorted(indexed, key=lambda ir: (-ir[1].specificity, -ir[0])))
        self.severity_effects = MappingProxyType({**DEFAULT_SEVERITY_EFFECTS, **severity_effects})

    @classmethod
    def default(cls) -> TaintPolicy:
        """The built-in policy (see the module docstring): severity effects plus `DEFAULT_RULES`."""
        return cls()

    @classmethod
    def load(cls, path: Path) -> TaintPolicy:
        """Read a policy file; raise `TaintPolicyError` naming the file, field and value."""
        source = str(path)
        try:
            data = load_yaml(path, max_bytes=MAX_POLICY_BYTES, what="YAML file")
        except BoundedFileError as error:
            raise TaintPolicyError("--taint-policy", source, error.detail) from None
        return cls.from_data(data, source)

    @classmethod
    def from_data(cls, data: object, source: str = "policy") -> TaintPolicy:
        """Build a policy from parsed YAML/JSON data."""
        if data is None:
            return cls()

        def fail(field: str, value: object, accepted: str) -> TaintPolicyError:
            return TaintPolicyError(f"taint policy {source}: {field}", value, accepted)

        if not isinstance(data, dict):
            raise fail("top level", data, "a mapping with 'rules' and/or 'severities'")
        for key in data:
            if key not in ("rules", "severities"):
                raise fail(str(key), key, "one of the fields rules, severities")
        severities: dict[Severity, str | None] = {}
        raw_sev = data.get("severities")
        raw_sev = {} if raw_sev is None else raw_sev
        if not isinstance(raw_sev, dict):
            raise fail("severities", raw_sev, "a mapping such as {info: None}")
        for name, effect in raw_sev.items():
            try:
                severity = Severity[str(name).upper()]
            except KeyError:
                raise fail(f"severities.{name}", name, "critical, warning or info") from None
            severities[severity] = _effect(effect, f"severities.{name}", fail, allow_ignore=True)
        raw_rules = data.get("rules")
        raw_rules = [] if raw_rules is None else raw_rules
        if not isinstance(raw_rules, list):
            raise fail("rules", raw_rules, "a list of rules")
        rules = [_rule(raw, f"rules[{i}]", fail) for i, raw in enumerate(raw_rules)]
        return cls(rules, severities)

    def effect_for(self, driver: str, condition: HealthCondition) -> str | None:
        """The effect of `condition`, or None when it gets no taint at all.

        A condition held from before a restart (``held_effect``) never gets a stricter effect
        than it was published with: a policy change acts on new faults, not on the past.
        """
        effect = self.policy_effect(driver, condition)
        held = condition.held_effect
        if held and effect is not None and _EFFECT_RANK.get(effect, 0) > _EFFECT_RANK.get(held, 0):
            return held
        return effect

    def policy_effect(self, driver: str, condition: HealthCondition) -> str | None:
        """What this policy alone gives `condition` (no ``held_effect``): effect or None."""
        for rule in self.rules:
            if rule.matches(driver, condition):
                return None if rule.ignore else rule.effect
        return self.severity_effects.get(condition.severity)

    def check_conditions(self, known: Mapping[str, Collection[str]], *, complete: bool = True) -> None:
        """Refuse a rule naming a condition no configured backend reports (`TaintPolicyError`).

        `known` maps each configured driver to the conditions its backend declares; a driver
        missing from it (a backend that declares none) is not checked, and `complete=False` (such
        a backend is configured) skips the rules without a driver. A rule without a driver must
        name a condition of some driver (one policy serves a mixed fleet).
        """
        everything = sorted({c for conditions in known.values() for c in conditions})
        for rule in self.rules:
            if rule in DEFAULT_RULES:
                continue
            if rule.driver is not None:
                if rule.driver in known and rule.condition not in known[rule.driver]:
                    accepted = ", ".join(sorted(known[rule.driver]))
                    raise TaintPolicyError(
                        f"taint policy: rule for driver {rule.driver}: condition", rule.condition, accepted
                    )
            elif complete and known and rule.condition not in everything:
                raise TaintPolicyError("taint policy: rule condition", rule.condition, ", ".join(everything))

    def taints_for(self, device: Device, support: ClusterTaintSupport) -> tuple[DeviceTaint, ...]:
        """The taints of one device, strongest first, within the cluster's limit."""
        ranked: list[tuple[tuple[int, int, float], DeviceTaint]] = []
        for condition in device.health.conditions:
            effect = self.effect_for(device.driver, condition)
            if effect is None or (effect == EFFECT_NONE and not support.none_effect):
                continue
            key = taint_key(device.driver, condition.condition)
            if key is None:
                continue
            value = condition.value if is_label_value(condition.value) else ""
            rank = (_EFFECT_RANK.get(effect, 0), int(condition.severity), condition.since)
            ranked.append((rank, DeviceTaint(key, effect, value, rfc3339(condition.since))))
        ranked.sort(key=lambda item: (item[0], item[1].key, item[1].value), reverse=True)
        out: list[DeviceTaint] = []
        seen: set[tuple[str, str]] = set()
        for _, taint in ranked:
            # One taint per key and effect, as for node taints: the strongest, most recent value.
            if (taint.key, taint.effect) in seen:
                continue
            seen.add((taint.key, taint.effect))
            out.append(taint)
        return tuple(out[: max(0, support.max_taints_per_device)])

    def taint_map(
        self, devices: Sequence[Device], support: ClusterTaintSupport
    ) -> dict[str, tuple[DeviceTaint, ...]]:
        """Taints by device name, for tainted devices only."""
        return {d.name: t for d in devices if (t := self.taints_for(d, support))}


def _effect(raw: object, field: str, fail: Any, *, allow_ignore: bool = False) -> str | None:
    text = raw if isinstance(raw, str) else None
    if allow_ignore and text == IGNORE:
        return None
    if text not in EFFECTS:
        accepted = ", ".join(EFFECTS) + (" or ignore" if allow_ignore else "")
        raise fail(field, raw, accepted)
    return text


def _rule(raw: object, path: str, fail: Any) -> TaintRule:
    if not isinstance(raw, dict):
        raise fail(path, raw, "a mapping such as {condition: xid, value: 79, ignore: true}")
    allowed = ("condition", "driver", "value", "values", "effect", "ignore")
    for key in raw:
        if key not in allowed:
            raise fail(f"{path}.{key}", key, f"one of the fields {', '.join(allowed)}")
    condition = raw.get("condition")
    if not isinstance(condition, str) or not condition:
        raise fail(f"{path}.condition", condition, "a condition name such as xid")
    driver = raw.get("driver")
    if driver is not None and (not isinstance(driver, str) or not is_dns_subdomain(driver)):
        raise fail(f"{path}.driver", driver, "a driver name such as gpu.nvidia.com")
    if "value" in raw and "values" in raw:
        raise fail(f"{path}.values", raw["values"], "either value or values, not both")
    values: frozenset[str] | None = None
    if "value" in raw:
        values = frozenset({_scalar(raw["value"], f"{path}.value", fail)})
    elif "values" in raw:
        if not isinstance(raw["values"], list) or not raw["values"]:
            raise fail(f"{path}.values", raw["values"], "a non-empty list such as [13, 31]")
        values = frozenset(_scalar(v, f"{path}.values", fail) for v in raw["values"])
    ignore = raw.get("ignore", False)
    if not isinstance(ignore, bool):
        raise fail(f"{path}.ignore", ignore, "true or false")
    if ignore == ("effect" in raw):
        raise fail(path, raw, "exactly one of effect or ignore: true")
    effect = None if ignore else _effect(raw["effect"], f"{path}.effect", fail)
    return TaintRule(condition, driver, values, effect, ignore)


def _scalar(raw: object, field: str, fail: Any) -> str:
    if isinstance(raw, bool) or not isinstance(raw, str | int):
        raise fail(field, raw, "a string or an integer")
    return str(raw)
