"""Fault injection: latency, error codes, 429 with Retry-After, outages and dropped watches."""

from __future__ import annotations

from typing import Any

import aiohttp
import anyio
import pytest
from kubernetes_asyncio.client.exceptions import ApiException

from agent.emulator import KubeApiEmulator
from tests.emulator.conftest import client, slice_body, status_of

SLICES = "/apis/resource.k8s.io/v1/resourceslices"


async def test_fail_next_matching_requests(emu: KubeApiEmulator, api: Any) -> None:
    emu.faults.fail_next(2, status=409, verbs={"update"}, resource="resourceslices")
    api_v1 = client.ResourceV1Api(api)
    created = await api_v1.create_resource_slice(slice_body("s"))  # not an update: passes
    for _ in range(2):
        with pytest.raises(ApiException) as caught:
            await api_v1.replace_resource_slice("s", created)
        assert caught.value.status == 409
        status = status_of(caught.value)
        assert status["kind"] == "Status" and status["reason"] == "Conflict" and status["code"] == 409
    await api_v1.replace_resource_slice("s", created)
    assert emu.writes[("update", "resourceslices")] == 3


async def test_fail_all_and_clear(emu: KubeApiEmulator, api: Any) -> None:
    emu.faults.fail_all(status=500)
    for _ in range(3):
        with pytest.raises(ApiException) as caught:
            await client.CoreV1Api(api).list_node()
        assert caught.value.status == 500 and status_of(caught.value)["reason"] == "InternalError"
    emu.faults.clear()
    await client.CoreV1Api(api).list_node()


async def test_429_has_retry_after(emu: KubeApiEmulator) -> None:
    emu.faults.fail_next(1, status=429, retry_after=3)
    async with aiohttp.ClientSession() as session, session.get(emu.url + SLICES) as response:
        assert response.status == 429
        assert response.headers["Retry-After"] == "3"
        body = await response.json()
        assert body["reason"] == "TooManyRequests" and body["details"]["retryAfterSeconds"] == 3


async def test_latency(emu: KubeApiEmulator) -> None:
    emu.faults.latency = 0.05
    async with aiohttp.ClientSession() as session:
        start = anyio.current_time()
        async with session.get(emu.url + SLICES) as response:
            assert response.status == 200
        assert anyio.current_time() - start >= 0.05


async def test_outage_resets_connections_then_recovers(emu: KubeApiEmulator, api: Any) -> None:
    emu.add_node("node-a")
    core = client.CoreV1Api(api)
    await core.list_node()  # leaves a kept-alive connection
    emu.faults.outage(True)
    for _ in range(2):
        with pytest.raises((aiohttp.ClientError, OSError)):
            await core.list_node()
    async with aiohttp.ClientSession() as session:
        with pytest.raises((aiohttp.ClientError, OSError)):
            async with session.get(emu.url + "/version"):
                pass
    emu.faults.outage(False)
    nodes = await core.list_node()
    assert [n.metadata.name for n in nodes.items] == ["node-a"]
    emu.faults.outage(True)
    emu.faults.clear()
    assert not emu.faults.down
    await core.list_node()


async def test_drop_watches(emu: KubeApiEmulator) -> None:
    rv = str(emu.store.revision)
    async with aiohttp.ClientSession() as session:
        params = {"watch": "true", "resourceVersion": rv}
        async with session.get(emu.url + SLICES, params=params) as response:
            lines: list[bytes] = []
            with anyio.fail_after(5):
                async with anyio.create_task_group() as group:

                    async def dropper() -> None:
                        await anyio.sleep(0.05)
                        emu.create("resourceslices", slice_body("a"))
                        await anyio.sleep(0.05)
                        emu.faults.drop_watches()

                    group.start_soon(dropper)
                    async for line in response.content:
                        lines.append(line)
            assert len(lines) == 1  # the stream ended after the drop


async def test_outage_cuts_watches(emu: KubeApiEmulator) -> None:
    async with aiohttp.ClientSession() as session:
        params = {"watch": "true", "resourceVersion": str(emu.store.revision)}
        async with session.get(emu.url + SLICES, params=params) as response:
            with anyio.fail_after(5):
                async with anyio.create_task_group() as group:

                    async def down() -> None:
                        await anyio.sleep(0.05)
                        emu.faults.outage(True)

                    group.start_soon(down)
                    with pytest.raises(aiohttp.ClientError):
                        async for _ in response.content:
                            pass
    emu.faults.outage(False)


async def test_faults_match_subresources_and_verbs() -> None:
    from agent.emulator.faults import FailureRule

    rule = FailureRule(1, 500, frozenset({"patch"}), "resourceclaims")
    assert rule.matches("patch", "resourceclaims/status")
    assert not rule.matches("update", "resourceclaims")
    assert not rule.matches("patch", "resourceslices")
