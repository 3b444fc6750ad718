"""The taint policy: severity defaults, user overrides, the cluster's limits, valid keys and values."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.core.errors import ConfigError
from agent.core.model import Device, DeviceHealth, HealthCondition, Severity
from agent.health.taints import (
    ClusterTaintSupport,
    DeviceTaint,
    TaintPolicy,
    TaintPolicyError,
    is_label_name,
    is_label_value,
    rfc3339,
    taint_key,
)

NV = "gpu.nvidia.com"
AMD = "gpu.amd.com"
T0 = 1_700_000_000.0
V134 = ClusterTaintSupport(4, False)
V135 = ClusterTaintSupport(16, True)


def device(*conditions: HealthCondition, driver: str = NV) -> Device:
    return Device("gpu-0", driver, health=DeviceHealth(tuple(conditions)))


def cond(
    name: str, value: str = "", severity: Severity = Severity.CRITICAL, since: float = T0
) -> HealthCondition:
    return HealthCondition(name, severity, value, since=since)


def xid(value: int, since: float = T0) -> HealthCondition:
    severity = Severity.INFO if value in (13, 31, 43, 45, 68, 109) else Severity.CRITICAL
    return cond("xid", str(value), severity, since)


def test_defaults_from_severity() -> None:
    policy = TaintPolicy.default()
    assert policy.taints_for(device(xid(79)), V134) == (
        DeviceTaint("gpu.nvidia.com/xid", "NoSchedule", "79", "2023-11-14T22:13:20Z"),
    )
    assert policy.taints_for(device(cond("gpu-lost")), V134)[0].key == "gpu.nvidia.com/gpu-lost"
    # An unmonitored device is reported, not kept free: informational on 1.35, dropped on 1.34.
    unmonitored = device(cond("unmonitored", severity=Severity.WARNING))
    assert policy.taints_for(unmonitored, V134) == ()
    assert policy.taints_for(unmonitored, V135)[0].effect == "None"
    assert policy.taints_for(device(cond("other-warning", severity=Severity.WARNING)), V134)[0].effect == (
        "NoSchedule"
    )
    amd = device(cond("ecc-uncorrectable", "umc"), driver=AMD)
    assert policy.taints_for(amd, V134) == (
        DeviceTaint("gpu.amd.com/ecc-uncorrectable", "NoSchedule", "umc", "2023-11-14T22:13:20Z"),
    )


@pytest.mark.parametrize("app_xid", [13, 31, 43, 45, 68, 109])
def test_application_xids_are_informational_on_135_and_dropped_on_134(app_xid: int) -> None:
    policy = TaintPolicy.default()
    assert policy.taints_for(device(xid(app_xid)), V134) == ()
    (taint,) = policy.taints_for(device(xid(app_xid)), V135)
    assert (taint.effect, taint.value) == ("None", str(app_xid))


def test_healthy_device_has_no_taints() -> None:
    assert TaintPolicy.default().taints_for(Device("gpu-0", NV), V135) == ()


def test_limit_keeps_the_most_severe_then_most_recent() -> None:
    conditions = [
        cond("thermal", severity=Severity.INFO, since=T0 + 100),
        cond("unmonitored", severity=Severity.WARNING, since=T0 + 50),
        cond("c-old", since=T0),
        cond("c-new", since=T0 + 10),
        cond("c-mid", since=T0 + 5),
        cond("c-oldest", since=T0 - 10),
    ]
    taints = TaintPolicy.default().taints_for(device(*conditions), V134)
    assert [t.key.split("/")[1] for t in taints] == ["c-new", "c-mid", "c-old", "c-oldest"]
    taints = TaintPolicy.default().taints_for(device(*conditions), V135)
    assert [t.key.split("/")[1] for t in taints] == [
        "c-new",
        "c-mid",
        "c-old",
        "c-oldest",
        "unmonitored",
        "thermal",
    ]
    many = [cond(f"c{i}", since=T0 + i) for i in range(20)]
    assert len(TaintPolicy.default().taints_for(device(*many), V135)) == 16
    assert len(TaintPolicy.default().taints_for(device(*many), V134)) == 4


def test_one_taint_per_key_and_effect() -> None:
    taints = TaintPolicy.default().taints_for(device(xid(48, T0), xid(79, T0 + 5), xid(13, T0 + 9)), V135)
    assert [(t.key, t.effect, t.value) for t in taints] == [
        ("gpu.nvidia.com/xid", "NoSchedule", "79"),
        ("gpu.nvidia.com/xid", "None", "13"),
    ]


def test_keys_and_values_are_valid_or_left_out() -> None:
    policy = TaintPolicy.default()
    (taint,) = policy.taints_for(device(cond("Bad Name!", "value with spaces")), V134)
    assert taint.key == "gpu.nvidia.com/Bad-Name"
    assert taint.value == ""
    assert policy.taints_for(device(cond("!!!")), V134) == ()
    long = policy.taints_for(device(cond("x" * 80, "v" * 64)), V134)[0]
    assert is_label_name(long.key) and long.value == ""


@given(st.text(max_size=80), st.text(max_size=80))
def test_every_taint_is_valid(name: str, value: str) -> None:
    condition = HealthCondition(name or "x", Severity.CRITICAL, value, since=T0)
    for taint in TaintPolicy.default().taints_for(device(condition), V135):
        assert is_label_name(taint.key)
        assert is_label_value(taint.value)
        assert taint.effect in ("NoSchedule", "NoExecute", "None")


def test_time_added_is_stable_seconds() -> None:
    assert rfc3339(T0 + 0.999) == "2023-11-14T22:13:20Z"
    assert taint_key(NV, "xid") == "gpu.nvidia.com/xid"


def test_taint_map_only_tainted_devices() -> None:
    devices = [device(xid(79)), Device("gpu-1", NV), Device("gpu-2", NV, health=DeviceHealth((xid(13),)))]
    assert list(TaintPolicy.default().taint_map(devices, V134)) == ["gpu-0"]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(text)
    return path


def test_overrides(tmp_path: Path) -> None:
    policy = TaintPolicy.load(
        write(
            tmp_path,
            """
