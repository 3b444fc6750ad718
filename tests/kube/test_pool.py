"""The pool reconciler, case by case against the Go slice controller.

Cases and expectations follow ``TestControllerSyncPool`` in upstream
``staging/src/k8s.io/dynamic-resource-allocation/resourceslice/resourceslicecontroller_test.go``
(rules in ``resourceslicecontroller.go``, ``syncPool``): the same current slices and desired
devices give the same creates, updates, deletes and pool generation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from agent.core.model import Device
from agent.health.taints import ClusterTaintSupport, DeviceTaint
from agent.kube.pool import PoolTarget, build_pool, desired_pool, plan_pool

DRIVER = "driver.example.com"
NODE = "node-1"
UID = "node-uid"
TARGET = PoolTarget(DRIVER, NODE, UID)
ATTRS = {"new-attribute": {"string": "value"}}
TIME = "2026-01-01T00:00:00Z"


def dev(name: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, **extra}


def stored(
    name: str, devices: Sequence[dict[str, Any]], *, generation: int = 1, count: int = 1, pool: str = NODE
) -> dict[str, Any]:
    """A slice as the API server returns it."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {
            "name": name,
            "uid": f"uid-{name}",
            "resourceVersion": "7",
            "labels": {"app.kubernetes.io/managed-by": "dra-agent"},
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": UID, "controller": True}
            ],
        },
        "spec": {
            "driver": DRIVER,
            "nodeName": NODE,
            "pool": {"name": pool, "generation": generation, "resourceSliceCount": count},
            "devices": list(devices),
        },
    }


def names(bodies: Sequence[Mapping[str, Any]]) -> list[str]:
    return [str(b["metadata"].get("name", "<new>")) for b in bodies]


def test_create_slice_starts_at_generation_one() -> None:
    plan = plan_pool([], [[]], TARGET)
    (created,) = plan.creates
    assert plan.generation == 1 and not plan.updates and not plan.deletes
    assert created["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
    assert created["metadata"]["generateName"] == f"{NODE}-{DRIVER}-"
    assert created["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": UID, "controller": True}
    ]


def test_keep_slice_unchanged() -> None:
    plan = plan_pool([stored("s1", [dev("device")])], [[dev("device")]], TARGET)
    assert plan.writes == 0 and plan.generation == 1


def test_keep_taint_unchanged_without_time_added() -> None:
    taint = {"key": "k", "effect": "NoExecute"}
    current = stored("s1", [dev("device", taints=[{**taint, "timeAdded": TIME}])])
    assert plan_pool([current], [[dev("device", taints=[taint])]], TARGET).writes == 0


def test_add_taints_keeps_the_time_of_the_old_one_and_the_generation() -> None:
    old = {"key": "k", "effect": "NoExecute"}
    new = {"key": "example.com/tainted", "effect": "NoSchedule"}
    current = stored("s1", [dev("device", taints=[{**old, "timeAdded": TIME}])])
    plan = plan_pool([current], [[dev("device", taints=[old, new])]], TARGET)
    (updated,) = plan.updates
    assert plan.generation == 1 and not plan.creates and not plan.deletes
    assert updated["metadata"]["name"] == "s1" and updated["metadata"]["resourceVersion"] == "7"
    assert updated["spec"]["devices"][0]["taints"] == [{**old, "timeAdded": TIME}, new]


def test_one_existing_and_one_desired_slice_is_updated_in_place() -> None:
    plan = plan_pool([stored("s1", [])], [[dev("device")]], TARGET)
    assert names(plan.updates) == ["s1"] and plan.generation == 1
    assert plan.updates[0]["spec"]["devices"] == [dev("device")]


def test_delete_and_add_slice_when_more_than_one_existing_or_desired_slice() -> None:
    current = [stored("s1", [], count=2), stored("s2", [dev("device-2")], count=2)]
    plan = plan_pool(current, [[dev("device-1")], [dev("device-2")]], TARGET)
    assert names(plan.deletes) == ["s1"]
    assert names(plan.updates) == ["s2"] and len(plan.creates) == 1
    assert plan.generation == 2
    assert {b["spec"]["pool"]["generation"] for b in (*plan.updates, *plan.creates)} == {2}


def test_delete_redundant_slice() -> None:
    current = [stored("s1", [dev("device")]), stored("s2", [dev("device")])]
    plan = plan_pool(current, [[dev("device")]], TARGET)
    assert names(plan.deletes) == ["s2"] and not plan.updates and not plan.creates
    assert plan.generation == 1


def test_update_slice() -> None:
    plan = plan_pool([stored("s1", [dev("device")])], [[dev("device", attributes=ATTRS)]], TARGET)
    assert names(plan.updates) == ["s1"] and plan.generation == 1


