"""Field and label selectors; merge, JSON and strategic merge patch."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio.client.exceptions import ApiException

from agent.emulator import ApiError, KubeApiEmulator
from agent.emulator.patch import json_patch, merge_patch, strategic_merge_patch
from agent.emulator.selectors import parse_label_selector
from tests.emulator.conftest import client, slice_body, status_of


def _labelled(name: str, node: str, labels: dict[str, str]) -> dict[str, Any]:
    body = slice_body(name, node=node)
    body["metadata"]["labels"] = labels
    return body


@pytest.fixture
def populated(emu: KubeApiEmulator) -> KubeApiEmulator:
    emu.create("resourceslices", _labelled("a", "node-a", {"tier": "gold", "zone": "z1"}))
    emu.create("resourceslices", _labelled("b", "node-b", {"tier": "silver"}))
    emu.create("resourceslices", _labelled("c", "node-a", {}))
    return emu


@pytest.mark.parametrize(
    ("field_selector", "label_selector", "expected"),
    [
        ("spec.nodeName=node-a", None, ["a", "c"]),
        ("spec.nodeName==node-a,metadata.name!=c", None, ["a"]),
        ("spec.driver=gpu.example.com,spec.nodeName=node-b", None, ["b"]),
        ("metadata.name=b", None, ["b"]),
        (None, "tier=gold", ["a"]),
        (None, "tier!=gold", ["b", "c"]),
        (None, "tier in (gold, silver)", ["a", "b"]),
        (None, "tier notin (gold)", ["b", "c"]),
        (None, "zone", ["a"]),
        (None, "!zone", ["b", "c"]),
        ("spec.nodeName=node-a", "tier", ["a"]),
    ],
)
async def test_selectors(
    populated: KubeApiEmulator,
    api: Any,
    field_selector: str | None,
    label_selector: str | None,
    expected: list[str],
) -> None:
    kwargs = {k: v for k, v in (("field_selector", field_selector), ("label_selector", label_selector)) if v}
    listed = await client.ResourceV1Api(api).list_resource_slice(**kwargs)
    assert [s.metadata.name for s in listed.items] == expected
    assert [s["metadata"]["name"] for s in populated.list("resourceslices", **kwargs)] == expected


async def test_unsupported_field_is_400(emu: KubeApiEmulator, api: Any) -> None:
    with pytest.raises(ApiException) as caught:
        await client.ResourceV1Api(api).list_resource_slice(field_selector="spec.pool.name=x")
    assert caught.value.status == 400
    assert status_of(caught.value)["message"] == "field label not supported: spec.pool.name"
    with pytest.raises(ApiException) as claims:
        await client.ResourceV1Api(api).list_resource_claim_for_all_namespaces(
            field_selector="spec.nodeName=x"
        )
    assert claims.value.status == 400
    with pytest.raises(ApiError) as garbage:
        emu.list("resourceslices", field_selector="nonsense")
    assert garbage.value.code == 400


def test_bad_label_selector() -> None:
    with pytest.raises(ApiError):
        parse_label_selector("bad key!=x")


async def test_merge_patch(emu: KubeApiEmulator, api: Any) -> None:
    emu.create("resourceslices", _labelled("a", "node-a", {"x": "1", "y": "2"}))
    patched = await client.ResourceV1Api(api).api_client.call_api(
        "/apis/resource.k8s.io/v1/resourceslices/a",
        "PATCH",
        header_params={"Content-Type": "application/merge-patch+json", "Accept": "application/json"},
        body={"metadata": {"labels": {"x": None, "z": "3"}}},
        response_types_map={200: "object"},
        _return_http_data_only=True,
    )
    assert patched["metadata"]["labels"] == {"y": "2", "z": "3"}
    assert emu.writes[("patch", "resourceslices")] == 1


async def test_json_patch(emu: KubeApiEmulator, api: Any) -> None:
    emu.create("resourceslices", slice_body("a"))
    ops = [
        {"op": "test", "path": "/spec/devices/0/name", "value": "gpu-0"},
        {"op": "add", "path": "/spec/devices/-", "value": {"name": "gpu-1"}},
        {"op": "replace", "path": "/spec/devices/0/capacity/memory/value", "value": "1024Mi"},
    ]
    patched = await client.ResourceV1Api(api).patch_resource_slice("a", ops)
    assert [d.name for d in patched.spec.devices] == ["gpu-0", "gpu-1"]
    assert patched.spec.devices[0].capacity["memory"].value == "1Gi"
    with pytest.raises(ApiException) as caught:
        await client.ResourceV1Api(api).patch_resource_slice(
            "a", [{"op": "test", "path": "/spec/driver", "value": "x"}]
        )
    assert caught.value.status == 422


async def test_patch_with_stale_resource_version_conflicts(emu: KubeApiEmulator, api: Any) -> None:
    emu.create("resourceslices", slice_body("a"))
    with pytest.raises(ApiException) as caught:
        await client.ResourceV1Api(api).patch_resource_slice("a", {"metadata": {"resourceVersion": "1"}})
    assert caught.value.status == 409


async def test_strategic_merge_patch_is_the_client_default(emu: KubeApiEmulator, api: Any) -> None:
    uid = emu.add_node("node-a")
    body = slice_body("a")
    body["metadata"]["ownerReferences"] = [{"apiVersion": "v1", "kind": "Node", "name": "node-a", "uid": uid}]
    emu.create("resourceslices", body)
    patched = await client.ResourceV1Api(api).patch_resource_slice("a", {"metadata": {"labels": {"k": "v"}}})
    assert patched.metadata.labels == {"k": "v"}
    assert len(patched.metadata.owner_references) == 1


async def test_unknown_patch_type_is_415(emu: KubeApiEmulator) -> None:
    emu.create("resourceslices", slice_body("a"))
    async with (
        aiohttp.ClientSession() as session,
        session.patch(
            emu.url + "/apis/resource.k8s.io/v1/resourceslices/a",
            data=b"{}",
            headers={"Content-Type": "application/x-yaml"},
        ) as response,
    ):
        assert response.status == 415


def test_patch_functions() -> None:
    assert merge_patch({"a": {"b": 1, "c": 2}}, {"a": {"b": None}, "d": [1]}) == {"a": {"c": 2}, "d": [1]}
    doc = {"a": [1, 2, 3], "b": {"c": 1}}
    assert json_patch(
        doc, [{"op": "remove", "path": "/a/1"}, {"op": "move", "from": "/b/c", "path": "/d"}]
    ) == {
        "a": [1, 3],
        "b": {},
        "d": 1,
    }
    assert json_patch(doc, [{"op": "copy", "from": "/b", "path": "/e"}])["e"] == {"c": 1}
    with pytest.raises(ApiError):
        json_patch(doc, [{"op": "remove", "path": "/missing"}])
    with pytest.raises(ApiError):
        json_patch(doc, [{"op": "replace", "path": "/zz", "value": 1}])
    with pytest.raises(ApiError):
        json_patch(doc, [{"op": "bogus", "path": "/a"}])
    with pytest.raises(ApiError):
        json_patch(doc, {"op": "add"})
    target = {"status": {"conditions": [{"type": "A", "status": "True"}, {"type": "B", "status": "False"}]}}
    patch = {"status": {"conditions": [{"type": "B", "status": "True"}, {"type": "C", "status": "True"}]}}
    merged = strategic_merge_patch(target, patch)
    assert [(c["type"], c["status"]) for c in merged["status"]["conditions"]] == [
        ("A", "True"),
        ("B", "True"),
        ("C", "True"),
    ]
    removed = strategic_merge_patch(target, {"status": {"conditions": [{"type": "A", "$patch": "delete"}]}})
    assert [c["type"] for c in removed["status"]["conditions"]] == ["B"]
    assert strategic_merge_patch({"spec": {"x": 1, "y": 2}}, {"spec": {"$patch": "replace", "z": 3}}) == {
        "spec": {"z": 3}
    }
    with pytest.raises(ApiError):
        strategic_merge_patch({}, {"$bogus": 1})
