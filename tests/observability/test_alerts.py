"""The chart's alerting rules: shipped as a PrometheusRule when asked, valid for Prometheus, each
alert firing on its fault and silent otherwise (promtool unit tests), on series the agent exports."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from tests.deploy.chart import CHART, KUBE_VERSION, render_objects
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
    "DraAgentCheckpointRecovered",
    "DraAgentRegistrationLost",
}
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
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]


def test_rules_query_only_exported_metrics_and_labels() -> None:
    exported = exported_labels()
    pending = {name: frozenset({"driver"}) for name in AWAITED_METRICS if name not in exported}
    for rule in alert_rules():
        expr = rule["expr"]
        unknown = metric_names(expr) - set(exported) - set(pending)
        assert not unknown, f"{rule['alert']} queries metrics the agent does not export: {unknown}"
        assert not unknown_labels(expr, exported | pending), rule["alert"]


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
