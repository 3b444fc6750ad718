from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent.observe.metrics import CLAIM_OPERATIONS, HEALTH_LABELS, Metrics

NAME = re.compile(r"^dra_agent_[a-z0-9_]+$")
UNIT_SUFFIXES = ("_seconds", "_bytes", "_celsius", "_watts", "_ratio", "_total", "_info")


def families(metrics: Metrics) -> dict[str, str]:
    text = generate_latest(metrics.registry).decode()
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def test_names_follow_prometheus_conventions() -> None:
    found = families(Metrics())
    assert len(found) > 30
    for name, kind in found.items():
        assert NAME.match(name), name
        if kind == "counter":
            # The parser strips _total from counter family names; the sample keeps it.
            assert not name.endswith("_total"), name
        assert "_milliseconds" not in name and "_kilobytes" not in name, name
    text = generate_latest(Metrics().registry).decode()
    for line in text.splitlines():
        if line.startswith("# TYPE") and line.endswith(" counter"):
            assert line.split()[2].endswith("_total"), line


def test_init_driver_creates_known_series_at_zero() -> None:
    metrics = Metrics()
    metrics.init_driver("gpu.example.com")
    get = metrics.registry.get_sample_value
    labels = {"driver": "gpu.example.com"}
    assert get("dra_agent_kubelet_registration_status", labels) == 0
    assert get("dra_agent_prepared_claims", labels) == 0
    assert get("dra_agent_resourceslices", labels) == 0
    assert get("dra_agent_telemetry_read_errors_total", labels) == 0
    for health in HEALTH_LABELS:
        assert get("dra_agent_devices", {**labels, "health": health}) == 0
    for operation in CLAIM_OPERATIONS:
        count = get("dra_agent_claim_operation_duration_seconds_count", {**labels, "operation": operation})
        assert count == 0
    assert set(HEALTH_LABELS) == {"healthy", "unhealthy", "unknown"}


def test_latency_buckets_span_1ms_to_30s() -> None:
    metrics = Metrics()
    metrics.init_driver("d")
    text = generate_latest(metrics.registry).decode()
    buckets = re.findall(
        r'dra_agent_claim_operation_duration_seconds_bucket\{driver="d",le="([^"]+)",operation="prepare"\}',
        text,
    )
    assert buckets[0] == "0.001"
    assert buckets[-2:] == ["30.0", "+Inf"]


def test_registries_are_independent() -> None:
    a, b = Metrics(), Metrics()
    a.init_driver("d")
    a.prepared_claims.labels("d").set(3)
    assert b.registry.get_sample_value("dra_agent_prepared_claims", {"driver": "d"}) is None


def test_every_metric_is_documented() -> None:
    doc = (Path(__file__).resolve().parents[2] / "deploy" / "observability.md").read_text()
    text = generate_latest(Metrics().registry).decode()
    names = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    missing = [n for n in names if f"`{n}`" not in doc and f"`{n}_info`" not in doc]
    assert not missing, f"add these metrics to deploy/observability.md: {missing}"
