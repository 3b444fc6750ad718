"""API discovery per emulated release."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from agent.emulator import KubeApiEmulator
from tests.emulator.conftest import client


async def _get(emu: KubeApiEmulator, path: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.get(emu.url + path) as response:
        return response.status, await response.json()


@pytest.mark.parametrize(
    ("release", "versions"),
    [
        ("1.32", ["v1beta1"]),
        ("1.33", ["v1beta2", "v1beta1", "v1alpha3"]),
        ("1.34", ["v1", "v1beta2", "v1beta1", "v1alpha3"]),
        ("1.35", ["v1", "v1beta2", "v1beta1", "v1alpha3"]),
        ("1.36", ["v1", "v1beta2", "v1beta1", "v1alpha3"]),
        ("1.37", ["v1", "v1beta2", "v1beta1", "v1alpha3"]),
    ],
)
async def test_resource_group_versions_per_release(release: str, versions: list[str]) -> None:
    async with KubeApiEmulator(version=release) as emu:
        status, group = await _get(emu, "/apis/resource.k8s.io")
        assert status == 200
        assert [v["version"] for v in group["versions"]] == versions
        assert group["preferredVersion"]["version"] == versions[0]
        status, version = await _get(emu, "/version")
        assert version["gitVersion"].startswith(f"v{release}.")


async def test_v1alpha3_serves_only_device_taint_rules() -> None:
    async with KubeApiEmulator(version="1.34") as emu:
        _, resources = await _get(emu, "/apis/resource.k8s.io/v1alpha3")
        assert [r["name"] for r in resources["resources"]] == ["devicetaintrules", "devicetaintrules/status"]
        _, v1 = await _get(emu, "/apis/resource.k8s.io/v1")
        names = {r["name"]: r for r in v1["resources"]}
        assert {"resourceslices", "resourceclaims", "resourceclaims/status", "deviceclasses"} <= set(names)
        assert names["resourceslices"]["namespaced"] is False
        assert names["resourceclaims"]["namespaced"] is True
        assert names["resourceclaims/status"]["verbs"] == ["get", "patch", "update"]
        assert "watch" in names["resourceslices"]["verbs"]


async def test_v1beta2_lists_device_taint_rules_from_1_36() -> None:
    """1.36 adds DeviceTaintRule to resource.k8s.io/v1beta2 (same shape as v1alpha3)."""
    for release, listed in (("1.35", False), ("1.36", True)):
        async with KubeApiEmulator(version=release) as emu:
            _, resources = await _get(emu, "/apis/resource.k8s.io/v1beta2")
            assert ("devicetaintrules" in [r["name"] for r in resources["resources"]]) is listed, release
    async with KubeApiEmulator(version="1.36") as emu:
        rule = {
            "apiVersion": "resource.k8s.io/v1beta2",
            "kind": "DeviceTaintRule",
            "metadata": {"name": "r"},
            "spec": {"taint": {"key": "example.com/k", "effect": "NoSchedule"}},
        }
        async with aiohttp.ClientSession() as session:
            url = emu.url + "/apis/resource.k8s.io/v1beta2/devicetaintrules"
            async with session.post(url, json=rule) as response:
                assert response.status == 201
                assert (await response.json())["apiVersion"] == "resource.k8s.io/v1beta2"
        _, alpha = await _get(emu, "/apis/resource.k8s.io/v1alpha3/devicetaintrules/r")
        assert (
            alpha["apiVersion"] == "resource.k8s.io/v1alpha3"
            and alpha["spec"]["taint"]["key"] == "example.com/k"
        )


async def test_no_dra_has_no_resource_group() -> None:
    async with KubeApiEmulator(version="1.34", dra=False) as emu:
        _, groups = await _get(emu, "/apis")
        assert "resource.k8s.io" not in [g["name"] for g in groups["groups"]]
        status, body = await _get(emu, "/apis/resource.k8s.io/v1/resourceslices")
        assert status == 404 and body["kind"] == "Status" and body["reason"] == "NotFound"
    async with KubeApiEmulator(version="none") as emu:
        _, groups = await _get(emu, "/apis")
        assert "resource.k8s.io" not in [g["name"] for g in groups["groups"]]


async def test_unserved_version_is_404() -> None:
    async with KubeApiEmulator(version="1.32") as emu:
        status, _ = await _get(emu, "/apis/resource.k8s.io/v1/resourceslices")
        assert status == 404


async def test_core_discovery_through_client(emu: KubeApiEmulator, api: Any) -> None:
    core = await client.CoreApi(api).get_api_versions()
    assert core.versions == ["v1"]
    resources = await client.CoreV1Api(api).get_api_resources()
    assert {"nodes", "nodes/status", "events", "namespaces"} <= {r.name for r in resources.resources}
    groups = await client.ApisApi(api).get_api_versions()
    assert "resource.k8s.io" in [g.name for g in groups.groups]


async def test_unknown_release_is_refused() -> None:
    with pytest.raises(ValueError, match="unsupported Kubernetes version"):
        KubeApiEmulator(version="1.20")


async def test_device_taint_rules_need_the_gate() -> None:
    async with KubeApiEmulator(version="1.34", feature_gates={"DRADeviceTaints": False}) as emu:
        status, resources = await _get(emu, "/apis/resource.k8s.io/v1alpha3")
        assert status == 200 and resources["resources"] == []
