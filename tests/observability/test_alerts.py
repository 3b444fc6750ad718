"""The chart's alerting rules: shipped as a PrometheusRule when asked, valid for Prometheus, each
alert firing on its fault and silent otherwise (promtool unit tests), on series the agent exports."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from tests.deploy.chart import CHART, KUBE_VERSION, NAMESPACE, render_objects
from tests.observability.promql import exported_labels, metric_names, unknown_labels

RULES = CHART / "files" / "prometheus-rules.yaml"
UNIT_TESTS = Path(__file__).with_name("prometheus-rules.test.yaml")
ENABLED = {"metrics": {"prometheusRule": {"enabled": True, "labels": {"release": "prometheus"}}}}
ALERTS = {
    "DraAgentDeviceTainted",
    "DraAgentHealthMonitorSilent",
    "DraAgentPublishFailing",
    "DraAgentTaintsUnpublishable",
    "DraAgentClaimErrors",
    "DraAgentClaimStatusFailing",
    "DraAgentCheckpointRecovered",
    "DraAgentRegistrationLost",
    "DraAgentHealthPassStale",
    "DraAgentHealthCheckFailing",
    "DraDeviceDegraded",
    "DraAgentDown",
    "DraAgentUnavailable",
    "DraAgentAbsent",
}
DEVICE_ALERTS = {"DraAgentDeviceTainted", "DraAgentTaintsUnpublishable", "DraDeviceDegraded"}
"""Alerts on a device's state: they must not resolve just because the agent stopped reporting."""
KUBE_STATE_METRICS = {
    name: frozenset({"namespace", "daemonset"})
    for name in ("kube_daemonset_status_desired_number_scheduled", "kube_daemonset_status_number_available")
}
"""kube-state-metrics' series the presence alerts use, to see nodes with no agent (and so no target)."""
AWAITED_METRICS: dict[str, str] = {}
"""Metrics a rule queries that a branch being merged beside this one adds."""
# On the PATH, or where `make test` puts it (beside the virtual environment's python).
PROMTOOL = shutil.which(
    "promtool", path=os.pathsep.join([os.environ.get("PATH", ""), str(Path(sys.executable).parent)])
)
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not found: `make promtool` takes it from Debian's prometheus package into .venv/bin "
    "(or apt-get install prometheus)",
)


def rule_groups() -> dict[str, Any]:
    groups = yaml.safe_load(RULES.read_text())
    assert isinstance(groups, dict)
    return groups


def alert_rules() -> list[dict[str, Any]]:
    return [rule for group in rule_groups()["groups"] for rule in group["rules"] if "alert" in rule]