def test_update_slice_many_devices() -> None:
    current = stored("s1", [dev("device-1"), dev("device-2")])
    plan = plan_pool([current], [[dev("device-1"), dev("device-2", attributes=ATTRS)]], TARGET)
    assert plan.writes == 1 and plan.generation == 1


def three(**changed: dict[str, Any]) -> tuple[list[dict[str, Any]], list[list[dict[str, Any]]]]:
    current = [stored(f"s{i}", [dev(f"device-{i}")], count=3) for i in (1, 2, 3)]
    desired = [[dev(f"device-{i}", **changed.get(f"d{i}", {}))] for i in (1, 2, 3)]
    return current, desired


def test_multiple_slices_no_changes() -> None:
    current, desired = three()
    assert plan_pool(current, desired, TARGET).writes == 0


def test_multiple_slices_stale_generations_are_deleted() -> None:
    current = [stored("s1", [], generation=1), stored("s2", [dev("device")], generation=2), stored("s3", [])]
    plan = plan_pool(current, [[dev("device")]], TARGET)
    assert names(plan.deletes) == ["s1", "s3"] and not plan.updates and not plan.creates
    assert plan.generation == 2


def test_multiple_slices_one_changed_keeps_the_generation() -> None:
    current, desired = three(d2={"attributes": ATTRS})
    plan = plan_pool(current, desired, TARGET)
    assert names(plan.updates) == ["s2"] and plan.generation == 1


def test_multiple_slices_two_changed_bump_the_generation_and_rewrite_all() -> None:
    """The rule the agent used to break: two changed slices are one new state of the pool."""
    current, desired = three(d2={"attributes": ATTRS}, d3={"attributes": ATTRS})
    plan = plan_pool(current, desired, TARGET)
    assert names(plan.updates) == ["s1", "s2", "s3"] and plan.generation == 2
    assert {u["spec"]["pool"]["generation"] for u in plan.updates} == {2}


def test_multiple_slices_one_removed() -> None:
    current, desired = three()
    plan = plan_pool(current, desired[:2], TARGET)
    assert names(plan.deletes) == ["s3"] and names(plan.updates) == ["s1", "s2"]
    assert plan.generation == 2
    assert {u["spec"]["pool"]["resourceSliceCount"] for u in plan.updates} == {2}


def test_multiple_slices_one_added() -> None:
    current, desired = three()
    plan = plan_pool(current, [*desired, [dev("device-4")]], TARGET)
    assert names(plan.updates) == ["s1", "s2", "s3"] and len(plan.creates) == 1
    assert plan.generation == 2 and not plan.deletes


def test_reordered_devices_are_a_change() -> None:
    current = stored("s1", [dev("device-1"), dev("device-2")])
    assert plan_pool([current], [[dev("device-2"), dev("device-1")]], TARGET).writes == 1


def test_our_extras_foreign_pool_and_new_node_uid() -> None:
    """Beyond Go: a slice of ours in another pool is deleted; a re-created Node's uid is written."""
    other = stored("old", [dev("device")], pool="renamed-node")
    plan = plan_pool([other, stored("s1", [dev("device")])], [[dev("device")]], TARGET)
    assert names(plan.deletes) == ["old"] and not plan.updates
    moved = plan_pool([stored("s1", [dev("device")])], [[dev("device")]], PoolTarget(DRIVER, NODE, "new-uid"))
    assert moved.updates[0]["metadata"]["ownerReferences"][0]["uid"] == "new-uid"


def test_desired_pool_leaves_out_bad_devices_and_chunks_the_rest() -> None:
    good = [Device(f"gpu-{i}", DRIVER, {"index": i}) for i in range(70)]
    bad = Device("gpu-x", DRIVER, {"index": 1})
    object.__setattr__(bad, "name", "Bad_Name")
    taints = {"gpu-3": (DeviceTaint(f"{DRIVER}/xid", "NoSchedule"),)}
    desired = desired_pool([*good, bad], taints, support=ClusterTaintSupport(16, True), max_devices=64)
    assert [len(c) for c in desired.chunks] == [64, 6]
    assert [p.device for p in desired.problems] == ["Bad_Name"]
    assert set(desired.taints) == {"gpu-3"}


def test_build_pool_is_the_plan_for_an_empty_cluster() -> None:
    devices = [Device(f"gpu-{i}", DRIVER, {"index": i}) for i in range(3)]
    (only,) = build_pool(driver=DRIVER, node_name=NODE, node_uid=UID, devices=devices, taints={})
    desired = desired_pool(devices, {}, support=ClusterTaintSupport())
    assert only == plan_pool([], desired.chunks, TARGET).creates[0]
