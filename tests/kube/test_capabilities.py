"""The capability probe: dry-run creates decide what our slices may carry, not the version.

Rules probed (upstream ``pkg/apis/resource/validation/validation.go`` and
``pkg/registry/resource/resourceslice/strategy.go``): 4 taints per device and no ``None`` effect
before 1.35, 16 and ``None`` from 1.35; with ``DRADeviceTaints`` off the strategy drops the
taints before validation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from agent.core.errors import KubeApiError
from agent.kube.capabilities import probe
from agent.kube.client import ServerInfo

INFO_134 = ServerInfo(1, 34, "v1.34.2", "v1")
INFO_135 = ServerInfo(1, 35, "v1.35.0", "v1")


class FakeServer:
    """Answers dry-run creates like an API server of the given rules."""

    def __init__(
        self, *, max_taints: int, none_effect: bool, keeps_taints: bool, status: int | None = None
    ) -> None:
        self.max_taints, self.none_effect, self.keeps = max_taints, none_effect, keeps_taints
        self.status = status
        self.bodies: list[Mapping[str, Any]] = []

    async def dry_run_create_resource_slice(self, body: Mapping[str, Any]) -> dict[str, Any]:
        self.bodies.append(body)
        if self.status is not None:
            raise KubeApiError("refused", self.status)
        (device,) = body["spec"]["devices"]
        taints = device.get("taints", [])
        if not self.keeps:
            return {**body, "spec": {**body["spec"], "devices": [{"name": device["name"]}]}}
        if len(taints) > self.max_taints or (
            not self.none_effect and any(t["effect"] == "None" for t in taints)
        ):
            raise KubeApiError("invalid", 422, "Invalid")
        return dict(body)


async def test_135_rules() -> None:
    server = FakeServer(max_taints=16, none_effect=True, keeps_taints=True)
    caps = await probe(server, INFO_134, driver="gpu.example.com", node_name="n")
    assert (caps.slice_taints, caps.max_taints_per_device, caps.none_effect) == (True, 16, True)
    assert caps.max_devices_per_slice == 64 and len(server.bodies) == 1
    (body,) = server.bodies
    assert body["spec"]["nodeName"] == "n" and body["spec"]["driver"] == "gpu.example.com"
    assert "ownerReferences" not in body["metadata"]


async def test_older_rules_are_found_by_a_second_probe() -> None:
    server = FakeServer(max_taints=4, none_effect=False, keeps_taints=True)
    caps = await probe(server, INFO_135, driver="gpu.example.com", node_name="n")
    assert (caps.slice_taints, caps.max_taints_per_device, caps.none_effect) == (True, 4, False)
    assert caps.max_devices_per_slice == 128 and len(server.bodies) == 2


async def test_dropped_taints_keep_the_versions_limits() -> None:
    server = FakeServer(max_taints=16, none_effect=True, keeps_taints=False)
    caps = await probe(server, INFO_134, driver="gpu.example.com", node_name="n")
    assert not caps.slice_taints and caps.probed
    assert (caps.max_taints_per_device, caps.none_effect) == (4, False)


@pytest.mark.parametrize("status", [403, 500, 0])
async def test_other_refusals_are_raised(status: int) -> None:
    server = FakeServer(max_taints=16, none_effect=True, keeps_taints=True, status=status)
    with pytest.raises(KubeApiError):
        await probe(server, INFO_134, driver="gpu.example.com", node_name="n")


async def test_v1beta1_probe_uses_the_basic_shape() -> None:
    server = FakeServer(max_taints=16, none_effect=True, keeps_taints=False)
    await probe(server, ServerInfo(1, 32, "v1.32.1", "v1beta1"), driver="gpu.example.com", node_name="n")
    (device,) = server.bodies[0]["spec"]["devices"]
    assert set(device) == {"name", "basic"}
