"""The README's per-pod joins with dcgm-exporter, run in promtool over recorded series shapes.

dcgm-exporter's series shapes are those of its ``internal/pkg/rendermetrics/render_metrics.go``
template (4.5.3-4.8.2): ``gpu``, ``UUID``, ``pci_bus_id``, ``device``, ``modelName``, ``Hostname``,
and for a MIG instance ``GPU_I_PROFILE`` and ``GPU_I_ID`` with ``UUID`` the **parent GPU's**; with
DRA attribution on (``transformation/kubernetes.go``) a series is copied once per pod using the
GPU, with ``pod``, ``namespace``, ``container`` and the ``dra_*`` labels. The agent's side is the
series `AllocationSeries` exports. Each device kind (whole GPU, two shares of one GPU, static MIG
next to another instance of the same GPU, dynamic MIG) must give exactly one result per pod and
container, carrying its own GPU's or GPU instance's value.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from agent.observe.allocations import Allocation, AllocationSeries
from agent.observe.metrics import Metrics
from tests.observability.test_alerts import needs_promtool, promtool

README = Path(__file__).resolve().parents[2] / "README.md"
DCGM_UTIL = "DCGM_FI_PROF_GR_ENGINE_ACTIVE"
DCGM_FB = "DCGM_FI_DEV_FB_USED"
NODE = "node-1"
GPU_A, GPU_C, GPU_G, GPU_H = (f"GPU-{c * 8}-0000-0000-0000-000000000000" for c in "acgh")
MIG_STATIC = "MIG-5c0b2a6e-0000-0000-0000-000000000001"
MIG_DYNAMIC = "MIG-7e1d4c2f-0000-0000-0000-000000000002"


def _dcgm(uuid: str, gpu: int, *, gi: str = "", profile: str = "", pods: tuple[str, ...] = ()) -> list[str]:
    """One dcgm-exporter series per pod attributed (or one without a pod), as its template renders it."""
    labels = {
        "gpu": str(gpu),
        "UUID": uuid,
        "pci_bus_id": f"00000000:{gpu:02x}:00.0",
        "device": f"nvidia{gpu}",
        "modelName": "NVIDIA A100-SXM4-80GB",
    }
    if gi:
        labels |= {"GPU_I_PROFILE": profile, "GPU_I_ID": gi}
    labels["Hostname"] = NODE
    copies = [{**labels, "pod": p, "namespace": "default", "container": "main"} for p in pods] or [labels]
    return ["{" + ",".join(f'{k}="{v}"' for k, v in c.items()) + "}" for c in copies]


# (series labels, utilization): the GPU-level series of MIG-enabled GPUs G and H too.
DCGM_SERIES: list[tuple[str, float]] = [
    *((s, 0.25) for s in _dcgm(GPU_A, 0, pods=("whole",))),
    *((s, 0.5) for s in _dcgm(GPU_C, 2, pods=("share-a", "share-b"))),
    *((s, 0.9) for s in _dcgm(GPU_G, 6)),
    *((s, 0.125) for s in _dcgm(GPU_G, 6, gi="1", profile="3g.40gb")),
    *((s, 0.75) for s in _dcgm(GPU_G, 6, gi="2", profile="3g.40gb")),
    *((s, 0.9) for s in _dcgm(GPU_H, 7)),
    *((s, 0.375) for s in _dcgm(GPU_H, 7, gi="10", profile="1g.10gb")),
]


def _allocation(device: str, uuid: str, pod: str, parent: str = "", gi: str = "") -> Allocation:
    return Allocation(
        driver="gpu.nvidia.com",
        pool=NODE,
        device=device,
        uuid=uuid,
        pci_bus_id="0000:00:00.0",
        namespace="default",
        pod=pod,
        container="main",
        claim=f"claim-{pod}",
        parent_uuid=parent,
        gpu_instance_id=gi,
    )


ALLOCATIONS = {
    "whole": (_allocation("gpu-0", GPU_A, "whole"), 0.25),
    "share-a": (_allocation("gpu-2", GPU_C, "share-a"), 0.5),
    "share-b": (_allocation("gpu-2", GPU_C, "share-b"), 0.5),
    "mig": (_allocation("gpu-6-mig-3g40gb-9-0", MIG_STATIC, "mig", GPU_G, "1"), 0.125),
    "dynamic": (_allocation("gpu-7-mig-1g10gb-19-3", MIG_DYNAMIC, "dynamic", GPU_H, "10"), 0.375),
}


def readme_join(comment: str) -> str:
    """The PromQL under `comment` in the README's per-pod section (up to the next comment)."""
    text = README.read_text()
    block = text[text.index("## Per-pod GPU metrics") :]
    block = block[block.index("```promql") : block.index("```\n", block.index("```promql") + 1)]
    lines = block.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == f"# {comment}")
    found = []
    for line in lines[start + 1 :]:
        if line.startswith("#"):
            break
        found.append(line.strip())
    return " ".join(found)


