"""Create, read, update, delete through kubernetes-asyncio, and the direct methods."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio.client.exceptions import ApiException

from agent.emulator import ApiError, KubeApiEmulator
from tests.emulator.conftest import DRIVER, claim_body, client, slice_body, status_of


def _status(error: ApiException) -> dict[str, Any]:
    body: dict[str, Any] = status_of(error)
    return body


async def test_create_with_generate_name(emu: KubeApiEmulator, api: Any) -> None:
    emu.add_node("node-a")
    created = await client.ResourceV1Api(api).create_resource_slice(slice_body())
    name = created.metadata.name
    assert name.startswith(f"node-a-{DRIVER}-") and len(name) == len(f"node-a-{DRIVER}-") + 5
    assert created.metadata.uid and created.metadata.creation_timestamp
    assert created.metadata.generation == 1
    assert created.spec.devices[0].capacity["memory"].value == "80Gi"
    stored = emu.get("resourceslices", name)
    assert stored is not None and stored["metadata"]["resourceVersion"] == created.metadata.resource_version
    assert emu.writes[("create", "resourceslices")] == 1


async def test_resource_versions_increase_globally(emu: KubeApiEmulator) -> None:
    a = emu.create("resourceslices", slice_body("a"))
    b = emu.create("resourceslices", slice_body("b"))
    assert int(b["metadata"]["resourceVersion"]) > int(a["metadata"]["resourceVersion"])


async def test_already_exists(emu: KubeApiEmulator, api: Any) -> None:
    api_v1 = client.ResourceV1Api(api)
    await api_v1.create_resource_slice(slice_body("s"))
    with pytest.raises(ApiException) as caught:
        await api_v1.create_resource_slice(slice_body("s"))
    assert caught.value.status == 409
    status = _status(caught.value)
    assert (
        status["reason"] == "AlreadyExists" and status["kind"] == "Status" and status["status"] == "Failure"
    )
    assert status["message"] == 'resourceslices.resource.k8s.io "s" already exists'


async def test_get_missing_is_404(emu: KubeApiEmulator, api: Any) -> None:
    with pytest.raises(ApiException) as caught:
        await client.ResourceV1Api(api).read_resource_slice("nope")
    assert caught.value.status == 404
    assert _status(caught.value)["message"] == 'resourceslices.resource.k8s.io "nope" not found'
    assert _status(caught.value)["details"] == {
        "name": "nope",
        "group": "resource.k8s.io",
        "kind": "resourceslices",
    }
    assert emu.get("resourceslices", "nope") is None


async def test_update_conflict_on_stale_resource_version(emu: KubeApiEmulator, api: Any) -> None:
    api_v1 = client.ResourceV1Api(api)
    first = await api_v1.create_resource_slice(slice_body("s"))
    first.spec.devices[0].attributes["extra"] = client.V1DeviceAttribute(int=1)
    second = await api_v1.replace_resource_slice("s", first)
    assert second.metadata.generation == 2
    assert int(second.metadata.resource_version) > int(first.metadata.resource_version)
    with pytest.raises(ApiException) as caught:
        await api_v1.replace_resource_slice("s", first)  # still carries the old resourceVersion
    assert caught.value.status == 409 and _status(caught.value)["reason"] == "Conflict"
    assert "the object has been modified" in _status(caught.value)["message"]


async def test_unconditional_update_without_resource_version(emu: KubeApiEmulator) -> None:
    emu.create("resourceslices", slice_body("s"))
    body = slice_body("s")
    body["spec"]["devices"][0]["name"] = "gpu-1"
    updated = emu.update("resourceslices", body)
    assert updated["spec"]["devices"][0]["name"] == "gpu-1"


async def test_update_without_change_writes_nothing(emu: KubeApiEmulator) -> None:
    created = emu.create("resourceslices", slice_body("s"))
    again = emu.update("resourceslices", created)
    assert again["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"]
    assert emu.store.revision == int(created["metadata"]["resourceVersion"])


async def test_update_missing_is_404_and_name_mismatch_400(emu: KubeApiEmulator) -> None:
    with pytest.raises(ApiError) as caught:
        emu.update("resourceslices", slice_body("ghost"))
    assert caught.value.code == 404
    emu.create("resourceslices", slice_body("s"))
    rtype = emu.registry.type_for("resource.k8s.io", "resourceslices")
    with pytest.raises(ApiError) as bad:
        emu.registry.update(rtype, "v1", "s", slice_body("other"))
    assert bad.value.code == 400


async def test_immutable_fields(emu: KubeApiEmulator) -> None:
    emu.create("resourceslices", slice_body("s"))
    body = slice_body("s", node="node-b")
    body["spec"]["pool"]["name"] = "node-a"
    with pytest.raises(ApiError) as caught:
        emu.update("resourceslices", body)
    assert caught.value.code == 422
    assert [c["field"] for c in caught.value.details["causes"]] == ["spec.nodeName"]


async def test_delete_with_preconditions(emu: KubeApiEmulator, api: Any) -> None:
    api_v1 = client.ResourceV1Api(api)
    created = await api_v1.create_resource_slice(slice_body("s"))
    with pytest.raises(ApiException) as caught:
        await api_v1.delete_resource_slice(
            "s", body=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid="x"))
        )
    assert caught.value.status == 409 and "Precondition failed: UID" in _status(caught.value)["message"]
    with pytest.raises(ApiException) as stale:
        await api_v1.delete_resource_slice(
            "s", body=client.V1DeleteOptions(preconditions=client.V1Preconditions(resource_version="1"))
        )
    assert stale.value.status == 409
    deleted = await api_v1.delete_resource_slice(
        "s",
        body=client.V1DeleteOptions(
            preconditions=client.V1Preconditions(
                uid=created.metadata.uid, resource_version=created.metadata.resource_version
            )
        ),
    )
    assert deleted.metadata.name == "s"
    with pytest.raises(ApiException) as missing:
        await api_v1.delete_resource_slice("s")
    assert missing.value.status == 404
    assert emu.writes[("delete", "resourceslices")] == 4


async def test_delete_node_answers_status(emu: KubeApiEmulator, api: Any) -> None:
    emu.add_node("node-a")
    status = await client.CoreV1Api(api).delete_node("node-a")
    assert status.status == "Success" and status.details.name == "node-a"


async def test_delete_collection_with_selector(emu: KubeApiEmulator, api: Any) -> None:
    emu.create("resourceslices", slice_body("a", node="node-a"))
    emu.create("resourceslices", slice_body("b", node="node-b"))
    await client.ResourceV1Api(api).delete_collection_resource_slice(field_selector="spec.nodeName=node-a")
    assert [s["metadata"]["name"] for s in emu.list("resourceslices")] == ["b"]
    assert emu.writes[("deletecollection", "resourceslices")] == 1
    emu.delete_collection("resourceslices", field_selector="spec.driver=" + DRIVER)
    assert emu.list("resourceslices") == []


async def test_finalizers_delay_deletion(emu: KubeApiEmulator) -> None:
    body = slice_body("s")
    body["metadata"]["finalizers"] = ["example.com/keep"]
    emu.create("resourceslices", body)
    marked = emu.delete("resourceslices", "s")
    assert marked["metadata"]["deletionTimestamp"]
    stored = emu.get("resourceslices", "s")
    assert stored is not None
    stored["metadata"]["finalizers"] = []
    emu.update("resourceslices", stored)
    assert emu.get("resourceslices", "s") is None


async def test_claims_in_missing_namespace_are_rejected(emu: KubeApiEmulator, api: Any) -> None:
    with pytest.raises(ApiException) as caught:
        await client.ResourceV1Api(api).create_namespaced_resource_claim("nowhere", claim_body())
    assert caught.value.status == 404
    assert _status(caught.value)["message"] == 'namespaces "nowhere" not found'


async def test_namespace_mismatch_is_400(emu: KubeApiEmulator, api: Any) -> None:
    body = claim_body()
    body["metadata"]["namespace"] = "kube-system"
    with pytest.raises(ApiException) as caught:
        await client.ResourceV1Api(api).create_namespaced_resource_claim("default", body)
    assert caught.value.status == 400


async def test_claim_status_subresource(emu: KubeApiEmulator, api: Any) -> None:
    api_v1 = client.ResourceV1Api(api)
    body = claim_body()
    body["status"] = {"reservedFor": [{"resource": "pods", "name": "p", "uid": "u"}]}
    created = await api_v1.create_namespaced_resource_claim("default", body)
    assert created.status is None  # status is dropped on create
    result = {"request": "gpu", "driver": DRIVER, "pool": "node-a", "device": "gpu-0"}
    raw = emu.get("resourceclaims", "claim-a", namespace="default")
    assert raw is not None
    raw["status"] = {"allocation": {"devices": {"results": [result]}}}
    raw["spec"]["devices"]["requests"][0]["exactly"]["count"] = 5  # ignored by the status update
    with_status = emu.update("resourceclaims", raw, namespace="default", subresource="status")
    assert with_status["status"]["allocation"]["devices"]["results"] == [result]
    assert with_status["spec"]["devices"]["requests"][0]["exactly"]["count"] == 1
    # A main-resource update ignores status changes.
    again = emu.get("resourceclaims", "claim-a")
    assert again is not None
    again["status"] = {}
    again["metadata"]["labels"] = {"x": "y"}
    updated = await api_v1.replace_namespaced_resource_claim("claim-a", "default", again)
    assert updated.status.allocation.devices.results[0].device == "gpu-0"
    # The driver writes status.devices through the status subresource (patch).
    patched = await api_v1.patch_namespaced_resource_claim_status(
        "claim-a",
        "default",
        {"status": {"devices": [{"driver": DRIVER, "pool": "node-a", "device": "gpu-0", "data": {"a": 1}}]}},
    )
    assert patched.status.devices[0].device == "gpu-0"
    assert emu.writes[("patch", "resourceclaims/status")] == 1
    with pytest.raises(ApiException) as caught:
        await api_v1.patch_namespaced_resource_claim_status(
            "claim-a",
            "default",
            {"status": {"devices": [{"driver": DRIVER, "pool": "node-a", "device": "gpu-9"}]}},
        )
    assert caught.value.status == 422
    assert "must be an allocated device in the claim" in _status(caught.value)["message"]


async def test_claim_spec_is_immutable(emu: KubeApiEmulator) -> None:
    created = emu.create("resourceclaims", claim_body(), namespace="default")
    created["spec"]["devices"]["requests"][0]["exactly"]["count"] = 2
    with pytest.raises(ApiError) as caught:
        emu.update("resourceclaims", created)
    assert caught.value.code == 422 and caught.value.details["causes"][0]["field"] == "spec"


async def test_owner_garbage_collection(emu: KubeApiEmulator) -> None:
    uid = emu.add_node("node-a")
    body = slice_body("owned")
    body["metadata"]["ownerReferences"] = [
        {"apiVersion": "v1", "kind": "Node", "name": "node-a", "uid": uid, "controller": True}
    ]
    emu.create("resourceslices", body)
    emu.create("resourceslices", slice_body("free"))
    emu.delete("nodes", "node-a")
    assert emu.get("resourceslices", "owned") is None
    assert emu.get("resourceslices", "free") is not None


async def test_dangling_owner_reference_is_collected_or_trimmed(emu: KubeApiEmulator) -> None:
    uid = emu.add_node("node-a")
    ref = {"apiVersion": "v1", "kind": "Node", "name": "node-a", "uid": uid}
    gone_ref = {"apiVersion": "v1", "kind": "Node", "name": "node-b", "uid": "missing"}
    body = slice_body("two-owners")
    body["metadata"]["ownerReferences"] = [ref, gone_ref]
    emu.create("resourceslices", body)
    stale = slice_body("stale")
    stale["metadata"]["ownerReferences"] = [gone_ref]
    emu.create("resourceslices", stale)
    assert emu.get("resourceslices", "stale") is None  # collected right after its create
    assert emu.collect_garbage() == 0
    kept = emu.get("resourceslices", "two-owners")
    assert kept is not None and kept["metadata"]["ownerReferences"] == [ref]


async def test_list_pagination(emu: KubeApiEmulator) -> None:
    for i in range(5):
        emu.create("resourceslices", slice_body(f"s{i}"))
    async with aiohttp.ClientSession() as session:
        url = emu.url + "/apis/resource.k8s.io/v1/resourceslices"
        async with session.get(url, params={"limit": "2"}) as response:
            page = await response.json()
        names = [i["metadata"]["name"] for i in page["items"]]
        while page["metadata"].get("continue"):
            async with session.get(
                url, params={"limit": "2", "continue": page["metadata"]["continue"]}
            ) as response:
                page = await response.json()
            names += [i["metadata"]["name"] for i in page["items"]]
        assert names == [f"s{i}" for i in range(5)]
        async with session.get(url, params={"continue": "not-a-token"}) as response:
            assert response.status == 400


async def test_events_core_and_events_api(emu: KubeApiEmulator, api: Any) -> None:
    emu.add_node("node-a")
    event = {
        "metadata": {"name": "node-a.1", "namespace": "default"},
        "involvedObject": {"kind": "Node", "name": "node-a", "apiVersion": "v1"},
        "reason": "DeviceTainted",
        "message": "gpu-0 tainted",
        "type": "Warning",
        "source": {"component": "dra-agent"},
        # Without eventTime the events.k8s.io view has a null eventTime, which kubernetes-asyncio's
        # client-side validation rejects; the real apiserver behaves the same.
        "eventTime": "2026-01-01T00:00:00.000000Z",
    }
    await client.CoreV1Api(api).create_namespaced_event("default", event)
    listed = await client.CoreV1Api(api).list_event_for_all_namespaces(
        field_selector="involvedObject.kind=Node,involvedObject.name=node-a,reason=DeviceTainted"
    )
    assert [e.message for e in listed.items] == ["gpu-0 tainted"]
    modern = await client.EventsV1Api(api).list_namespaced_event("default")
    assert modern.items[0].note == "gpu-0 tainted" and modern.items[0].regarding.name == "node-a"
    with pytest.raises(ApiError) as caught:
        emu.create("events", {**event, "metadata": {"name": "x"}, "type": "Bad"})
    assert caught.value.code == 422


async def test_unknown_resource_in_direct_api(emu: KubeApiEmulator) -> None:
    with pytest.raises(ValueError, match="unknown resource"):
        emu.get("pods", "x")


async def test_method_not_allowed_and_bad_body(emu: KubeApiEmulator) -> None:
    async with aiohttp.ClientSession() as session:
        url = emu.url + "/apis/resource.k8s.io/v1/resourceslices"
        async with session.put(url, json={}) as response:
            assert response.status == 405
        async with session.post(
            url, data=b"{not json", headers={"Content-Type": "application/json"}
        ) as response:
            assert response.status == 400
        async with session.post(
            url, json={"apiVersion": "resource.k8s.io/v1beta1", "kind": "ResourceSlice"}
        ) as response:
            assert response.status == 400


async def test_node_status_subresource(emu: KubeApiEmulator, api: Any) -> None:
    emu.add_node("node-a")
    core = client.CoreV1Api(api)
    patched = await core.patch_node_status(
        "node-a", {"status": {"conditions": [{"type": "Ready", "status": "False"}]}}
    )
    assert [(c.type, c.status) for c in patched.status.conditions] == [("Ready", "False")]
    node = emu.get("nodes", "node-a")
    assert node is not None
    node["status"] = {}
    node["metadata"]["labels"]["x"] = "y"
    updated = emu.update("nodes", node)
    assert updated["status"]["conditions"][0]["status"] == "False"  # main update keeps status
    assert updated["metadata"]["labels"]["x"] == "y"


async def test_device_classes(emu: KubeApiEmulator) -> None:
    good = {"metadata": {"name": "gpu.example.com"}, "spec": {"selectors": [{"cel": {"expression": "true"}}]}}
    emu.create("deviceclasses", good)
    bad = {"metadata": {"name": "bad"}, "spec": {"selectors": [{"cel": {"expression": " "}}]}}
    with pytest.raises(ApiError) as caught:
        emu.create("deviceclasses", bad)
    assert caught.value.details["causes"][0]["field"] == "spec.selectors[0].cel.expression"
    config = {
        "metadata": {"name": "c"},
        "spec": {"config": [{"opaque": {"driver": "x.example.com", "parameters": 1}}]},
    }
    with pytest.raises(ApiError):
        emu.create("deviceclasses", config)


async def test_dry_run_writes_nothing(emu: KubeApiEmulator) -> None:
    async with aiohttp.ClientSession() as session:
        url = emu.url + "/apis/resource.k8s.io/v1/resourceslices"
        async with session.post(url, params={"dryRun": "All"}, json=slice_body("s")) as response:
            assert response.status == 201
    assert emu.get("resourceslices", "s") is None


async def test_internal_errors_answer_a_status(emu: KubeApiEmulator, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_: object, **__: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(emu.registry, "get", broken)
    url = emu.url + "/apis/resource.k8s.io/v1/resourceslices/x"
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        assert response.status == 500
        body = await response.json()
    assert body["reason"] == "InternalError" and "boom" in body["message"]
