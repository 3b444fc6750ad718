"""KubeClient pieces that need no API server: claim conversion, server info."""

from __future__ import annotations

from typing import Any

from agent.kube.client import ServerInfo, claim_to_v1


def test_v1beta1_claim_requests_move_under_exactly() -> None:
    claim: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1beta1",
        "kind": "ResourceClaim",
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "deviceClassName": "gpu.example.com",
                        "allocationMode": "ExactCount",
                        "count": 2,
                    },
                    {"name": "alt", "firstAvailable": [{"name": "a", "deviceClassName": "x"}]},
                ]
            }
        },
        "status": {
            "allocation": {
                "devices": {"results": [{"request": "gpu", "driver": "d", "pool": "p", "device": "x"}]}
            }
        },
    }
    out = claim_to_v1(claim)
    assert out["apiVersion"] == "resource.k8s.io/v1"
    gpu, alt = out["spec"]["devices"]["requests"]
    assert gpu == {
        "name": "gpu",
        "exactly": {"deviceClassName": "gpu.example.com", "allocationMode": "ExactCount", "count": 2},
    }
    assert "exactly" not in alt
    assert out["status"] == claim["status"]
    assert "exactly" not in claim["spec"]["devices"]["requests"][0]  # input untouched


def test_server_info_taint_support() -> None:
    old = ServerInfo(1, 34, "v1.34.2", "v1")
    new = ServerInfo(1, 35, "v1.35.0", "v1")
    assert old.taint_support.max_taints_per_device == 4 and not old.taint_support.none_effect
    assert new.taint_support.max_taints_per_device == 16 and new.taint_support.none_effect
    assert old.max_devices_with_taints == 128 and new.max_devices_with_taints == 64
    assert not ServerInfo(1, 32, "v1.32.4", "v1beta1").slice_taints_possible
