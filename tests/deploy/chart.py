"""Render the Helm chart offline (helm-python-sdk: Helm v4 as a library) and write the plain manifests.

Regenerate ``deploy/manifests/`` after changing the chart::

    python -m tests.deploy.chart

`tests/deploy/test_manifests.py` fails while the committed manifests differ from a fresh render.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "dra-agent"
MANIFESTS = ROOT / "deploy" / "manifests"
RELEASE = "dra-agent"
NAMESPACE = "dra-agent"
KUBE_VERSION = "1.34.0"
CI_VALUES = {name: CHART / "ci" / f"{name}-values.yaml" for name in ("nvidia", "amd", "mixed")}
"""The values files every chart test renders: NVIDIA-only, AMD-only and mixed nodes."""

# The plain manifests: no Prometheus Operator objects (their CRDs may be missing without Helm users' stacks).
MANIFEST_VALUES: dict[str, dict[str, Any]] = {
    "nvidia": {"backends": {"nvidia": {"enabled": True}, "amd": {"enabled": False}}},
    "amd": {"backends": {"nvidia": {"enabled": False}, "amd": {"enabled": True}}},
    "mixed": {"backends": {"nvidia": {"enabled": True}, "amd": {"enabled": True}}},
}
_HELM_ONLY_LABELS = ("helm.sh/chart", "app.kubernetes.io/managed-by")
# Apply order, as Helm installs: what others refer to comes first.
_KIND_ORDER = (
    "Namespace",
    "ServiceAccount",
    "ConfigMap",
    "ClusterRole",
    "ClusterRoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
    "DeviceClass",
    "Service",
    "DaemonSet",
)


def _apply_order(obj: dict[str, Any]) -> tuple[int, str]:
    kind = obj.get("kind", "")
    return (_KIND_ORDER.index(kind) if kind in _KIND_ORDER else len(_KIND_ORDER), obj["metadata"]["name"])


def load_values(name: str) -> dict[str, Any]:
    """The values of CI values file `name` (nvidia, amd or mixed)."""
    values = yaml.safe_load(CI_VALUES[name].read_text())
    assert isinstance(values, dict)
    return values


def render(values: Mapping[str, Any] | None = None) -> dict[str, str]:
    """Template path -> rendered text (helm template, offline)."""
    chart = helm.Chart.load(CHART)
    return chart.render(dict(values or {}), name=RELEASE, namespace=NAMESPACE, is_install=True)


def render_objects(values: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """The Kubernetes objects the chart renders (NOTES.txt and empty documents left out)."""
    objects: list[dict[str, Any]] = []
    for path, text in sorted(render(values).items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                assert isinstance(doc, dict), f"{path}: not an object"
                objects.append(doc)
    return objects


def _strip_helm_labels(node: Any) -> Any:
    if isinstance(node, dict):
        return {
            k: (
                {lk: lv for lk, lv in v.items() if lk not in _HELM_ONLY_LABELS}
                if k == "labels" and isinstance(v, dict)
                else _strip_helm_labels(v)
            )
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_strip_helm_labels(v) for v in node]
    return node


def manifest_text(variant: str) -> str:
    """The plain manifest file of `variant`: a Namespace, then every object of the chart."""
    namespace = {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": NAMESPACE, "labels": {"app.kubernetes.io/part-of": "dra-agent"}},
    }
    rendered = sorted(render_objects(MANIFEST_VALUES[variant]), key=_apply_order)
    objects = [namespace, *(_strip_helm_labels(o) for o in rendered)]
    header = (
        f"# dra-agent plain manifests ({variant} nodes), rendered from deploy/helm/dra-agent.\n"
        "# Do not edit: change the chart and run `python -m tests.deploy.chart`.\n"
        f"# Install: kubectl apply -f deploy/manifests/dra-agent-{variant}.yaml\n"
    )
    return header + "".join("---\n" + yaml.safe_dump(o, sort_keys=False) for o in objects)


def manifest_files() -> dict[Path, str]:
    """Every plain manifest file with its expected content."""
    return {MANIFESTS / f"dra-agent-{v}.yaml": manifest_text(v) for v in MANIFEST_VALUES}


def main() -> int:
    MANIFESTS.mkdir(parents=True, exist_ok=True)
    for path, text in manifest_files().items():
        path.write_text(text)
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


def cluster_role_rules(values: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """The rules of the agent's ClusterRole as the chart renders it."""
    (role,) = [o for o in render_objects(values) if o["kind"] == "ClusterRole"]
    rules: list[dict[str, Any]] = role["rules"]
    return rules
