"""Fixtures: a running emulator and a kubernetes-asyncio client for it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client as _client
from kubernetes_asyncio.client.exceptions import ApiException

from agent.emulator import KubeApiEmulator

DRIVER = "gpu.example.com"

#: The kubernetes-asyncio client module, untyped: tests pass plain dicts where it declares models.
client: Any = _client


def status_of(error: ApiException) -> dict[str, Any]:
    """The Status body of a failed call."""
    body: dict[str, Any] = json.loads(error.body or b"{}")
    return body


def slice_body(
    name: str = "", node: str = "node-a", devices: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """A valid v1 ResourceSlice body (generateName when name is empty)."""
    meta: dict[str, Any] = {"name": name} if name else {"generateName": f"{node}-{DRIVER}-"}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": meta,
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": 0, "resourceSliceCount": 1},
            "devices": devices
            if devices is not None
            else [
                {
                    "name": "gpu-0",
                    "attributes": {"model": {"string": "X"}},
                    "capacity": {"memory": {"value": "80Gi"}},
                }
            ],
        },
    }


def claim_body(name: str = "claim-a") -> dict[str, Any]:
    """A valid v1 ResourceClaim with one request."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {
            "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.example.com"}}]}
        },
    }


@pytest.fixture
async def emu() -> AsyncIterator[KubeApiEmulator]:
    """An emulated 1.34 cluster with short bookmark intervals."""
    async with KubeApiEmulator(version="1.34", bookmark_interval=0.05) as emulator:
        yield emulator


@pytest.fixture
async def api(emu: KubeApiEmulator) -> AsyncIterator[Any]:
    """A kubernetes-asyncio ApiClient talking to `emu`."""
    async with client.ApiClient(emu.configuration()) as api_client:
        yield api_client


async def send(
    emu: KubeApiEmulator,
    method: str,
    path: str,
    body: Any = None,
    *,
    query: dict[str, str] | None = None,
    content_type: str = "application/json",
    token: str = "",
) -> tuple[int, dict[str, Any], str]:
    """One raw HTTP request: status, decoded body and the Warning header (`token`: a bearer token)."""
    data = body if isinstance(body, str) or body is None else json.dumps(body)
    headers = {"Content-Type": content_type, **({"Authorization": f"Bearer {token}"} if token else {})}
    async with (
        aiohttp.ClientSession() as session,
        session.request(method, emu.url + path, data=data, params=query or {}, headers=headers) as response,
    ):
        return response.status, await response.json(), response.headers.get("Warning", "")
