"""Leaving the device plugin: DeviceClasses serving an extended resource, the claims the scheduler
creates for such pods, ``exclude-devices=`` and the coexistence guard."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.app import create_backends
from agent.claims.state.machine import DeviceState
from agent.config import AgentConfig, parse_backend_spec
from agent.core.backend import ClaimRef
from agent.core.errors import ConfigError, DeviceNotFoundError
from agent.core.exclusion import ExcludingBackend, parse_exclusions
from agent.kubelet.deviceplugins import (
    device_plugins_dir,
    find_device_plugins,
    report_device_plugins,
    vendor_of,
)
from agent.observe.metrics import Metrics
from tests.deploy.chart import render_objects
from tests.kubelet.fakes import DRIVER, FakeBackend, FakeClaimSource, FakeEvents
from tests.kubelet.grpc_support import short_tmp_dir

A100 = "nvidia-a100-8x"
GPU1_UUID = "GPU-7949d8ea-3196-3772-8fa8-1d56acd75647"


# ----------------------------------------------------------------- chart


def classes(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in render_objects(values) if o["kind"] == "DeviceClass"}


BOTH = {"backends": {"nvidia": {"enabled": True}, "amd": {"enabled": True}}}


def test_device_classes_serve_no_extended_resource_by_default() -> None:
    found = classes(BOTH)
    assert {"gpu.nvidia.com", "gpu.amd.com"} <= set(found)
    assert all("extendedResourceName" not in c["spec"] for c in found.values())


def test_device_classes_serve_the_device_plugins_resource_names_when_enabled() -> None:
    """The DeviceClass field of KEP-5004 (resource/v1 types.go: ``extendedResourceName``)."""
    found = classes({**BOTH, "deviceClasses": {"extendedResources": {"enabled": True}}})
    assert found["gpu.nvidia.com"]["spec"]["extendedResourceName"] == "nvidia.com/gpu"
    assert found["gpu.amd.com"]["spec"]["extendedResourceName"] == "amd.com/gpu"
    # One class per resource name: the partition classes keep none.
    assert "extendedResourceName" not in found["mig.nvidia.com"]["spec"]
    assert "extendedResourceName" not in found["partition.gpu.amd.com"]["spec"]


# ----------------------------------------------------------------- the scheduler's claim


def extended_resource_claim(node: str) -> dict[str, Any]:
    """Exactly what the 1.34+ scheduler creates for ``limits: {example.com/gpu: 1}`` (see
    ../shared/reference/dra-1.36-verified-shapes.md section 3, from
    pkg/scheduler/framework/plugins/dynamicresources/extendeddynamicresources.go)."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "annotations": {"resource.kubernetes.io/extended-resource-claim": "true"},
            "finalizers": ["resource.kubernetes.io/delete-protection"],
            "generateName": "p-ext-1-extended-resources-",
            "name": "p-ext-1-extended-resources-6fvx4",
            "namespace": "default",
            "uid": "3d1f0c1e-5a5b-4c3d-9e8f-0a1b2c3d4e5f",
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "controller": True,
                    "kind": "Pod",
                    "name": "p-ext-1",
                    "uid": "66d17db5-12d4-47e9-81ab-c2e3da73253b",
                }
            ],
        },
        "spec": {
            "devices": {
                "requests": [
                    {
                        "exactly": {"allocationMode": "ExactCount", "count": 1, "deviceClassName": DRIVER},
                        "name": "container-0-request-0",
                    }
                ]
            }
        },
        "status": {
            "allocation": {
                "allocationTimestamp": "2026-11-23T20:27:28Z",
                "devices": {
                    "results": [
                        {
                            "device": "gpu-0",
                            "driver": DRIVER,
                            "pool": node,
                            "request": "container-0-request-0",
                        }
                    ]
                },
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                    ]
                },
            },
            "reservedFor": [
                {"name": "p-ext-1", "resource": "pods", "uid": "66d17db5-12d4-47e9-81ab-c2e3da73253b"}
            ],
        },
    }


async def test_the_claim_the_scheduler_creates_for_an_extended_resource_is_prepared(tmp_path: Path) -> None:
    node = "verify-n3"
    claim = extended_resource_claim(node)
    backend = FakeBackend()
    state = DeviceState(
        DRIVER,
        backend,
        FakeClaimSource([claim]),
        node_name=node,
        cdi_root=tmp_path / "cdi",
        state_dir=tmp_path / "state",
        boot_id="boot-1",
    )
    await state.start()
    ref = ClaimRef("default", "p-ext-1-extended-resources-6fvx4", claim["metadata"]["uid"])
    result = (await state.prepare([ref]))[ref.uid]
    assert result.error == ""
    ((device,),) = [result.devices]
    assert (device.device, device.pool, device.requests) == ("gpu-0", node, ("container-0-request-0",))
    assert backend.prepared == {ref.uid: {"gpu-0"}}
    assert await state.unprepare([ref]) == {ref.uid: ""}


