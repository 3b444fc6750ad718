"""The Grafana dashboards load as dashboard models, query only metrics and labels the agent (or the
chart's scrape) gives, and colour their stat tiles by meaning."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from agent.observe.metrics import ALLOCATION_LABELS, TELEMETRY_LABELS
from tests.deploy.chart import render_objects
from tests.observability.promql import CHART_LABELS, exported_labels, metric_names, unknown_labels

GRAFANA = Path(__file__).resolve().parents[2] / "deploy" / "grafana"
DASHBOARDS = sorted(GRAFANA.glob("*.json"))
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
_LABEL_VALUES = re.compile(r"^label_values\((.*),\s*(\w+)\)$")
VENDOR_EXPORTERS: dict[str, frozenset[str]] = {
    # dcgm-exporter (NVIDIA): its per-GPU labels, a MIG instance's, and the pod labels it adds in
    # Kubernetes mode (internal/pkg/rendermetrics/render_metrics.go, transformation/kubernetes.go).
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": frozenset(
        {"gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname", "GPU_I_PROFILE", "GPU_I_ID"}
        | {"namespace", "pod", "container"}
    ),
    # AMD device-metrics-exporter: exportermetrics.GPUMetricLabel names, lower-cased as it exports them.
    "gpu_gfx_activity": frozenset(
        {"gpu_uuid", "serial_number", "gpu_id", "card_model", "hostname", "namespace", "pod", "container"}
    ),
}
"""Vendor exporters' series the Workloads dashboard joins with (only that dashboard may query them)."""
WORKLOADS = GRAFANA / "workloads.json"


