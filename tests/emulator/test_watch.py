"""Watches: initial state, resume from a resourceVersion, bookmarks, selectors, 410 after compaction."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import anyio
import pytest
from kubernetes_asyncio import watch
from kubernetes_asyncio.client.exceptions import ApiException

from agent.emulator import KubeApiEmulator
from tests.emulator.conftest import client, slice_body

SLICES = "/apis/resource.k8s.io/v1/resourceslices"


async def _events(
    emu: KubeApiEmulator, path: str, params: dict[str, str], count: int
) -> list[dict[str, Any]]:
    """Read up to `count` events (or until the server ends the stream)."""
    out: list[dict[str, Any]] = []
    async with aiohttp.ClientSession() as session, session.get(emu.url + path, params=params) as response:
        assert response.status == 200
        with anyio.fail_after(5):
            async for line in response.content:
                out.append(json.loads(line))
                if len(out) >= count:
                    break
    return out


async def test_watch_without_version_sends_current_state_then_changes(emu: KubeApiEmulator, api: Any) -> None:
    emu.create("resourceslices", slice_body("a"))
    seen: list[tuple[str, str]] = []
    stream = watch.Watch()
    async with anyio.create_task_group() as group:

        async def writer() -> None:
            await anyio.sleep(0.05)
            emu.create("resourceslices", slice_body("b"))
            emu.delete("resourceslices", "a")

        group.start_soon(writer)
        async for event in stream.stream(client.ResourceV1Api(api).list_resource_slice, timeout_seconds=5):
            seen.append((event["type"], event["object"].metadata.name))
            if len(seen) == 3:
                stream.stop()
    assert seen == [("ADDED", "a"), ("ADDED", "b"), ("DELETED", "a")]


async def test_resume_from_resource_version(emu: KubeApiEmulator) -> None:
    first = emu.create("resourceslices", slice_body("a"))
    emu.create("resourceslices", slice_body("b"))
    events = await _events(
        emu, SLICES, {"watch": "true", "resourceVersion": first["metadata"]["resourceVersion"]}, 1
    )
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "b")]


async def test_bookmarks(emu: KubeApiEmulator) -> None:
    created = emu.create("resourceslices", slice_body("a"))
    rv = created["metadata"]["resourceVersion"]
    events = await _events(
        emu, SLICES, {"watch": "true", "resourceVersion": rv, "allowWatchBookmarks": "true"}, 1
    )
    assert events[0]["type"] == "BOOKMARK"
    assert events[0]["object"]["kind"] == "ResourceSlice"
    assert int(events[0]["object"]["metadata"]["resourceVersion"]) >= int(rv)


async def test_send_initial_events_ends_with_marked_bookmark(emu: KubeApiEmulator) -> None:
    emu.create("resourceslices", slice_body("a"))
    params = {
        "watch": "true",
        "sendInitialEvents": "true",
        "allowWatchBookmarks": "true",
        "resourceVersionMatch": "NotOlderThan",
        "resourceVersion": "",
    }
    events = await _events(emu, SLICES, params, 2)
    assert events[0]["type"] == "ADDED"
    assert events[1]["type"] == "BOOKMARK"
    assert events[1]["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}
    async with (
        aiohttp.ClientSession() as session,
        session.get(emu.url + SLICES, params={"watch": "true", "sendInitialEvents": "true"}) as response,
    ):
        assert response.status == 400


async def test_watch_timeout_ends_stream(emu: KubeApiEmulator) -> None:
    events = await _events(
        emu, SLICES, {"watch": "1", "timeoutSeconds": "1", "resourceVersion": str(emu.store.revision)}, 10
    )
    assert events == []


async def test_too_old_resource_version_after_compaction(emu: KubeApiEmulator, api: Any) -> None:
    created = emu.create("resourceslices", slice_body("a"))
    emu.create("resourceslices", slice_body("b"))
    emu.compact()
    events = await _events(
        emu, SLICES, {"watch": "true", "resourceVersion": created["metadata"]["resourceVersion"]}, 1
    )
    assert events[0]["type"] == "ERROR"
    assert events[0]["object"]["code"] == 410 and events[0]["object"]["reason"] == "Expired"
    old_rv = created["metadata"]["resourceVersion"]
    with pytest.raises(ApiException) as caught:
        await client.ResourceV1Api(api).list_resource_slice(
            resource_version=old_rv, resource_version_match="Exact"
        )
    assert caught.value.status == 410
    # NotOlderThan is satisfied by the current state, as in the apiserver.
    listed = await client.ResourceV1Api(api).list_resource_slice(
        resource_version=old_rv, resource_version_match="NotOlderThan"
    )
    assert len(listed.items) == 2
    # Through the client's Watch the ERROR event becomes an ApiException.
    stream = watch.Watch()
    with pytest.raises(ApiException) as watched:
        async for _ in stream.stream(
            client.ResourceV1Api(api).list_resource_slice,
            resource_version=created["metadata"]["resourceVersion"],
            timeout_seconds=2,
        ):
            pass
    assert watched.value.status == 410


async def test_list_resource_version_rules(emu: KubeApiEmulator, api: Any) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(emu.url + SLICES, params={"resourceVersionMatch": "Exact"}) as response:
            assert response.status == 400
        too_new = str(emu.store.revision + 100)
        async with session.get(emu.url + SLICES, params={"resourceVersion": too_new}) as response:
            assert response.status == 504
        async with session.get(emu.url + SLICES, params={"resourceVersion": "abc"}) as response:
            assert response.status == 400
    listed = await client.ResourceV1Api(api).list_resource_slice(resource_version="0")
    assert int(listed.metadata.resource_version) == emu.store.revision


async def test_field_selector_turns_changes_into_added_and_deleted(emu: KubeApiEmulator) -> None:
    rv = str(emu.store.revision)
    emu.create("resourceslices", slice_body("a"))
    labelled = emu.get("resourceslices", "a")
    assert labelled is not None
    labelled["metadata"]["labels"] = {"team": "x"}
    emu.update("resourceslices", labelled)
    labelled = emu.get("resourceslices", "a")
    assert labelled is not None
    labelled["metadata"]["labels"] = {"team": "y"}
    emu.update("resourceslices", labelled)
    events = await _events(
        emu, SLICES, {"watch": "true", "resourceVersion": rv, "labelSelector": "team=x"}, 2
    )
    assert [e["type"] for e in events] == ["ADDED", "DELETED"]


async def test_namespaced_watch_and_v1beta1_shape(emu: KubeApiEmulator) -> None:
    rv = str(emu.store.revision)
    emu.create("resourceslices", slice_body("a"))
    events = await _events(
        emu, "/apis/resource.k8s.io/v1beta1/resourceslices", {"watch": "true", "resourceVersion": rv}, 1
    )
    device = events[0]["object"]["spec"]["devices"][0]
    assert set(device) == {"name", "basic"}
    assert events[0]["object"]["apiVersion"] == "resource.k8s.io/v1beta1"
