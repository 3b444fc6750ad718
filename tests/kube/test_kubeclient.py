"""KubeClient against the API emulator: connect, discovery, claims, rules, events, watch errors."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest

from agent.core.errors import ConfigError, KubeApiError
from agent.emulator import KubeApiEmulator
from agent.kube.client import KubeClient
from tests.kube.harness import DRIVER, NODE

CLAIM: dict[str, Any] = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "ResourceClaim",
    "metadata": {"name": "claim-1", "namespace": "default"},
    "spec": {
        "devices": {
            "requests": [
                {
                    "name": "gpu",
                    "exactly": {"deviceClassName": DRIVER, "allocationMode": "ExactCount", "count": 1},
                }
            ]
        }
    },
}


async def test_connect_with_kubeconfig_discovers_v1() -> None:
    async with KubeApiEmulator(version="1.35") as emu:
        path = emu.write_kubeconfig(Path(tempfile.mkdtemp(dir="/tmp")) / "kubeconfig")
        auto = await KubeClient.connect("auto", path)
        await auto.close()
        kube = await KubeClient.connect("kubeconfig", path)
        try:
            assert kube.slice_version == "v1"
            assert kube.info.taint_support.none_effect
            with pytest.raises(KubeApiError) as missing:
                await kube.get_node("nope")
            assert missing.value.status == 404
        finally:
            await kube.close()


async def test_bad_kubeconfig_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--kubeconfig: expected an existing kubeconfig file"):
        await KubeClient.connect("kubeconfig", tmp_path / "missing")


async def test_in_cluster_without_a_service_account_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(KubeApiError, match="in-cluster service account"):
        await KubeClient.connect("in-cluster")


async def test_cluster_without_dra_says_how_to_enable_it() -> None:
    async with KubeApiEmulator(version="1.34", dra=False) as emu:
        kube = KubeClient.from_configuration(emu.configuration())
        try:
            with pytest.raises(KubeApiError, match="DynamicResourceAllocation=true") as error:
                await kube.discover()
            assert "runtime-config=resource.k8s.io/v1beta1=true" in str(error.value)
        finally:
            await kube.close()


async def test_unreachable_api_server_maps_to_status_zero() -> None:
    async with KubeApiEmulator(version="1.34") as emu:
        kube = KubeClient.from_configuration(emu.configuration(), request_timeout=2)
        try:
            emu.faults.outage(True)
            with pytest.raises(KubeApiError) as error:
                await kube.discover()
            assert error.value.status == 0
        finally:
            emu.faults.outage(False)
            await kube.close()


@pytest.mark.parametrize("version", ["1.32", "1.33", "1.34"])
async def test_claims_come_back_in_v1_shape(version: str) -> None:
    async with KubeApiEmulator(version=version) as emu:
        emu.create("resourceclaims", CLAIM, namespace="default")
        kube = KubeClient.from_configuration(emu.configuration())
        try:
            await kube.discover()
            assert kube.slice_version == {"1.32": "v1beta1", "1.33": "v1beta2", "1.34": "v1"}[version]
            claim = await kube.get_resource_claim("default", "claim-1")
            assert claim["apiVersion"].endswith(("/v1", "/v1beta2"))
            (request,) = claim["spec"]["devices"]["requests"]
            assert request["exactly"]["deviceClassName"] == DRIVER
            with pytest.raises(KubeApiError) as missing:
                await kube.get_resource_claim("default", "absent")
            assert missing.value.status == 404
        finally:
            await kube.close()


async def test_dry_run_create_stores_nothing_and_events() -> None:
    async with KubeApiEmulator(version="1.34", feature_gates={"DRADeviceTaints": True}) as emu:
        emu.add_node(NODE)
        kube = KubeClient.from_configuration(emu.configuration())
        try:
            await kube.discover()
            probe = {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceSlice",
                "metadata": {"generateName": "probe-"},
                "spec": {
                    "driver": DRIVER,
                    "nodeName": NODE,
                    "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1},
                    "devices": [{"name": "d", "taints": [{"key": f"{DRIVER}/k", "effect": "NoSchedule"}]}],
                },
            }
            answer = await kube.dry_run_create_resource_slice(probe)
            assert answer["spec"]["devices"][0]["taints"][0]["key"] == f"{DRIVER}/k"
            assert emu.list("resourceslices") == []
            await kube.create_event(
                {
                    "metadata": {"name": "node-1.abc", "namespace": "default"},
                    "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": NODE},
                    "reason": "Test",
                    "message": "hello",
                    "type": "Normal",
                    "source": {"component": "dra-agent"},
                }
            )
            assert [e["reason"] for e in emu.list("events")] == ["Test"]
        finally:
            await kube.close()


async def test_stale_update_conflicts_and_old_watch_is_gone() -> None:
    async with KubeApiEmulator(version="1.34") as emu:
        emu.add_node(NODE)
        kube = KubeClient.from_configuration(emu.configuration())
        try:
            await kube.discover()
            body = {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceSlice",
                "metadata": {"generateName": f"{NODE}-{DRIVER}-"},
                "spec": {
                    "driver": DRIVER,
                    "nodeName": NODE,
                    "pool": {"name": NODE, "generation": 0, "resourceSliceCount": 1},
                    "devices": [{"name": "gpu-0"}],
                },
            }
            created = await kube.create_resource_slice(body)
            items, list_rv = await kube.list_resource_slices(node_name=NODE, driver=DRIVER)
            assert [i["metadata"]["name"] for i in items] == [created["metadata"]["name"]]
            changed = {
                **created,
                "spec": {**created["spec"], "devices": [{"name": "gpu-0"}, {"name": "gpu-1"}]},
            }
            await kube.update_resource_slice(changed)  # an update without changes keeps the resourceVersion
            with pytest.raises(KubeApiError) as conflict:
                await kube.update_resource_slice(created)
            assert conflict.value.status == 409
            with pytest.raises(KubeApiError) as precondition:
                await kube.delete_resource_slice(
                    created["metadata"]["name"], resource_version=created["metadata"]["resourceVersion"]
                )
            assert precondition.value.status == 409
            emu.compact()
            with pytest.raises(KubeApiError) as gone:
                async for _ in kube.watch_resource_slices(
                    node_name=NODE, driver=DRIVER, resource_version=list_rv, timeout_seconds=2
                ):
                    pass
            assert gone.value.status == 410
        finally:
            await kube.close()
