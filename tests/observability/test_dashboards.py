"""The Grafana dashboards load as dashboard models and query only metrics the agent exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from agent.observe.metrics import Metrics

GRAFANA = Path(__file__).resolve().parents[2] / "deploy" / "grafana"
DASHBOARDS = sorted(GRAFANA.glob("*.json"))
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# Series Prometheus itself adds to every target.
PROMETHEUS_SERIES = {"up"}
PROMQL_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
    "offset", "le", "inf", "nan", "vector", "time",
}  # fmt: skip
_SUFFIXES = {"histogram": ("_bucket", "_count", "_sum"), "counter": ("",), "gauge": ("",), "info": ("",)}


def exported_series() -> set[str]:
    """Every sample name the agent's /metrics can show (from the TYPE lines of a fresh registry)."""
    text = generate_latest(Metrics().registry).decode()
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.update(name + suffix for suffix in _SUFFIXES.get(kind, ("",)))
    return names


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (not functions, labels, keywords or variables)."""
    text = re.sub(r'"[^"]*"', "", expr)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    text = re.sub(r"\$\w+", "", text)
    found = set()
    for match in re.finditer(r"(?<![\w.])([a-zA-Z_:][\w:]*)(\s*\()?", text):
        name, call = match.group(1), match.group(2)
        if not call and name.lower() not in PROMQL_WORDS:
            found.add(name)
    return found


def load(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    assert isinstance(data, dict)
    return data


def targets(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [t for p in dashboard["panels"] for t in p.get("targets", [])]


def test_the_three_dashboards_exist() -> None:
    assert {p.stem for p in DASHBOARDS} == {"fleet-overview", "node-drilldown", "device-telemetry"}


def test_metric_name_extraction() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le) (rate(dra_agent_x_bucket{driver=~"$driver"}[5m])))'
        ' / on (node) group_left dra_agent_y or vector(0) and up{job="a"} == 0'
    )
    assert metric_names(expr) == {"dra_agent_x_bucket", "dra_agent_y", "up"}


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboard_model(path: Path) -> None:
    dashboard = load(path)
    for key in ("uid", "title", "panels", "templating", "schemaVersion", "time"):
        assert key in dashboard, key
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert {"id", "type", "title", "gridPos"} <= panel.keys()
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and grid["h"] > 0
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids))
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE
            assert target["expr"].strip()
    used = set(re.findall(r"\$(\w+)", json.dumps(dashboard)))
    assert used - {"__rate_interval", "__interval"} <= set(variables), used - set(variables)
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"] == DATASOURCE


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboard_queries_only_exported_metrics(path: Path) -> None:
    exported = exported_series() | PROMETHEUS_SERIES
    dashboard = load(path)
    exprs = [t["expr"] for t in targets(dashboard)]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            exprs.append(re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", variable["definition"]))
    queried = set().union(*(metric_names(e) for e in exprs))
    assert queried, "no metrics found"
    unknown = sorted(queried - exported)
    assert not unknown, f"{path.name} queries metrics the agent does not export: {unknown}"


def test_dashboards_cover_the_issue_panels() -> None:
    fleet = json.dumps(load(GRAFANA / "fleet-overview.json"))
    for needle in (
        "dra_agent_devices",
        "dra_agent_device_taints",
        "histogram_quantile(0.99",
        '"heatmap"',
        "dra_agent_publish_errors_total",
        "Nodes not ready",
    ):
        assert needle in fleet, needle
    telemetry = json.dumps(load(GRAFANA / "device-telemetry.json"))
    assert "dra_agent_device_temperature_celsius" in telemetry
    assert "dra_agent_health_events_total" in telemetry
