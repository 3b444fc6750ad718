"""Pre-publish validation of device entries and slices against the apiserver's rules."""

from __future__ import annotations

from typing import Any

import pytest

from agent.health.taints import ClusterTaintSupport
from agent.kube.validation import check_device_entry, check_slice_spec, partition_entries

OLD = ClusterTaintSupport(max_taints_per_device=4, none_effect=False)
NEW = ClusterTaintSupport(max_taints_per_device=16, none_effect=True)


def entry(**body: Any) -> dict[str, Any]:
    return {"name": "gpu-0", **body}


def test_valid_entry_passes() -> None:
    good = entry(
        attributes={"productName": {"string": "H100"}, "driverVersion": {"version": "550.54.15"}},
        capacity={"memory": {"value": "80Gi"}},
        taints=[{"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"}],
    )
    assert check_device_entry(good, OLD) is None


def test_v1beta1_basic_is_unwrapped() -> None:
    bad = {"name": "gpu-0", "basic": {"attributes": {"x": {"string": "y" * 65}}}}
    problem = check_device_entry(bad, OLD)
    assert problem is not None and problem.reason == "attributes"


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ({"name": "GPU_0"}, "name"),
        ({"name": "x" * 64}, "name"),
        (entry(attributes={"bad name": {"string": "x"}}), "attributes"),
        (entry(attributes={"a": {"int": 2**63}}), "attributes"),
        (entry(attributes={"a": {"int": True}}), "attributes"),
        (entry(attributes={"a": {"version": "1.2"}}), "attributes"),
        (entry(attributes={"a": {"string": "x", "int": 1}}), "attributes"),
        (entry(attributes={"a": {"float": 1.0}}), "attributes"),
        (entry(attributes={"a": {"bool": "yes"}}), "attributes"),
        (entry(attributes={f"a{i}": {"int": i} for i in range(33)}), "attributes"),
        (entry(attributes=["x"]), "attributes"),
        (entry(capacity={"memory": {"value": "lots"}}), "capacity"),
        (entry(capacity={"bad/": {"value": "1"}}), "capacity"),
        (entry(taints=[{"key": "k", "effect": "NoSchedule"}] * 5), "taints"),
        (entry(taints=[{"key": "k", "effect": "None"}]), "taints"),
        (entry(taints=[{"key": "k", "effect": "PreferNoSchedule"}]), "taints"),
        (entry(taints=[{"key": "bad key", "effect": "NoSchedule"}]), "taints"),
        (entry(taints=[{"key": "-x.io/k", "effect": "NoSchedule"}]), "taints"),
        (entry(taints=[{"key": "k", "value": "a b", "effect": "NoSchedule"}]), "taints"),
        (entry(taints=["k"]), "taints"),
        (entry(taints={"k": 1}), "taints"),
    ],
)
def test_invalid_entries_are_named(bad: dict[str, Any], reason: str) -> None:
    problem = check_device_entry(bad, OLD)
    assert problem is not None
    assert problem.reason == reason
    assert str(problem)


def test_new_clusters_accept_none_effect_and_sixteen_taints() -> None:
    taints = [{"key": f"k{i}", "effect": "None"} for i in range(16)]
    assert check_device_entry(entry(taints=taints), NEW) is None
    too_many = check_device_entry(entry(taints=[*taints, {"key": "x", "effect": "None"}]), NEW)
    assert too_many is not None and "at most 16" in too_many.message


def test_partition_keeps_valid_and_drops_duplicates() -> None:
    valid, problems = partition_entries([entry(), {"name": "Bad"}, entry(), {"name": "gpu-1"}], OLD)
    assert [e["name"] for e in valid] == ["gpu-0", "gpu-1"]
    assert sorted(p.reason for p in problems) == ["duplicate", "name"]


def test_slice_spec_checks() -> None:
    assert (
        check_slice_spec(driver="gpu.example.com", node_name="node-1", pool_name="node-1", device_count=3)
        == []
    )
    problems = check_slice_spec(driver="Bad_Driver!", node_name="", pool_name="", device_count=129)
    assert {p.reason for p in problems} == {"driver", "node", "pool", "count"}
