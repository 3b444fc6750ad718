"""Version conversion (v1beta1 ``basic`` and flat requests) and simulated feature gates."""

from __future__ import annotations

from typing import Any

import aiohttp

from agent.emulator import ApiError, KubeApiEmulator
from tests.emulator.conftest import DRIVER, claim_body, client, slice_body


def _beta1_slice(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1beta1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": DRIVER,
            "nodeName": "node-a",
            "pool": {"name": "node-a", "generation": 0, "resourceSliceCount": 1},
            "devices": [
                {
                    "name": "gpu-0",
                    "basic": {
                        "attributes": {"model": {"string": "X"}},
                        "capacity": {"memory": {"value": "2048Mi"}},
                        "taints": [{"key": "a.b/c", "effect": "NoSchedule"}],
                    },
                }
            ],
        },
    }


async def test_v1beta1_basic_is_unwrapped_on_the_way_in(emu: KubeApiEmulator, api: Any) -> None:
    created = await client.ResourceV1beta1Api(api).create_resource_slice(_beta1_slice("s"))
    assert created.api_version == "resource.k8s.io/v1beta1"
    assert created.spec.devices[0].basic.capacity["memory"].value == "2Gi"
    stored = emu.get("resourceslices", "s")
    assert stored is not None
    device = stored["spec"]["devices"][0]
    assert "basic" not in device and device["attributes"] == {"model": {"string": "X"}}
    assert device["taints"][0]["key"] == "a.b/c"


async def test_v1_slice_is_wrapped_for_v1beta1_readers(emu: KubeApiEmulator, api: Any) -> None:
    emu.create("resourceslices", slice_body("s"))
    read = await client.ResourceV1beta1Api(api).read_resource_slice("s")
    assert read.spec.devices[0].name == "gpu-0"
    assert read.spec.devices[0].basic.attributes["model"].string == "X"
    beta2 = await client.ResourceV1beta2Api(api).read_resource_slice("s")
    assert beta2.spec.devices[0].attributes["model"].string == "X"


async def test_v1beta1_validation_paths_are_normalized(emu: KubeApiEmulator) -> None:
    body = _beta1_slice("s")
    body["spec"]["devices"][0]["basic"]["attributes"] = {"x": {"string": "s" * 65}}
    rtype = emu.registry.type_for("resource.k8s.io", "resourceslices")
    try:
        emu.registry.create(rtype, "v1beta1", body)
    except ApiError as error:
        assert "spec.devices[0].attributes[x].string" in str(error)
    else:
        raise AssertionError("expected 422")


async def test_claim_requests_flat_in_v1beta1(emu: KubeApiEmulator, api: Any) -> None:
    body = {
        "apiVersion": "resource.k8s.io/v1beta1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c"},
        "spec": {
            "devices": {"requests": [{"name": "gpu", "deviceClassName": "gpu.example.com", "count": 2}]}
        },
    }
    created = await client.ResourceV1beta1Api(api).create_namespaced_resource_claim("default", body)
    assert created.spec.devices.requests[0].device_class_name == "gpu.example.com"
    stored = emu.get("resourceclaims", "c", namespace="default")
    assert stored is not None
    assert stored["spec"]["devices"]["requests"][0] == {
        "name": "gpu",
        "exactly": {"deviceClassName": "gpu.example.com", "count": 2, "allocationMode": "ExactCount"},
    }
    emu.create("resourceclaims", claim_body("v1claim"), namespace="default")
    read = await client.ResourceV1beta1Api(api).read_namespaced_resource_claim("v1claim", "default")
    assert read.spec.devices.requests[0].device_class_name == "gpu.example.com"
    v1 = await client.ResourceV1Api(api).read_namespaced_resource_claim("c", "default")
    assert v1.spec.devices.requests[0].exactly.count == 2


async def test_release_1_32_serves_v1beta1_without_taints() -> None:
    async with KubeApiEmulator(version="1.32") as emu, client.ApiClient(emu.configuration()) as api:
        created = await client.ResourceV1beta1Api(api).create_resource_slice(_beta1_slice("s"))
        assert created.spec.devices[0].basic.taints is None


async def test_gate_off_drops_taints(emu: KubeApiEmulator, api: Any) -> None:
    emu.set_feature_gate("DRADeviceTaints", False)
    assert emu.feature_gates["DRADeviceTaints"] is False
    body = slice_body("s")
    body["spec"]["devices"][0]["taints"] = [{"key": "a/b", "effect": "NoSchedule"}]
    created = await client.ResourceV1Api(api).create_resource_slice(body)
    assert created.spec.devices[0].taints is None
    stored = emu.get("resourceslices", "s")
    assert stored is not None and "taints" not in stored["spec"]["devices"][0]
    # Invalid taints are dropped before validation, so they do not fail either.
    body["spec"]["devices"][0]["taints"] = [{"key": "bad key", "effect": "Bogus"}]
    body["metadata"] = {"name": "t"}
    emu.create("resourceslices", body)


