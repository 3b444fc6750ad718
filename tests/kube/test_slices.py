"""Pure helpers of agent.kube.slices used by the publisher."""

from __future__ import annotations

from agent.core.model import Device
from agent.core.quantity import Quantity
from agent.health.taints import DeviceTaint
from agent.kube.pool import build_pool
from agent.kube.slices import (
    chunk_names,
    device_names,
    device_to_api,
    flat_device,
    natural_sorted,
    semantic_device,
)


def test_natural_order() -> None:
    assert natural_sorted(["gpu-10", "gpu-2", "gpu-1"]) == ["gpu-1", "gpu-2", "gpu-10"]


def test_chunks_respect_limits() -> None:
    names = [f"d-{i}" for i in range(300)]
    chunks = chunk_names(names, 128)
    assert [len(c) for c in chunks] == [128, 128, 44]
    assert chunks[0][:3] == ["d-0", "d-1", "d-2"]
    assert [len(c) for c in chunk_names(names, 64)] == [64, 64, 64, 64, 44]
    assert chunk_names([], 128) == [[]]


def test_semantic_equality_ignores_quantity_form_and_time_added() -> None:
    ours = {
        "name": "gpu-0",
        "capacity": {"memory": {"value": "1024Mi"}},
        "taints": [{"key": "k", "effect": "NoSchedule"}],
    }
    stored = {
        "name": "gpu-0",
        "basic": {
            "capacity": {"memory": {"value": "1Gi"}},
            "taints": [{"key": "k", "effect": "NoSchedule", "timeAdded": "2026-01-01T00:00:00Z"}],
        },
    }
    assert semantic_device(ours) == semantic_device(stored)
    assert semantic_device(ours) != semantic_device({**ours, "taints": []})
    assert flat_device(stored)["name"] == "gpu-0"


def test_build_pool_shapes() -> None:
    dev = Device("gpu-0", "gpu.example.com", {"index": 0}, {"memory": Quantity.binary(2**30)})
    taint = DeviceTaint("gpu.example.com/xid", "NoSchedule", "79")
    v1 = build_pool(driver=dev.driver, node_name="n", node_uid="u", devices=[dev], taints={"gpu-0": (taint,)})
    assert v1[0]["spec"]["devices"][0]["taints"][0]["value"] == "79"
    assert device_names(v1[0]) == {"gpu-0"}
    beta = device_to_api(dev, (taint,), "v1beta1")
    assert beta["basic"]["capacity"]["memory"] == {"value": "1Gi"}
