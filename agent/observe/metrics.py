"""Prometheus metrics of the agent, all on one `CollectorRegistry` passed in as a dependency.

Naming follows Prometheus conventions: ``dra_agent_`` prefix, base units, ``_total`` counters,
``_seconds`` and ``_bytes``. Components receive the `Metrics` object and update it; nothing here
calls a vendor library, so a scrape never blocks on hardware.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from agent import __version__
from agent.core.model import HealthStatus

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TELEMETRY_LABELS = ("driver", "pool", "device", "UUID", "pci_bus_id", "product")
"""Labels of every per-device telemetry gauge; ``pool`` is the node name (the slices' pool).
``UUID`` and ``pci_bus_id`` are spelled as dcgm-exporter spells them, so one ``on(UUID)`` joins them
with `ALLOCATION_LABELS` and with dcgm-exporter's series."""
ALLOCATION_LABELS = (
    "driver",
    "pool",
    "device",
    "UUID",
    "pci_bus_id",
    "parent_UUID",
    "GPU_I_ID",
    "namespace",
    "pod",
    "container",
    "claim",
)
"""Labels of ``dra_agent_device_allocation_info``: the device (as in `TELEMETRY_LABELS`; a MIG
device's own UUID, a dynamic one's once created), the physical GPU's UUID and GPU instance ID
of a MIG device (empty otherwise; dcgm-exporter labels MIG series with the parent's ``UUID`` and
``GPU_I_ID``), the pod and container using it (dcgm-exporter's and AMD's device-metrics-exporter's
names) and the claim."""
CLAIM_OPERATIONS = ("prepare", "unprepare")
HEALTH_LABELS = tuple(status.value.lower() for status in HealthStatus)
"""Values of the ``health`` label of `Metrics.devices`: healthy, unhealthy, unknown."""

# The label values below are created at 0 at start, so `increase()` sees the first event of each
# (a counter series born at 1 shows no increase). tests/observability/test_metrics.py checks that
# the code raises no reason missing here.
CLAIM_RESULTS = ("success", "error")
CLAIM_ERROR_REASONS: Mapping[str, tuple[str, ...]] = {
    "prepare": (
        "api",
        "claim_state",
        "invalid",
        "other_node",
        "unknown_device",
        "backend",
        "cdi",
        "checkpoint",
        "config",
        "share_conflict",
        "internal",
    ),
    "unprepare": ("backend", "cdi", "checkpoint", "internal"),
}
"""``reason`` values of `Metrics.claim_errors` per operation (agent/claims/state*.py, reader.py)."""
PUBLISH_ERROR_REASONS = (
    "unreachable",
    "throttled",
    "conflict",
    "server_error",
    "node_missing",
    "internal",
    "taints_unsupported",
    "counters_unsupported",
    "shares_unsupported",
)
"""``reason`` values of `Metrics.publish_errors` known in advance (agent/kube/publisher.py); refusals
add ``http_<status>``."""
API_RETRY_REASONS = ("unreachable", "throttled", "conflict", "server_error", "node_missing", "internal")
"""``reason`` values of `Metrics.api_retries` known in advance (refusals add ``http_<status>``)."""
WATCH_RESTART_REASONS = ("closed", "expired", "error", "internal")
"""``reason`` values of `Metrics.watch_restarts` (agent/kube/publisher.py, the slice watch)."""
REJECTED_DEVICE_REASONS = ("name", "attributes", "capacity", "taints", "duplicate", "conversion")
"""``reason`` values of `Metrics.rejected_devices`: the device rules of agent/kube/validation.py."""
GRPC_METHODS = tuple(
    f"{version}.{method}"
    for version in ("v1", "v1beta1")
    for method in ("NodePrepareResources", "NodeUnprepareResources")
)
"""``method`` values of `Metrics.grpc_in_flight` (agent/kubelet/draservice.py)."""
WATCHED_RESOURCE = "resourceslices"
CHECKPOINT_RECOVERY_REASONS = (
    "unreadable",
    "invalid_json",
    "unknown_version",
    "invalid_schema",
    "checksum_mismatch",
    "torn_journal",
)
"""``reason`` values of `Metrics.checkpoint_recoveries` (agent/claims/checkpoint*.py)."""
REGISTRATION_RESULTS = ("accepted", "refused")


class Metrics:
    """Every metric family of the agent.

    Units: durations in seconds, memory in bytes, temperature in degrees Celsius, power in
    watts, utilization as a 0-1 ratio, timestamps in Unix seconds. Call `init_driver` for each
    driver at start so the series that can be known then exist at zero (dashboards and alerts
    then see 0, not "no data").
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.build_info = Info("dra_agent_build", "Version of the agent.", registry=r)
        self.build_info.info({"version": __version__})

        # Kubelet side.
        self.grpc_requests = Counter(
            "dra_agent_grpc_requests_total",
            "Kubelet gRPC calls by driver, method and result.",
            ("driver", "method", "result"),
            registry=r,
        )
        self.claim_operations = Counter(
            "dra_agent_claim_operations_total",
            "Claims prepared or unprepared, by result.",
            ("driver", "operation", "result"),
            registry=r,
        )
        self.claim_errors = Counter(
            "dra_agent_claim_errors_total",
            "Failed claim operations by reason.",
            ("driver", "operation", "reason"),
            registry=r,
        )
        self.claim_latency = Histogram(
            "dra_agent_claim_operation_duration_seconds",
            "Time to prepare or unprepare one claim, in seconds.",
            ("driver", "operation"),
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.grpc_in_flight = Gauge(
            "dra_agent_grpc_in_flight_requests",
            "Kubelet gRPC calls in progress.",
            ("driver", "method"),
            registry=r,
        )
        self.prepared_claims = Gauge(
            "dra_agent_prepared_claims", "Claims currently prepared on this node.", ("driver",), registry=r
        )
        self.prepared_devices = Gauge(
            "dra_agent_prepared_devices", "Devices currently prepared for claims.", ("driver",), registry=r
        )
        self.registration_status = Gauge(
            "dra_agent_kubelet_registration_status",
            "1 when the kubelet accepted the plugin's registration, 0 when it refused or has not answered.",
            ("driver",),
            registry=r,
        )
        self.registration_notifications = Counter(
            "dra_agent_kubelet_registration_notifications_total",
            "NotifyRegistrationStatus calls from the kubelet, by result.",
            ("driver", "result"),
            registry=r,
        )
        self.health_watchers = Gauge(
            "dra_agent_health_stream_watchers",
            "Kubelet NodeWatchResources streams open.",
            ("driver",),
            registry=r,
        )
        self.checkpoint_recoveries = Counter(
            "dra_agent_checkpoint_recoveries_total",
            "Checkpoints found corrupt and rebuilt.",
            ("reason",),
            registry=r,
        )

        self.allocation_info = Gauge(
            "dra_agent_device_allocation_info",
            "1 per prepared device and the container (or pod) using it; join on UUID for per-pod telemetry.",
            ALLOCATION_LABELS,
            registry=r,
        )
        self.device_plugins = Gauge(
            "dra_agent_device_plugin_present",
            "1 per device plugin socket of the same vendor found in the kubelet's device-plugins directory.",
            ("driver", "socket"),
            registry=r,
        )

        # Kubernetes side.
        self.slices_published = Gauge(
            "dra_agent_resourceslices",
            "ResourceSlices this agent holds in the API server.",
            ("driver",),
            registry=r,
        )
        self.api_writes = Counter(
            "dra_agent_api_writes_total",
            "API server writes by resource, verb and result.",
            ("resource", "verb", "result"),
            registry=r,
        )
        self.api_retries = Counter(
            "dra_agent_api_retries_total",
            "API calls retried after an error, by reason.",
            ("reason",),
            registry=r,
        )
        self.watch_restarts = Counter(
            "dra_agent_watch_restarts_total",
            "Watches restarted, by reason.",
            ("resource", "reason"),
            registry=r,
        )
        self.claim_status_writes = Counter(
            "dra_agent_claim_status_writes_total",
            "Server-side applies of claims' status.devices entries, by result.",
            ("driver", "result"),
            registry=r,
        )
        self.rejected_devices = Counter(
            "dra_agent_rejected_devices_total",
            "Devices left out of a slice because they break a rule.",
            ("driver", "reason"),
            registry=r,
        )
        self.publish_errors = Counter(
            "dra_agent_publish_errors_total",
            "Failed slice reconciles, by reason.",
            ("driver", "reason"),
            registry=r,
        )
        self.publish_latency = Histogram(
            "dra_agent_publish_duration_seconds",
            "Time of one slice reconcile that wrote something, in seconds.",
            ("driver",),
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.taints_dropped = Counter(
            "dra_agent_taints_dropped_by_apiserver_total",
            "Slices whose taints the API server dropped (DRADeviceTaints off).",
            ("driver",),
            registry=r,
        )
        self.unpublishable_devices = Gauge(
            "dra_agent_unpublishable_devices",
            "Devices that should be tainted but whose taints the API server drops (enable DRADeviceTaints).",
            ("driver",),
            registry=r,
        )

        # Health.
        self.devices = Gauge(
            "dra_agent_devices", "Devices by driver and health.", ("driver", "health"), registry=r
        )
        self.taints = Gauge(
            "dra_agent_device_taints",
            "Active device taints by key and effect.",
            ("driver", "key", "effect"),
            registry=r,
        )
        self.health_events = Counter(
            "dra_agent_health_events_total",
            "Health events from the backends, by condition.",
            ("driver", "condition"),
            registry=r,
        )
        self.monitor_last_seen = Gauge(
            "dra_agent_health_monitor_last_seen_timestamp_seconds",
            "Unix time the backend's health monitor last answered.",
            ("driver",),
            registry=r,
        )

        self.health_pass_completed = Gauge(
            "dra_agent_health_pass_last_completed_timestamp_seconds",
            "Unix time the backend's last complete health pass ended (backends that poll).",
            ("driver",),
            registry=r,
        )
        self.health_pass_interval = Gauge(
            "dra_agent_health_pass_interval_seconds",
            "Configured seconds between two health passes (backends that poll).",
            ("driver",),
            registry=r,
        )
        self.health_check_failures = Counter(
            "dra_agent_health_check_failures_total",
            "Health-pass checks that failed (hung or errored: the check, not the GPU), by check.",
            ("driver", "check"),
            registry=r,
        )
        self.device_degraded = Gauge(
            "dra_agent_device_degraded",
            "1 while a trend that precedes failures is active on the device, by condition.",
            ("driver", "device", "condition"),
            registry=r,
        )

        # Telemetry.
        self.gpu_utilization = Gauge(
            "dra_agent_device_utilization_ratio",
            "Fraction of time the device was busy, 0 to 1.",
            TELEMETRY_LABELS,
            registry=r,
        )
        self.memory_used = Gauge(
            "dra_agent_device_memory_used_bytes",
            "Device memory in use, in bytes.",
            TELEMETRY_LABELS,
            registry=r,
        )
        self.memory_total = Gauge(
            "dra_agent_device_memory_total_bytes",
            "Device memory in all, in bytes.",
            TELEMETRY_LABELS,
            registry=r,
        )
        self.temperature = Gauge(
            "dra_agent_device_temperature_celsius",
            "Device (GPU die) temperature in degrees Celsius.",
            TELEMETRY_LABELS,
            registry=r,
        )
        self.power = Gauge(
            "dra_agent_device_power_watts", "Device power draw in watts.", TELEMETRY_LABELS, registry=r
        )
        self.ecc_corrected = Gauge(
            "dra_agent_device_ecc_corrected_errors",
            "Corrected ECC errors since driver load.",
            TELEMETRY_LABELS,
            registry=r,
        )
        self.ecc_uncorrected = Gauge(
            "dra_agent_device_ecc_uncorrected_errors",
            "Uncorrected ECC errors since driver load.",
            TELEMETRY_LABELS,
            registry=r,
        )
        self.last_error_code = Gauge(
            "dra_agent_device_last_error_code",
            "Last fatal error code of the device (the XID on NVIDIA).",
            TELEMETRY_LABELS,
            registry=r,
        )
        self.telemetry_read_seconds = Histogram(
            "dra_agent_telemetry_read_duration_seconds",
            "Time of one telemetry read of a backend, in seconds.",
            ("driver",),
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.telemetry_errors = Counter(
            "dra_agent_telemetry_read_errors_total",
            "Telemetry reads of a backend that failed.",
            ("driver",),
            registry=r,
        )

        # Process.
        self.event_loop_lag = Gauge(
            "dra_agent_event_loop_lag_seconds",
            "How late the event loop ran the last heartbeat (high values mean blocking code).",
            registry=r,
        )

    def init_driver(self, driver: str, conditions: Iterable[str] = ()) -> None:
        """Create at zero the series of `driver` whose label values are known at start.

        `conditions` are the health conditions the driver's backend can report
        (`agent.core.backend.declared_conditions`).
        """
        self.registration_status.labels(driver)
        self.prepared_claims.labels(driver)
        self.prepared_devices.labels(driver)
        self.health_watchers.labels(driver)
        self.slices_published.labels(driver)
        self.publish_latency.labels(driver)
        self.taints_dropped.labels(driver)
        self.unpublishable_devices.labels(driver)
        self.monitor_last_seen.labels(driver)
        self.telemetry_read_seconds.labels(driver)
        self.telemetry_errors.labels(driver)
        for operation in CLAIM_OPERATIONS:
            self.claim_latency.labels(driver, operation)
            for result in CLAIM_RESULTS:
                self.claim_operations.labels(driver, operation, result)
            for reason in CLAIM_ERROR_REASONS[operation]:
                self.claim_errors.labels(driver, operation, reason)
        for health in HEALTH_LABELS:
            self.devices.labels(driver, health)
        for condition in conditions:
            self.health_events.labels(driver, condition)
        for reason in PUBLISH_ERROR_REASONS:
            self.publish_errors.labels(driver, reason)
        for result in REGISTRATION_RESULTS:
            self.registration_notifications.labels(driver, result)
        for reason in REJECTED_DEVICE_REASONS:
            self.rejected_devices.labels(driver, reason)
        for method in GRPC_METHODS:
            self.grpc_in_flight.labels(driver, method)
        # No driver label: the same series for every driver.
        for reason in CHECKPOINT_RECOVERY_REASONS:
            self.checkpoint_recoveries.labels(reason)
        for reason in API_RETRY_REASONS:
            self.api_retries.labels(reason)
        for reason in WATCH_RESTART_REASONS:
            self.watch_restarts.labels(WATCHED_RESOURCE, reason)


class Children:
    """Labelled children looked up once: ``labels()`` costs ~6 µs, several times per claim call.

    Only for metrics whose label sets are never removed (a removed child would be kept alive
    here and no longer exported); the label values must come from small fixed sets.
    """

    def __init__(self) -> None:
        self._children: dict[tuple[object, ...], Any] = {}

    def __call__(self, metric: Counter | Gauge | Histogram, *labels: str) -> Any:
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child