def load(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    assert isinstance(data, dict)
    return data


def targets(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [t for p in dashboard["panels"] for t in p.get("targets", [])]


def test_the_four_dashboards_exist() -> None:
    assert {p.stem for p in DASHBOARDS} == {
        "fleet-overview",
        "node-drilldown",
        "device-telemetry",
        "workloads",
    }


def series_labels(path: Path) -> dict[str, frozenset[str]]:
    """What `path` may query: the agent's series, and the vendor exporters' for the Workloads one."""
    return exported_labels() | (VENDOR_EXPORTERS if path == WORKLOADS else {})


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
    used = set(re.findall(r"\$([A-Za-z_]\w*)", json.dumps(dashboard)))  # not label_replace's $1
    assert used - {"__rate_interval", "__interval"} <= set(variables), used - set(variables)
    for variable in variables.values():
        if variable["type"] == "query":
            assert variable["datasource"] == DATASOURCE


def queries(dashboard: dict[str, Any]) -> list[tuple[str, set[str]]]:
    """Each PromQL query of the dashboard with the labels its legend or variable reads."""
    found = [
        (t["expr"], set(re.findall(r"\{\{\s*(\w+)\s*\}\}", t.get("legendFormat", ""))))
        for t in targets(dashboard)
    ]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            match = _LABEL_VALUES.match(variable["definition"])
            assert match, variable["definition"]
            found.append((match.group(1), {match.group(2)}))
    return found


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboard_queries_only_exported_metrics(path: Path) -> None:
    exported = series_labels(path)
    queried = set().union(*(metric_names(expr) for expr, _ in queries(load(path))))
    assert queried, "no metrics found"
    unknown = sorted(queried - set(exported))
    assert not unknown, f"{path.name} queries metrics the agent does not export: {unknown}"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboard_queries_only_labels_the_series_have(path: Path) -> None:
    """Labels come from the agent, from Prometheus (job, instance) or from the chart's monitors
    (node): a dashboard needing another label shows "no data"."""
    exported = series_labels(path)
    for expr, legend in queries(load(path)):
        unknown = unknown_labels(expr, exported, legend)
        assert not unknown, f"{path.name}: {expr!r} uses labels no series has: {sorted(unknown)}"


def test_label_check_is_not_vacuous() -> None:
    exported = exported_labels()
    assert unknown_labels(
        'sum by (driver, gpu) (dra_agent_devices{health="healthy", pod="p"})', exported
    ) == {
        "gpu",
        "pod",
    }
    assert unknown_labels("dra_agent_devices", exported, {"vendor"}) == {"vendor"}
    assert not unknown_labels('max by (node, instance) (dra_agent_devices{job="x"})', exported)


def test_the_chart_adds_the_node_label_in_both_monitors() -> None:
    """templates/_monitoring.tpl: the node label the dashboards rely on (CHART_LABELS)."""
    values = {"metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}}}
    monitors = [o for o in render_objects(values) if o["kind"] in {"ServiceMonitor", "PodMonitor"}]
    assert len(monitors) == 2
    for monitor in monitors:
        (endpoint,) = monitor["spec"].get("endpoints") or monitor["spec"]["podMetricsEndpoints"]
        added = {r["targetLabel"] for r in endpoint["relabelings"]}
        assert added == set(CHART_LABELS), monitor["kind"]
        assert endpoint["relabelings"] == [
            {"sourceLabels": ["__meta_kubernetes_pod_node_name"], "targetLabel": "node"}
        ]


STAT_COLOURS = {
    # dashboard stem, tile title: {value: colour}
    ("fleet-overview", "Unhealthy devices"): {0: "green", 1: "red"},
    ("fleet-overview", "Active device taints"): {0: "green", 1: "orange"},
    ("fleet-overview", "Nodes not ready"): {0: "green", 1: "red"},
    ("node-drilldown", "Kubelet registration"): {0: "red", 1: "green"},
    ("node-drilldown", "Health monitor last answer (age)"): {10: "green", 60: "orange", 180: "red"},
    ("node-drilldown", "Health stream watchers"): {0: "blue", 3: "blue"},
}
"""What each stat tile's colour says (the alert thresholds where one exists)."""


def threshold_colour(panel: dict[str, Any], value: float) -> str:
    """The colour Grafana gives `value` from the tile's absolute thresholds."""
    thresholds = panel["fieldConfig"]["defaults"]["thresholds"]
    assert thresholds["mode"] == "absolute", panel["title"]
    steps = thresholds["steps"]
    assert steps[0]["value"] is None, f"{panel['title']}: the first step is the base (value null)"
    limits = [s["value"] for s in steps[1:]]
    assert limits == sorted(limits), panel["title"]
    colour: str = steps[0]["color"]
    for step in steps[1:]:
        if value >= step["value"]:
            colour = step["color"]
    return colour


def test_stat_tiles_are_coloured_by_their_thresholds() -> None:
    """Without thresholds Grafana's default (green, red from 80) keeps "Unhealthy devices" green."""
    tiles = {
        (path.stem, panel["title"]): panel
        for path in DASHBOARDS
        for panel in load(path)["panels"]
        if panel["type"] == "stat"
    }
    assert set(tiles) == set(STAT_COLOURS), "give each stat tile its colours in STAT_COLOURS"
    for key, colours in STAT_COLOURS.items():
        panel = tiles[key]
        assert panel["options"]["colorMode"] in {"background", "value"}, key
        for value, colour in colours.items():
            assert threshold_colour(panel, value) == colour, (key, value)


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


_JOIN = re.compile(r"\bon\s*\(([^)]*)\)\s*group_(?:left|right)")


def test_workloads_joins_telemetry_and_vendor_exporters_on_uuid() -> None:
    """One ``on (UUID)`` joins the allocation info with the agent's telemetry; dcgm-exporter's join
    adds ``GPU_I_ID`` (its MIG series carry the parent GPU's ``UUID``: the allocation info's
    ``parent_UUID`` is renamed to ``UUID`` by label_replace); AMD's exporter's ``gpu_uuid`` is
    renamed to ``UUID`` by label_replace."""
    assert {"UUID", "namespace", "pod", "container"} <= set(ALLOCATION_LABELS)
    assert "UUID" in TELEMETRY_LABELS and "pci_bus_id" in ALLOCATION_LABELS
    labels = series_labels(WORKLOADS)
    joined: set[str] = set()
    for expr, _ in queries(load(WORKLOADS)):
        for clause in _JOIN.findall(expr):
            keys = [k.strip() for k in clause.split(",")]
            assert keys == ["UUID"] or (keys == ["UUID", "GPU_I_ID"] and '"parent_UUID"' in expr), expr
            assert "dra_agent_device_allocation_info" in metric_names(expr), expr
            for metric in metric_names(expr) - {"dra_agent_device_allocation_info"}:
                renamed = "label_replace(" in expr and '"UUID"' in expr
                assert "UUID" in labels[metric] or renamed, (metric, expr)
                joined.add(metric)
    assert {"dra_agent_device_utilization_ratio", *VENDOR_EXPORTERS} <= joined