def promtool(*args: str, cwd: Path) -> str:
    assert PROMTOOL is not None
    done = subprocess.run(
        [PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, f"promtool {' '.join(args)}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_the_rule_is_off_by_default() -> None:
    assert not [o for o in render_objects() if o["kind"] == "PrometheusRule"]


def test_the_chart_ships_the_rule_file_as_is() -> None:
    (rule,) = [o for o in render_objects(ENABLED) if o["kind"] == "PrometheusRule"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "prometheus"
    assert rule["metadata"]["namespace"] == "dra-agent"
    assert rule["spec"] == rule_groups()
    report = helm.lint(CHART, ENABLED, strict=True, kube_version=f"v{KUBE_VERSION}")
    assert not report["errors"] and not [m for m in report["messages"] if m["severity"] >= 2], report


def test_every_alert_says_how_bad_and_what_to_do() -> None:
    rules = alert_rules()
    assert {r["alert"] for r in rules} == ALERTS
    for rule in rules:
        assert rule["labels"]["severity"] in {"info", "warning", "critical"}, rule["alert"]
        assert (rule["labels"]["severity"] == "info") == (rule["alert"] == "DraDeviceDegraded"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]


def test_rules_query_only_exported_metrics_and_labels() -> None:
    exported = exported_labels() | KUBE_STATE_METRICS
    pending = {name: frozenset({"driver"}) for name in AWAITED_METRICS if name not in exported}
    for rule in alert_rules():
        expr = rule["expr"]
        unknown = metric_names(expr) - set(exported) - set(pending)
        assert not unknown, f"{rule['alert']} queries metrics the agent does not export: {unknown}"
        assert not unknown_labels(expr, exported | pending), rule["alert"]


def duration(text: str) -> int:
    """Seconds of a Prometheus duration such as 10m or 1h30m."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    parts = re.findall(r"(\d+)([smhd])", text)
    assert parts and "".join(n + u for n, u in parts) == text, text
    return sum(int(n) * units[u] for n, u in parts)


def test_device_alerts_outlive_the_agent_until_agent_down_fires() -> None:
    """When the agent dies its series end; a device alert without keep_firing_for would resolve at
    the next evaluation, as if the device had recovered, before DraAgentDown fires."""
    rules = {r["alert"]: r for r in alert_rules()}
    down = duration(rules["DraAgentDown"]["for"])
    for name in DEVICE_ALERTS:
        assert duration(rules[name].get("keep_firing_for", "0s")) > down, name
        assert "DraAgentDown" in rules[name]["annotations"]["description"], name


def matcher(label: str, alert: str) -> str:
    """The regex the presence alert `alert` selects `label` by (job=~"...")."""
    (rule,) = [r for r in alert_rules() if r["alert"] == alert]
    found: set[str] = set(re.findall(label + r'=~"([^"]*)"', rule["expr"]))
    assert len(found) == 1, (alert, label, found)
    return found.pop()


@pytest.mark.parametrize("release", ["dra-agent", "gpu", "dra-agent-nvidia"])
def test_presence_alerts_find_the_charts_job_and_daemonset(release: str) -> None:
    """The rule file cannot know the release: its job and daemonset matchers must match what the
    chart names, for any release name (PromQL regexes are anchored, as fullmatch)."""
    values = {"metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}}}
    rendered = helm.Chart.load(CHART).render(values, name=release, namespace=NAMESPACE, is_install=True)
    objects = [
        doc
        for path, text in rendered.items()
        if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if isinstance(doc, dict)
    ]
    names = {o["kind"]: o["metadata"]["name"] for o in objects}
    jobs = {
        names["Service"],  # a ServiceMonitor's job is the Service's name
        f"{NAMESPACE}/{names['PodMonitor']}",  # a PodMonitor's is <namespace>/<name>
    }
    for alert in ("DraAgentDown", "DraAgentAbsent"):
        for job in jobs:
            assert re.fullmatch(matcher("job", alert), job), (alert, job)
    for alert in ("DraAgentUnavailable", "DraAgentAbsent"):
        assert re.fullmatch(matcher("daemonset", alert), names["DaemonSet"]), (alert, names["DaemonSet"])
    assert not re.fullmatch(matcher("job", "DraAgentDown"), "node-exporter")


def test_every_alert_has_a_case_where_it_fires_and_one_where_it_is_silent() -> None:
    cases = yaml.safe_load(UNIT_TESTS.read_text())
    fires: set[str] = set()
    silent: set[str] = set()
    for test in cases["tests"]:
        for case in test["alert_rule_test"]:
            (fires if case["exp_alerts"] else silent).add(case["alertname"])
    assert fires == ALERTS, ALERTS - fires
    assert silent == ALERTS, ALERTS - silent


@needs_promtool
def test_promtool_checks_the_rules(tmp_path: Path) -> None:
    (tmp_path / "rules.yaml").write_text(RULES.read_text())
    assert f"SUCCESS: {len(ALERTS)} rules found" in promtool("check", "rules", "rules.yaml", cwd=tmp_path)


@needs_promtool
def test_promtool_unit_tests(tmp_path: Path) -> None:
    """tests/observability/prometheus-rules.test.yaml: each alert fires on its fault, stays silent
    otherwise. Annotations are left out here (promtool would compare their full text)."""
    groups = rule_groups()
    for group in groups["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(groups))
    shutil.copy(UNIT_TESTS, tmp_path / UNIT_TESTS.name)
    assert "SUCCESS" in promtool("test", "rules", UNIT_TESTS.name, cwd=tmp_path)
