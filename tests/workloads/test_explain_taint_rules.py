"""``explain`` applies DeviceTaintRules as the scheduler does (issue 25): an admin's rule taints the
devices its selector matches (driver, pool and device, each optional; an empty selector matches
every device, none without one), on top of the slices' own taints.

Upstream: staging/src/k8s.io/api/resource/v1alpha3/types.go (DeviceTaintRule, DeviceTaintSelector);
DRADeviceTaintRules is GA and on by default in 1.37 (pkg/features/kube_features.go), served at
resource.k8s.io/v1 there and v1alpha3 before."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agent.cli import main
from agent.emulator import KubeApiEmulator
from agent.explain.evaluate import explain
from agent.explain.sources import from_api
from agent.explain.taintrules import apply_rules, rule_taints
from agent.kube.client import KubeClient
from tests.workloads.test_explain import NODE, NV, claim, device_class, slices, verdicts, write


def rule(name: str, selector: dict[str, Any] | None, effect: str = "NoExecute") -> dict[str, Any]:
    spec: dict[str, Any] = {"taint": {"key": "example.com/maintenance", "value": "rack-7", "effect": effect}}
    if selector is not None:
        spec["deviceSelector"] = selector
    return {
        "apiVersion": "resource.k8s.io/v1alpha3",
        "kind": "DeviceTaintRule",
        "metadata": {"name": name},
        "spec": spec,
    }


def test_selector_fields_must_all_match_and_no_selector_matches_nothing() -> None:
    rules = [
        rule("one-device", {"driver": NV, "pool": NODE, "device": "gpu-0"}),
        rule("whole-pool", {"pool": NODE}),
        rule("everything", {}),
        rule("nothing", None),
        rule("other-driver", {"driver": "gpu.amd.com"}),
    ]
    on_gpu0 = {t["deviceTaintRule"] for t in rule_taints(rules, NV, NODE, "gpu-0")}
    on_gpu1 = {t["deviceTaintRule"] for t in rule_taints(rules, NV, NODE, "gpu-1")}
    assert on_gpu0 == {"one-device", "whole-pool", "everything"}
    assert on_gpu1 == {"whole-pool", "everything"}
    assert rule_taints(rules, NV, "other-node", "gpu-0")[0]["deviceTaintRule"] == "everything"


def test_a_rule_excludes_a_device_naming_the_rule_and_a_toleration_lets_it_through() -> None:
    tainted = apply_rules(slices(), [rule("drain-gpu-0", {"driver": NV, "device": "gpu-0"})])
    report = explain(claim(), node=NODE, classes={NV: device_class()}, slices=tainted)
    assert verdicts(report)[f"{NV}/{NODE}/gpu-0"] == (
        "taint example.com/maintenance=rack-7:NoExecute (DeviceTaintRule drain-gpu-0) not tolerated",
    )
    tolerant = claim(tolerations=[{"key": "example.com/maintenance", "operator": "Exists"}])
    report = explain(tolerant, node=NODE, classes={NV: device_class()}, slices=tainted)
    assert verdicts(report)[f"{NV}/{NODE}/gpu-0"] == ()
    assert slices()[0] == slices()[0]  # the inputs are not changed


def test_offline_rules_come_with_the_claim_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    claim_file = write(tmp_path / "claim.yaml", claim(), device_class(), rule("drain", {"device": "gpu-2"}))
    slices_file = write(tmp_path / "slices.yaml", {"apiVersion": "v1", "kind": "List", "items": slices()})
    code = main(["explain", "claim", "--file", str(claim_file), "--slices", str(slices_file), "-o", "json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    (gpu2,) = [d for d in report["requests"][0]["devices"] if d["device"].endswith("/gpu-2")]
    assert "(DeviceTaintRule drain)" in " ".join(gpu2["reasons"])


async def test_rules_are_read_from_the_api_server_where_served() -> None:
    async with KubeApiEmulator(
        version="1.36", feature_gates={"DRADeviceTaintRules": True, "DRADeviceTaints": True}
    ) as emu:
        emu.add_node(NODE)
        emu.create("namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ml"}})
        emu.create("deviceclasses", device_class())
        created = emu.create("resourceclaims", claim(), namespace="ml")
        emu.create("devicetaintrules", rule("drain", {"device": "gpu-0"}))
        client = KubeClient.from_configuration(emu.configuration())
        try:
            inputs = await from_api(client, "ml", created["metadata"]["name"], NODE)
        finally:
            await client.close()
    assert [r["metadata"]["name"] for r in inputs.taint_rules] == ["drain"]
