from __future__ import annotations

import ast
import re
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agent.core.backend import declared_conditions
from agent.core.inventory import Inventory
from agent.observe.metrics import (
    API_RETRY_REASONS,
    CHECKPOINT_RECOVERY_REASONS,
    CLAIM_ERROR_REASONS,
    CLAIM_OPERATIONS,
    CLAIM_RESULTS,
    GRPC_METHODS,
    HEALTH_LABELS,
    PUBLISH_ERROR_REASONS,
    REGISTRATION_RESULTS,
    REJECTED_DEVICE_REASONS,
    WATCH_RESTART_REASONS,
    Children,
    Metrics,
)
from agent.observe.telemetry import TelemetryPoller
from backends.amd import health as amd_health
from backends.amd.backend import AmdBackend
from backends.fake.backend import FakeBackend
from backends.fake.conditions import CONDITIONS as FAKE_CONDITIONS
from backends.fake.faults import FaultInjector
from backends.nvidia import health as nvidia_health
from backends.nvidia.backend import NvidiaBackend
from tests.observability.fakes import DRIVER, TelemetryBackend

ROOT = Path(__file__).resolve().parents[2]

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


def samples(metrics: Metrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of the /metrics text: (name, labels) -> value."""
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_fresh_metrics_expose_every_known_event_series_at_zero() -> None:
    """Before any event, /metrics already shows each condition and reason at 0, so that
    `increase()` (which needs two samples of one series) sees the first event of each."""
    metrics = Metrics()
    metrics.init_driver(DRIVER, ("xid", "gpu-lost"))
    found = samples(metrics)

    def at_zero(name: str, **labels: str) -> bool:
        return found.get((name, frozenset(labels.items()))) == 0

    for condition in ("xid", "gpu-lost"):
        assert at_zero("dra_agent_health_events_total", driver=DRIVER, condition=condition), condition
    for operation in CLAIM_OPERATIONS:
        for result in CLAIM_RESULTS:
            assert at_zero(
                "dra_agent_claim_operations_total", driver=DRIVER, operation=operation, result=result
            )
        for reason in CLAIM_ERROR_REASONS[operation]:
            assert at_zero("dra_agent_claim_errors_total", driver=DRIVER, operation=operation, reason=reason)
    for reason in PUBLISH_ERROR_REASONS:
        assert at_zero("dra_agent_publish_errors_total", driver=DRIVER, reason=reason), reason
    for reason in CHECKPOINT_RECOVERY_REASONS:
        assert at_zero("dra_agent_checkpoint_recoveries_total", reason=reason), reason
    for result in REGISTRATION_RESULTS:
        assert at_zero("dra_agent_kubelet_registration_notifications_total", driver=DRIVER, result=result)
    # Issue 25 point 4: these had no series until their first event.
    for reason in REJECTED_DEVICE_REASONS:
        assert at_zero("dra_agent_rejected_devices_total", driver=DRIVER, reason=reason), reason
    for reason in API_RETRY_REASONS:
        assert at_zero("dra_agent_api_retries_total", reason=reason), reason
    for reason in WATCH_RESTART_REASONS:
        assert at_zero("dra_agent_watch_restarts_total", resource="resourceslices", reason=reason), reason
    for method in GRPC_METHODS:
        assert at_zero("dra_agent_grpc_in_flight_requests", driver=DRIVER, method=method), method
    assert set(CLAIM_ERROR_REASONS) == set(CLAIM_OPERATIONS)


def test_the_device_rules_and_the_watch_use_only_reasons_created_at_start() -> None:
    from agent.kube import publisher, validation

    device_rules = _reasons(Path(validation.__file__), "Problem", 3)
    rules = device_rules["check_device_entry"] | device_rules["partition_entries"]
    rules |= _reasons(ROOT / "agent" / "kube" / "pool.py", "Problem", 3)["desired_pool"]
    assert rules and rules <= set(REJECTED_DEVICE_REASONS), rules - set(REJECTED_DEVICE_REASONS)
    source = Path(publisher.__file__).read_text()
    watch_reasons = set(re.findall(r'reason(?:, \w+)? = "(\w+)"', source)) - {"node_missing"}
    assert watch_reasons <= set(WATCH_RESTART_REASONS) | set(API_RETRY_REASONS), watch_reasons


def test_telemetry_poller_creates_the_backends_declared_conditions() -> None:
    """The runner makes one poller per driver; it creates the conditions its backend declares."""
    backend = FakeBackend(DRIVER, [], FaultInjector())
    metrics = Metrics()
    TelemetryPoller(backend, Inventory(DRIVER), metrics, node_name="node-a")
    get = metrics.registry.get_sample_value
    assert declared_conditions(backend) == tuple(FAKE_CONDITIONS)
    for condition in FAKE_CONDITIONS:
        assert get("dra_agent_health_events_total", {"driver": DRIVER, "condition": condition}) == 0


def test_declaring_conditions_is_optional() -> None:
    backend = TelemetryBackend()
    assert declared_conditions(backend) == ()
    metrics = Metrics()
    TelemetryPoller(backend, Inventory(DRIVER), metrics, node_name="node-a")
    assert "dra_agent_health_events_total{" not in generate_latest(metrics.registry).decode()


def test_vendor_backends_declare_what_their_monitors_report() -> None:
    assert NvidiaBackend.health_conditions == nvidia_health.CONDITIONS
    assert set(nvidia_health.CONDITIONS) == {
        "xid",
        "gpu-lost",
        "unmonitored",
        "ecc-uncorrectable",
        "ecc-correctable",
        "retired-pages-pending",
        "row-remap-failure",
        "row-remap-pending",
        "recovery-action",
        "ecc-correctable-rate",
        "pcie-replay-rate",
        "nvlink-errors",
    }
    assert set(NvidiaBackend.trend_conditions) <= set(nvidia_health.CONDITIONS)
    assert AmdBackend.health_conditions == amd_health.CONDITIONS
    event_conditions = {condition for condition, _, _ in amd_health.EVENT_CONDITIONS.values()}
    polled = {"ecc-uncorrectable", "cper-fatal", "gpu-lost", "unmonitored", "bad-pages"}
    polled |= set(AmdBackend.trend_conditions)
    assert set(amd_health.CONDITIONS) == event_conditions | polled


def _strings(expr: ast.expr) -> set[str]:
    """The plain string literals of `expr` (f-strings build dynamic values: skipped)."""
    if isinstance(expr, ast.Constant):
        return {expr.value} if isinstance(expr.value, str) else set()
    if isinstance(expr, ast.JoinedStr):
        return set()
    return set().union(
        set(), *(_strings(child) for child in ast.iter_child_nodes(expr) if isinstance(child, ast.expr))
    )


def _reasons(path: Path, callee: str, index: int) -> dict[str, set[str]]:
    """Function name -> the strings passed at position `index` to calls of `callee` (a dotted
    suffix), literally or through a local variable assigned string literals."""
    found: dict[str, set[str]] = {}
    for function in ast.walk(ast.parse(path.read_text())):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        assigned: dict[str, set[str]] = {}
        for node in ast.walk(function):
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
            ):
                assigned.setdefault(node.targets[0].id, set()).update(_strings(node.value))
        for node in ast.walk(function):
            if not isinstance(node, ast.Call) or not ast.unparse(node.func).endswith(callee):
                continue
            if len(node.args) <= index:
                continue
            arg = node.args[index]
            values = assigned.get(arg.id, set()) if isinstance(arg, ast.Name) else _strings(arg)
            if values:
                found.setdefault(function.name, set()).update(values)
    return found


def test_the_claims_code_raises_only_reasons_created_at_start() -> None:
    """A reason missing from CLAIM_ERROR_REASONS or CHECKPOINT_RECOVERY_REASONS would again get
    no series until its first failure."""
    claims = ROOT / "agent" / "claims"
    every_claim_reason = set().union(*CLAIM_ERROR_REASONS.values())
    scanned: set[str] = set()
    for path in sorted(claims.rglob("*.py")):
        for callee in ("ClaimFailure", "ClaimAllocationError"):
            for function, reasons in _reasons(path, callee, 1).items():
                operation = "unprepare" if "unprepare" in function else "prepare"
                unknown = reasons - set(CLAIM_ERROR_REASONS[operation])
                assert not unknown, (
                    f"{path.name}:{function}: add {unknown} to CLAIM_ERROR_REASONS[{operation!r}]"
                )
                scanned |= reasons
        for function, reasons in _reasons(path, "report.count", 2).items():
            assert reasons <= every_claim_reason, (
                f"{path.name}:{function}: add {reasons} to CLAIM_ERROR_REASONS"
            )
            scanned |= reasons
        for function, reasons in _reasons(path, "CheckpointCorruptError", 1).items():
            unknown = reasons - set(CHECKPOINT_RECOVERY_REASONS)
            assert not unknown, f"{path.name}:{function}: add {unknown} to CHECKPOINT_RECOVERY_REASONS"
            scanned |= reasons
    assert {"other_node", "cdi", "api", "checksum_mismatch"} <= scanned, (
        "the scan no longer finds the reasons"
    )


def test_the_publisher_counts_only_reasons_created_at_start() -> None:
    scanned: set[str] = set()
    for path in sorted((ROOT / "agent" / "kube").glob("*.py")):
        for function, reasons in _reasons(path, "publish_errors.labels", 1).items():
            unknown = reasons - set(PUBLISH_ERROR_REASONS)
            assert not unknown, f"{path.name}:{function}: add {unknown} to PUBLISH_ERROR_REASONS"
            scanned |= reasons
    assert {"unreachable", "internal"} <= scanned, "the scan no longer finds the reasons"


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


def test_children_looks_each_label_set_up_once() -> None:
    metrics = Metrics()
    child = Children()
    first = child(metrics.claim_operations, "d", "prepare", "success")
    assert child(metrics.claim_operations, "d", "prepare", "success") is first
    first.inc()
    child(metrics.claim_operations, "d", "prepare", "error").inc(2)
    child(metrics.grpc_requests, "d", "prepare", "error").inc()  # same labels, another metric
    sample = metrics.registry.get_sample_value
    labels = {"driver": "d", "operation": "prepare"}
    assert sample("dra_agent_claim_operations_total", {**labels, "result": "success"}) == 1
    assert sample("dra_agent_claim_operations_total", {**labels, "result": "error"}) == 2
    grpc = {"driver": "d", "method": "prepare", "result": "error"}
    assert sample("dra_agent_grpc_requests_total", grpc) == 1