def _allocation_series() -> list[tuple[str, dict[str, str]]]:
    """The series the agent exports for `ALLOCATIONS` (name, labels), read back from its registry."""
    metrics = Metrics()
    series = AllocationSeries(metrics)
    for pod, (allocation, _) in ALLOCATIONS.items():
        series.set_claim("gpu.nvidia.com", pod, [allocation])
    return [
        (sample.name, dict(sample.labels))
        for family in metrics.registry.collect()
        if family.name == "dra_agent_device_allocation_info"
        for sample in family.samples
    ]


def _series_text(name: str, labels: dict[str, str]) -> str:
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items() if v) + "}"


def _expected(value_of: dict[str, float]) -> list[dict[str, Any]]:
    out = []
    for name, labels in _allocation_series():
        del name
        shown = dict(labels)
        if shown["parent_UUID"]:
            shown["UUID"] = shown["parent_UUID"]
        out.append({"labels": _series_text("", shown), "value": value_of[shown["pod"]]})
    return out


@needs_promtool
def test_the_readme_joins_give_one_result_per_pod_for_gpus_shares_and_mig(tmp_path: Path) -> None:
    util = readme_join("dcgm-exporter (NVIDIA): whole GPUs, shares, static and dynamic MIG")
    framebuffer = readme_join("dcgm-exporter, framebuffer used per pod (MiB)")
    assert DCGM_UTIL in util and DCGM_FB in framebuffer
    inputs = [{"series": DCGM_UTIL + labels, "values": f"{value}x3"} for labels, value in DCGM_SERIES]
    inputs += [{"series": DCGM_FB + labels, "values": f"{value * 1000}x3"} for labels, value in DCGM_SERIES]
    inputs += [{"series": _series_text(n, labels), "values": "1x3"} for n, labels in _allocation_series()]
    utilization = {pod: value for pod, (_, value) in ALLOCATIONS.items()}
    tests = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": inputs,
                "promql_expr_test": [
                    {"expr": util, "eval_time": "2m", "exp_samples": _expected(utilization)},
                    {
                        "expr": framebuffer,
                        "eval_time": "2m",
                        "exp_samples": _expected({k: v * 1000 for k, v in utilization.items()}),
                    },
                    {
                        "expr": f"count by (pod, container) ({util})",
                        "eval_time": "2m",
                        "exp_samples": [
                            {"labels": f'{{container="main",pod="{pod}"}}', "value": 1} for pod in ALLOCATIONS
                        ],
                    },
                ],
            }
        ],
    }
    path = tmp_path / "joins.test.yaml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False))
    assert "SUCCESS" in promtool("test", "rules", path.name, cwd=tmp_path)


def test_the_readme_says_which_dcgm_exporter_was_read() -> None:
    section = README.read_text().split("### dcgm-exporter on a dra-agent node", 1)[1].split("\n## ", 1)[0]
    for needed in ("4.8.2", "kubernetesDRA.enabled", "--kubernetes-gpu-id-type=uid", "#714", "parentUUID"):
        assert needed in section
    assert re.search(r"status\.devices", section)