severities:
  warning: None
  info: ignore
rules:
  - condition: xid
    value: 79
    ignore: true
  - condition: xid
    values: [13, 31]
    effect: NoSchedule
  - condition: xid
    driver: gpu.nvidia.com
    value: 31
    effect: NoExecute
  - condition: gpu-lost
    effect: NoExecute
  - condition: ecc-uncorrectable
    driver: gpu.amd.com
    ignore: true
""",
        )
    )
    assert policy.taints_for(device(xid(79)), V135) == ()
    assert policy.taints_for(device(xid(48)), V135)[0].effect == "NoSchedule"
    assert policy.taints_for(device(xid(13)), V134)[0].effect == "NoSchedule"  # forced back on
    assert policy.taints_for(device(xid(31)), V134)[0].effect == "NoExecute"  # driver + value wins
    assert policy.taints_for(device(cond("gpu-lost")), V134)[0].effect == "NoExecute"
    assert policy.taints_for(device(cond("ecc-uncorrectable", "umc"), driver=AMD), V135) == ()
    assert policy.taints_for(device(cond("ecc-uncorrectable", "sram")), V135)[0].effect == "NoSchedule"
    warning = device(cond("unmonitored", severity=Severity.WARNING))
    assert policy.taints_for(warning, V135)[0].effect == "None"
    assert policy.taints_for(warning, V134) == ()
    assert policy.taints_for(device(cond("thermal", severity=Severity.INFO)), V135) == ()


def test_later_rule_wins_among_equals(tmp_path: Path) -> None:
    policy = TaintPolicy.load(
        write(tmp_path, "rules:\n- {condition: xid, effect: NoExecute}\n- {condition: xid, effect: None}\n")
    )
    assert policy.taints_for(device(xid(48)), V135)[0].effect == "None"


def test_empty_file_is_the_default(tmp_path: Path) -> None:
    policy = TaintPolicy.load(write(tmp_path, ""))
    assert policy.taints_for(device(xid(79)), V134)[0].effect == "NoSchedule"


@pytest.mark.parametrize(
    ("text", "field", "value"),
    [
        ("[1]\n", "top level", "[1]"),
        ("rule: []\n", "rule", "'rule'"),
        ("severities: [1]\n", "severities", "[1]"),
        ("severities: {fatal: NoSchedule}\n", "severities.fatal", "'fatal'"),
        ("severities: {info: PreferNoSchedule}\n", "severities.info", "'PreferNoSchedule'"),
        ("rules: {}\n", "rules", "{}"),
        ("rules: [xid]\n", "rules[0]", "'xid'"),
        ("rules: [{condition: xid, effect: NoSchedule, when: now}]\n", "rules[0].when", "'when'"),
        ("rules: [{effect: NoSchedule}]\n", "rules[0].condition", "None"),
        ("rules: [{condition: xid, effect: Evict}]\n", "rules[0].effect", "'Evict'"),
        ("rules: [{condition: xid, effect: ignore}]\n", "rules[0].effect", "'ignore'"),
        ("rules: [{condition: xid}]\n", "rules[0]", "{'condition': 'xid'}"),
        ("rules: [{condition: xid, ignore: true, effect: None}]\n", "rules[0]", "{'condition'"),
        ("rules: [{condition: xid, ignore: yes please}]\n", "rules[0].ignore", "'yes please'"),
        (
            "rules: [{condition: xid, ignore: true, driver: 'Not A Driver'}]\n",
            "rules[0].driver",
            "'Not A Driver'",
        ),
        ("rules: [{condition: xid, ignore: true, value: 1, values: [2]}]\n", "rules[0].values", "[2]"),
        ("rules: [{condition: xid, ignore: true, values: []}]\n", "rules[0].values", "[]"),
        ("rules: [{condition: xid, ignore: true, values: [[1]]}]\n", "rules[0].values", "[1]"),
    ],
)
def test_bad_policy_files_name_file_field_and_value(
    tmp_path: Path, text: str, field: str, value: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(TaintPolicyError) as caught:
        TaintPolicy.load(path)
    message = str(caught.value)
    assert isinstance(caught.value, ConfigError)
    assert f"taint policy {path}: {field}" in message
    assert f"invalid value {value}" in message
    assert "\n" not in message


def test_unreadable_or_invalid_yaml(tmp_path: Path) -> None:
    with pytest.raises(TaintPolicyError, match="expected a readable YAML file; it is unreadable"):
        TaintPolicy.load(tmp_path / "missing.yaml")
    with pytest.raises(TaintPolicyError, match="expected a YAML file; it is not valid YAML at line 2"):
        TaintPolicy.load(write(tmp_path, "rules: [\n"))


def test_a_user_rule_overrides_the_unmonitored_default(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text("rules:\n  - condition: unmonitored\n    effect: NoSchedule\n")
    unmonitored = device(cond("unmonitored", severity=Severity.WARNING))
    assert TaintPolicy.load(path).taints_for(unmonitored, V134)[0].effect == "NoSchedule"
