"""The Helm chart: lint, render for NVIDIA-only, AMD-only and mixed values, validate every object."""

from __future__ import annotations

import json
import re
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from agent.config import OPTIONS, build_config
from agent.core.cel import matches
from agent.core.errors import ConfigError
from agent.core.model import Device
from agent.health.taints import TaintPolicy
from agent.observe.address import DEFAULT_METRICS_PORT
from backends.amd.backend import SETTINGS as AMD_SETTINGS
from backends.nvidia.backend import SETTINGS as NVIDIA_SETTINGS
from tests.deploy.chart import CHART, CI_VALUES, KUBE_VERSION, NAMESPACE, load_values, render_objects

DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # RFC 1035 (Service names)
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
LABEL_KEY_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
CRD_KINDS = {"ServiceMonitor", "PodMonitor"}
TOLERATION_EFFECTS = {"NoSchedule", "PreferNoSchedule", "NoExecute"}
KNOWN_ENV = {o.env for o in OPTIONS} | {"ROCM_PATH", "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES"}
VARIANTS = sorted(CI_VALUES)


@pytest.fixture(scope="module", params=VARIANTS)
def variant(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name


def objects_of(variant: str) -> list[dict[str, Any]]:
    return render_objects(load_values(variant))


def only(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def daemonset(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (ds,) = only(objects, "DaemonSet")
    return ds


def env_of(ds: dict[str, Any]) -> dict[str, Any]:
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_lint_is_clean() -> None:
    for name in [None, *VARIANTS]:
        values = load_values(name) if name else None
        report = helm.lint(CHART, values, strict=True, kube_version=f"v{KUBE_VERSION}")
        problems = [m for m in report["messages"] if m["severity"] >= 2]
        assert not report["errors"] and not problems, (name, report)


def test_every_object_is_valid_for_kubernetes_1_34(variant: str) -> None:
    for obj in objects_of(variant):
        if obj["kind"] in CRD_KINDS:
            continue
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def test_names_and_labels_follow_the_api_rules(variant: str) -> None:
    for obj in objects_of(variant):
        meta = obj["metadata"]
        name = meta["name"]
        assert DNS_SUBDOMAIN.match(name) and len(name) <= 253, name
        if obj["kind"] == "Service":
            assert DNS_LABEL.match(name) and len(name) <= 63, name
        if obj["kind"] in {"ServiceAccount", "ConfigMap", "Service", "DaemonSet", *CRD_KINDS}:
            assert meta["namespace"] == NAMESPACE
        for key, value in meta.get("labels", {}).items():
            assert LABEL_VALUE.match(str(value)) and len(str(value)) <= 63, (key, value)
            assert LABEL_KEY_NAME.match(key.rpartition("/")[2]), key


def test_daemonset_shape(variant: str) -> None:
    ds = daemonset(objects_of(variant))
    strategy = ds["spec"]["updateStrategy"]
    assert strategy == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    pod = ds["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == "system-node-critical"
    (container,) = pod["containers"]
    assert container["command"] == ["dra-agent", "run"]
    assert container["ports"] == [
        {"name": "metrics", "containerPort": DEFAULT_METRICS_PORT, "protocol": "TCP"}
    ]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    for name, path in {
        "plugins-registry": "/var/lib/kubelet/plugins_registry",
        "plugins": "/var/lib/kubelet/plugins",
        "cdi": "/var/run/cdi",
        "dev": "/dev",
        "state": "/var/lib/dra-agent",
    }.items():
        # The kubelet needs the same paths inside and outside the container.
        assert host_paths[name] == path == mounts[name]
    for toleration in pod.get("tolerations", []):
        assert toleration.get("effect", "NoSchedule") in TOLERATION_EFFECTS
        assert toleration["operator"] in {"Exists", "Equal"}


def test_daemonset_env_is_a_valid_agent_config(variant: str) -> None:
    env = env_of(daemonset(objects_of(variant)))
    assert env["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["POD_UID"] == {"fieldRef": {"fieldPath": "metadata.uid"}}
    assert set(env) <= KNOWN_ENV, set(env) - KNOWN_ENV
    plain = {k: v for k, v in env.items() if isinstance(v, str)}
    config = build_config({}, {**plain, "NODE_NAME": "gpu-node-1", "POD_UID": "0f1e2d3c-aaaa-bbbb"})
    assert config.kube_mode == "in-cluster"
    assert config.metrics_address == f"0.0.0.0:{DEFAULT_METRICS_PORT}"
    backends = {spec.name: spec.driver_name for spec in config.backends}
    expected = {
        "nvidia": {"nvidia": "gpu.nvidia.com"},
        "amd": {"amd": "gpu.amd.com"},
        "mixed": {"nvidia": "gpu.nvidia.com", "amd": "gpu.amd.com"},
    }[variant]
    assert backends == expected
    known = {"nvidia": set(NVIDIA_SETTINGS), "amd": set(AMD_SETTINGS)}
    for spec in config.backends:
        assert set(spec.backend_settings) <= known[spec.name], (spec.name, spec.settings)
        # Mixed mode: a node with only one vendor skips the other backend instead of failing.
        assert spec.optional is (variant == "mixed")
    if variant == "mixed":
        assert config.taint_policy is not None
        assert dict(config.backends[1].settings)["poll-interval"] == "5"


def test_node_affinity_follows_the_enabled_vendors(variant: str) -> None:
    pod = daemonset(objects_of(variant))["spec"]["template"]["spec"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    keys = {t["matchExpressions"][0]["key"] for t in terms["nodeSelectorTerms"]}
    nvidia = {"feature.node.kubernetes.io/pci-10de.present", "nvidia.com/gpu.present"}
    amd = {"feature.node.kubernetes.io/pci-1002.present", "feature.node.kubernetes.io/amd-gpu"}
    assert keys == {"nvidia": nvidia, "amd": amd, "mixed": nvidia | amd}[variant]


def test_driver_roots_are_mounted_read_only_at_their_host_paths(variant: str) -> None:
    ds = daemonset(objects_of(variant))
    pod = ds["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    backends = build_config({}, {"DRA_AGENT_BACKENDS": env_of(ds)["DRA_AGENT_BACKENDS"]}).backends
    settings = {spec.name: dict(spec.settings) for spec in backends}
    if variant == "nvidia":
        # GPU Operator driver container: the same path inside and out (CDI specs name host paths).
        assert settings["nvidia"]["driver-root"] == "/run/nvidia/driver"
        assert mounts["nvidia-driver-root"] == {
            "name": "nvidia-driver-root",
            "mountPath": "/run/nvidia/driver",
            "readOnly": True,
            "mountPropagation": "HostToContainer",
        }
        assert volumes["nvidia-driver-root"]["hostPath"]["path"] == "/run/nvidia/driver"
    if variant == "mixed":
        # Host-installed driver: nothing to mount; the container toolkit injects NVML.
        assert settings["nvidia"]["driver-root"] == "/"
        assert "nvidia-driver-root" not in mounts
        assert env_of(ds)["NVIDIA_VISIBLE_DEVICES"] == "all"
    if variant in ("amd", "mixed"):
        assert mounts["amd-driver-root"] == {
            "name": "amd-driver-root",
            "mountPath": "/opt/rocm",
            "readOnly": True,
        }
        assert env_of(ds)["ROCM_PATH"] == "/opt/rocm"
        # Mixed mode: an NVIDIA-only node has no /opt/rocm; the pod must start there all the same.
        expected = "DirectoryOrCreate" if variant == "mixed" else "Directory"
        assert volumes["amd-driver-root"]["hostPath"]["type"] == expected


def test_runtime_class_for_a_host_installed_nvidia_driver() -> None:
    ds = daemonset(render_objects({"backends": {"nvidia": {"runtimeClassName": "nvidia"}}}))
    assert ds["spec"]["template"]["spec"]["runtimeClassName"] == "nvidia"
    assert "runtimeClassName" not in daemonset(render_objects())["spec"]["template"]["spec"]


def test_taint_policy_configmap_is_mounted_where_the_env_points() -> None:
    objects = objects_of("mixed")
    (configmap,) = only(objects, "ConfigMap")
    assert "NoExecute" in configmap["data"]["taint-policy.yaml"]
    ds = daemonset(objects)
    assert env_of(ds)["DRA_AGENT_TAINT_POLICY"] == "/etc/dra-agent/taint-policy.yaml"
    volumes = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    assert volumes["taint-policy"]["configMap"]["name"] == configmap["metadata"]["name"]
    assert "checksum/taint-policy" in ds["spec"]["template"]["metadata"]["annotations"]
    assert not only(objects_of("nvidia"), "ConfigMap")


def test_rbac_is_least_privilege(variant: str) -> None:
    objects = objects_of(variant)
    (role,) = only(objects, "ClusterRole")
    grants = {
        (group, resource): set(rule["verbs"])
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    assert grants[("resource.k8s.io", "resourceclaims")] == {"get"}
    # Per-device claim status (server-side apply of status.devices) and, under granular status
    # authorization (pkg/registry/resource/resourceclaim/strategy.go, AuthorizedForDeviceStatus),
    # the per-driver synthetic subresource with the node-aware verbs, for our drivers only.
    assert grants[("resource.k8s.io", "resourceclaims/status")] == {"get", "patch"}
    assert grants[("resource.k8s.io", "resourceclaims/driver")] == {
        "associated-node:patch",
        "associated-node:update",
    }
    (driver_rule,) = [r for r in role["rules"] if "resourceclaims/driver" in r["resources"]]
    expected = {
        "nvidia": ["gpu.nvidia.com"],
        "amd": ["gpu.amd.com"],
        "mixed": ["gpu.nvidia.com", "gpu.amd.com"],
    }
    assert driver_rule["resourceNames"] == expected[variant], driver_rule
    assert grants[("resource.k8s.io", "resourceslices")] == {
        "get",
        "list",
        "watch",
        "create",
        "update",
        "delete",
    }
    assert grants[("", "nodes")] == {"get"}
    assert grants[("", "events")] == {"create"}
    # No DeviceTaintRules: a cluster that drops slice taints ignores them too.
    assert not any(r == "devicetaintrules" for _, r in grants)
    for verbs in grants.values():
        assert "*" not in verbs and "escalate" not in verbs and "bind" not in verbs
    assert not any(r == "secrets" for _, r in grants)
    (binding,) = only(objects, "ClusterRoleBinding")
    (account,) = only(objects, "ServiceAccount")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}
    ]


def test_admission_policy_limits_the_agent_to_its_own_node(variant: str) -> None:
    objects = objects_of(variant)
    (policy,) = only(objects, "ValidatingAdmissionPolicy")
    (binding,) = only(objects, "ValidatingAdmissionPolicyBinding")
    (account,) = only(objects, "ServiceAccount")
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    (rule,) = spec["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["resourceslices"]
    assert set(rule["operations"]) == {"CREATE", "UPDATE", "DELETE"}
    (condition,) = spec["matchConditions"]
    assert f"system:serviceaccount:{NAMESPACE}:{account['metadata']['name']}" in condition["expression"]
    variables = {v["name"]: v["expression"] for v in spec["variables"]}
    assert "authentication.kubernetes.io/node-name" in variables["userNodeName"]
    assert "oldObject" in variables["oldObjectIsOurs"]  # UPDATE and DELETE check the stored object
    checks = [v["expression"] for v in spec["validations"]]
    assert {"variables.objectIsOurs", "variables.oldObjectIsOurs"} <= set(checks)
    assert all(v["reason"] == "Forbidden" for v in spec["validations"])


def device(driver: str, kind: str) -> Device:
    return Device(name="d0", driver=driver, attributes={"type": kind})


def test_device_classes_select_like_the_vendors(variant: str) -> None:
    classes = {
        c["metadata"]["name"]: c["spec"]["selectors"][0]["cel"]["expression"]
        for c in only(objects_of(variant), "DeviceClass")
    }
    nvidia = {"gpu.nvidia.com", "mig.nvidia.com"}
    amd = {"gpu.amd.com", "partition.gpu.amd.com"}
    assert set(classes) == {"nvidia": nvidia, "amd": amd, "mixed": nvidia | amd}[variant]
    samples = {
        "nvidia-gpu": device("gpu.nvidia.com", "gpu"),
        "nvidia-mig": device("gpu.nvidia.com", "mig"),
        "amd-gpu": device("gpu.amd.com", "amdgpu"),
        "amd-partition": device("gpu.amd.com", "amdgpu-partition"),
    }
    selects = {
        "gpu.nvidia.com": {"nvidia-gpu"},
        "mig.nvidia.com": {"nvidia-mig"},
        "gpu.amd.com": {"amd-gpu", "amd-partition"},
        "partition.gpu.amd.com": {"amd-partition"},
    }
    for name, expression in classes.items():
        chosen = {sample for sample, dev in samples.items() if matches(expression, dev)}
        assert chosen == selects[name], name


def test_extra_device_classes_and_renamed_drivers() -> None:
    values = {
        "backends": {
            "nvidia": {
                "driverName": "gpu.example.com",
                "deviceClasses": [{"name": "gpu.example.com", "type": "gpu"}],
            }
        },
        "deviceClasses": {"extra": [{"name": "all.example.org", "driver": "other.example.org"}]},
    }
    classes = {c["metadata"]["name"]: c for c in only(render_objects(values), "DeviceClass")}
    assert set(classes) == {"gpu.example.com", "all.example.org"}
    expression = classes["gpu.example.com"]["spec"]["selectors"][0]["cel"]["expression"]
    assert matches(expression, device("gpu.example.com", "gpu"))
    assert not matches(expression, device("gpu.nvidia.com", "gpu"))
    assert not only(render_objects({"deviceClasses": {"create": False}}), "DeviceClass")


def test_monitors_and_service(variant: str) -> None:
    objects = objects_of(variant)
    (service,) = only(objects, "Service")
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": DEFAULT_METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"}
    ]
    selector = daemonset(objects)["spec"]["selector"]["matchLabels"]
    assert service["spec"]["selector"] == selector
    monitors = only(objects, "ServiceMonitor") + only(objects, "PodMonitor")
    expected_kind = {"nvidia": "ServiceMonitor", "amd": "PodMonitor", "mixed": None}[variant]
    assert [m["kind"] for m in monitors] == ([expected_kind] if expected_kind else [])
    for monitor in monitors:
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["spec"]["selector"]["matchLabels"] == selector
        (endpoint,) = monitor["spec"].get("endpoints") or monitor["spec"]["podMetricsEndpoints"]
        assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"


def test_fake_backend_renders_without_vendor_affinity() -> None:
    objects = render_objects({"backends": {"nvidia": {"enabled": False}, "fake": {"enabled": True}}})
    ds = daemonset(objects)
    assert "affinity" not in ds["spec"]["template"]["spec"]
    assert env_of(ds)["DRA_AGENT_BACKENDS"] == "fake:profile=mixed"
    assert not only(objects, "DeviceClass")


def test_non_privileged_mode_drops_capabilities() -> None:
    ds = daemonset(render_objects({"securityContext": {"privileged": False, "runAsUser": 0}}))
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["securityContext"]["allowPrivilegeEscalation"] is False


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({"logLevel": "loud"}, "/logLevel"),
        ({"logFormat": "xml"}, "/logFormat"),
        ({"metrics": {"port": 70000}}, "/metrics/port"),
        ({"backends": {"nvidia": {"driverName": "GPU_NVIDIA"}}}, "/backends/nvidia/driverName"),
        ({"tolerations": [{"key": "k", "operator": "Exists", "effect": "NoEvict"}]}, "/tolerations/0/effect"),
        ({"telemetryIntervalSeconds": 0}, "/telemetryIntervalSeconds"),
        ({"unknownValue": 1}, "unknownValue"),
    ],
)
def test_schema_rejects_bad_values(values: dict[str, Any], complaint: str) -> None:
    with pytest.raises(helm.HelmValuesError, match=re.escape(complaint)):
        render_objects(values)


@pytest.mark.parametrize(
    ("policy", "complaint"),
    [
        # Issue 12: ci/mixed-values.yaml shipped this; the agent exits 2 on it.
        ("conditions: {}", 'unknown field "conditions"'),
        ("rules: [{condition: xid}]", "rules[0]: expected exactly one of effect or ignore"),
        ("rules: [{condition: xid, effect: Evict}]", "rules[0].effect: Evict"),
        ("rules: [{condition: xid, ignore: true, colour: red}]", "rules[0].colour: unknown field"),
        ("severities: {info: maybe}", "severities.info: maybe"),
        ("severities: {fatal: NoSchedule}", "severities.fatal"),
        ("- just a list", "not a YAML mapping"),
    ],
)
def test_a_taint_policy_the_agent_refuses_fails_the_render(policy: str, complaint: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=re.escape(complaint)):
        render_objects({"taintPolicy": policy})
    with pytest.raises(ConfigError):
        TaintPolicy.from_data(yaml.safe_load(policy))


@pytest.mark.parametrize(
    "policy",
    [{"conditions": {}}, {"rules": [{"condition": "xid"}]}, {"severities": {"info": "Evict"}}],
)
def test_the_schema_refuses_a_bad_structured_taint_policy(policy: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError, match="/taintPolicy"):
        render_objects({"taintPolicy": policy})


def test_a_structured_taint_policy_is_rendered_for_the_agent() -> None:
    policy = {"rules": [{"condition": "xid", "values": [79], "effect": "NoExecute"}]}
    (configmap,) = only(render_objects({"taintPolicy": policy}), "ConfigMap")
    text = configmap["data"]["taint-policy.yaml"]
    assert yaml.safe_load(text) == policy
    TaintPolicy.from_data(yaml.safe_load(text))


def test_no_backend_is_a_clear_error() -> None:
    with pytest.raises(helm.HelmRenderError, match="enable at least one backend"):
        render_objects({"backends": {"nvidia": {"enabled": False}}})


def test_service_monitor_needs_the_service() -> None:
    values = {"metrics": {"service": {"enabled": False}, "serviceMonitor": {"enabled": True}}}
    with pytest.raises(helm.HelmRenderError, match="podMonitor"):
        render_objects(values)


def test_schema_is_valid_json_and_documents_every_value() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    readme = (CHART / "README.md").read_text()

    def paths(node: dict[str, Any], prefix: str = "") -> list[str]:
        out = []
        for key, sub in node.get("properties", {}).items():
            path = f"{prefix}{key}"
            out.append(path)
            if sub.get("type") == "object" and "properties" in sub:
                out.extend(paths(sub, path + "."))
        return out

    missing = [p for p in paths(schema) if f"`{p}`" not in readme]
    assert not missing, f"values missing from the chart README: {missing}"


# The policy's decisions, evaluated in CEL: tests/kube/test_admission_policy.py.


def test_the_schema_check_is_not_vacuous() -> None:
    ds = daemonset(objects_of("nvidia"))
    ds["spec"]["template"]["spec"]["containers"][0]["bogusField"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, KUBE_VERSION, strict=True)