async def test_gate_off_keeps_taints_already_in_use(emu: KubeApiEmulator) -> None:
    body = slice_body("s")
    body["spec"]["devices"][0]["taints"] = [{"key": "a/b", "effect": "NoSchedule"}]
    stored = emu.create("resourceslices", body)
    emu.set_feature_gate("DRADeviceTaints", False)
    stored["spec"]["devices"][0]["taints"].append({"key": "a/c", "effect": "NoExecute"})
    updated = emu.update("resourceslices", stored)
    assert len(updated["spec"]["devices"][0]["taints"]) == 2


async def test_partitionable_fields_dropped_by_default(emu: KubeApiEmulator) -> None:
    body = slice_body("s")
    body["spec"]["devices"][0]["consumesCounters"] = [{"counterSet": "c", "counters": {}}]
    body["spec"]["sharedCounters"] = [{"name": "c", "counters": {"mem": {"value": "1Gi"}}}]
    stored = emu.create("resourceslices", body)
    assert "sharedCounters" not in stored["spec"]
    assert "consumesCounters" not in stored["spec"]["devices"][0]


async def test_gate_off_keeps_partitionable_fields_when_the_old_slice_uses_any(emu: KubeApiEmulator) -> None:
    """Upstream ``pkg/registry/resource/resourceslice/strategy.go``
    (``dropDisabledDRAPartitionableDevicesFields``): with the gate off, nothing is dropped when the
    old slice uses any partitionable field (``draPartitionableDevicesFeatureInUse`` looks at the
    whole slice), and everything is dropped when it uses none."""
    emu.set_feature_gate("DRAPartitionableDevices", True)
    body = slice_body("s")
    consumption = [{"counterSet": "c", "counters": {"mem": {"value": "1"}}}]
    body["spec"]["devices"][0]["consumesCounters"] = consumption
    stored = emu.create("resourceslices", body)
    emu.set_feature_gate("DRAPartitionableDevices", False)
    # The old slice consumes counters but defines no set: adding one is kept all the same.
    stored["spec"]["sharedCounters"] = [{"name": "c", "counters": {"mem": {"value": "1Gi"}}}]
    updated = emu.update("resourceslices", stored)
    assert updated["spec"]["sharedCounters"][0]["name"] == "c"
    assert updated["spec"]["devices"][0]["consumesCounters"][0]["counterSet"] == "c"
    # A slice that uses none of them loses them all, the counter set alone included.
    plain = emu.create("resourceslices", slice_body("t"))
    plain["spec"]["sharedCounters"] = [{"name": "c", "counters": {"mem": {"value": "1Gi"}}}]
    plain["spec"]["devices"][0]["consumesCounters"] = consumption
    again = emu.update("resourceslices", plain)
    assert "sharedCounters" not in again["spec"] and "consumesCounters" not in again["spec"]["devices"][0]


async def test_device_status_dropped_with_gate_off(emu: KubeApiEmulator) -> None:
    emu.set_feature_gate("DRAResourceClaimDeviceStatus", False)
    claim = emu.create("resourceclaims", claim_body(), namespace="default")
    claim["status"] = {
        "allocation": {
            "devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": "p", "device": "g"}]}
        },
        "devices": [{"driver": DRIVER, "pool": "p", "device": "g"}],
    }
    updated = emu.update("resourceclaims", claim, subresource="status")
    assert "devices" not in updated["status"]


async def test_unknown_fields_are_dropped_with_a_warning(emu: KubeApiEmulator) -> None:
    body = _beta1_slice("s")
    # A v1-shaped device sent to v1beta1: its fields sit outside `basic` and are unknown there.
    body["spec"]["devices"][0] = {"name": "gpu-0", "attributes": {"model": {"string": "X"}}}
    async with aiohttp.ClientSession() as session:
        url = emu.url + "/apis/resource.k8s.io/v1beta1/resourceslices"
        async with session.post(url, json=body) as response:
            assert response.status == 201
            expected = r'299 - "unknown field \"spec.devices[0].attributes\""'
            assert response.headers["Warning"] == expected
            created = await response.json()
        assert created["spec"]["devices"][0] == {"name": "gpu-0", "basic": {}}
        body["metadata"]["name"] = "strict"
        async with session.post(url, json=body, params={"fieldValidation": "Strict"}) as response:
            assert response.status == 400
            assert (
                'strict decoding error: unknown field "spec.devices[0].attributes"'
                in (await response.json())["message"]
            )
        async with session.post(url, json=body, params={"fieldValidation": "Sometimes"}) as response:
            assert response.status == 400


async def test_unknown_nested_fields(emu: KubeApiEmulator) -> None:
    body = slice_body("s")
    body["spec"]["devices"][0]["taints"] = [{"key": "a/b", "effect": "NoSchedule", "color": "red"}]
    body["spec"]["devices"][0]["attributes"]["model"]["float"] = 1.5
    body["spec"]["pool"]["owner"] = "me"
    body["spec"]["extra"] = True
    stored = emu.create("resourceslices", body)
    assert "color" not in stored["spec"]["devices"][0]["taints"][0]
    assert stored["spec"]["devices"][0]["attributes"]["model"] == {"string": "X"}
    assert "owner" not in stored["spec"]["pool"] and "extra" not in stored["spec"]