# ----------------------------------------------------------------- exclude-devices


def test_exclusions_parse_names_and_uuids_and_refuse_empty_names() -> None:
    assert parse_exclusions("") == frozenset()
    assert parse_exclusions("gpu-0+GPU-1234") == {"gpu-0", "GPU-1234"}
    with pytest.raises(ConfigError, match=r"exclude-devices=gpu-0\+\+gpu-1.*joined with '\+'"):
        parse_exclusions("gpu-0++gpu-1")


def config(spec: str) -> AgentConfig:
    return AgentConfig(backends=(parse_backend_spec(spec),))


async def test_every_backend_gets_exclude_devices_from_the_core(caplog: pytest.LogCaptureFixture) -> None:
    """The fake backend refuses unknown settings: the core takes exclude-devices out first."""
    caplog.set_level(logging.INFO, logger="agent.core.exclusion")
    (backend,) = create_backends(config(f"fake:profile={A100},exclude-devices=gpu-0+{GPU1_UUID}+gpu-99"))
    assert isinstance(backend, ExcludingBackend)
    await backend.start()
    try:
        names = {d.name for d in await backend.discover()}
        assert "gpu-2" in names and not names & {"gpu-0", "gpu-1"}
        assert {t.device for t in await backend.telemetry()}.isdisjoint({"gpu-0", "gpu-1"})
        with pytest.raises(DeviceNotFoundError):
            await backend.prepare("gpu-1", ClaimRef("ns", "c", "u"))
        await backend.unprepare("gpu-1", ClaimRef("ns", "c", "u"))  # releasing stays possible
        assert backend.health_conditions  # optional protocols of the backend stay visible
    finally:
        await backend.stop()
    warned = [r for r in caplog.records if "names no device" in r.getMessage()]
    assert len(warned) == 1 and warned[0].__dict__["fields"]["names"] == "gpu-99"


def test_without_exclusions_the_backend_is_not_wrapped() -> None:
    (backend,) = create_backends(config(f"fake:profile={A100}"))
    assert not isinstance(backend, ExcludingBackend)


# ----------------------------------------------------------------- coexistence guard


@pytest.fixture
def kubelet_root() -> Iterator[Path]:
    yield from short_tmp_dir()


def listen(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    return sock


def test_vendor_is_the_label_before_the_top_level_domain() -> None:
    assert vendor_of("gpu.nvidia.com") == "nvidia"
    assert vendor_of("gpu.amd.com") == "amd"


async def test_a_device_plugin_of_the_same_vendor_is_reported_with_a_metric_and_an_event(
    kubelet_root: Path,
) -> None:
    directory = device_plugins_dir(kubelet_root / "plugins")
    directory.mkdir()
    sockets = [listen(directory / n) for n in ("kubelet.sock", "nvidia-gpu.sock", "amdgpu.sock")]
    (directory / "nvidia-notes.txt").write_text("not a socket")
    try:
        assert find_device_plugins(directory, "gpu.nvidia.com") == ["nvidia-gpu.sock"]
        metrics, events = Metrics(), FakeEvents()
        found = await report_device_plugins("gpu.nvidia.com", directory, metrics, events, excluding=False)
        assert found == ["nvidia-gpu.sock"]
        value = metrics.registry.get_sample_value(
            "dra_agent_device_plugin_present", {"driver": "gpu.nvidia.com", "socket": "nvidia-gpu.sock"}
        )
        assert value == 1
        ((reason, message, kind),) = events.recorded
        assert (reason, kind) == ("DevicePluginPresent", "Warning")
        assert "exclude-devices=" in message
        events = FakeEvents()
        await report_device_plugins("gpu.amd.com", directory, metrics, events, excluding=True)
        assert events.recorded[0][2] == "Normal"
    finally:
        for sock in sockets:
            sock.close()


async def test_no_device_plugins_directory_means_nothing_to_report(kubelet_root: Path) -> None:
    events = FakeEvents()
    found = await report_device_plugins(
        "gpu.nvidia.com", kubelet_root / "absent", Metrics(), events, excluding=False
    )
    assert found == [] and events.recorded == []


def test_the_chart_passes_exclude_devices_to_the_backend() -> None:
    values = {"backends": {"nvidia": {"enabled": True, "settings": {"exclude-devices": "GPU-a+GPU-b"}}}}
    (daemonset,) = [o for o in render_objects(values) if o["kind"] == "DaemonSet"]
    text = str(daemonset["spec"]["template"]["spec"]["containers"])
    assert "exclude-devices=GPU-a+GPU-b" in text
    spec = next(s for s in text.split("'") if s.startswith("nvidia:"))
    settings = parse_backend_spec(spec).settings
    assert parse_exclusions(settings["exclude-devices"]) == {"GPU-a", "GPU-b"}
