"""The ResourceSlice publisher against the Kubernetes API emulator."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import anyio
import pytest

from agent.core.backend import ConditionKind, HealthEvent
from agent.core.model import Device, Severity
from agent.health.taints import ClusterTaintSupport, DeviceTaint, TaintPolicy
from agent.health.tracker import HealthTracker
from agent.kube.pool import build_pool
from tests.kube.harness import DRIVER, NODE, eventually, harness, make_devices
from tests.support.clock import FakeClock

XID = HealthEvent("gpu-1", "xid", Severity.CRITICAL, value="79", message="fell off the bus")


async def test_first_publish_has_owner_pool_and_devices() -> None:
    async with harness() as h:
        await h.settle(lambda: len(h.devices()) == 4)
        (slice_,) = h.slices()
        meta, spec = slice_["metadata"], slice_["spec"]
        assert meta["name"].startswith(f"{NODE}-{DRIVER}-")
        node_uid = h.emu.get("nodes", NODE)["metadata"]["uid"]
        assert meta["ownerReferences"] == [
            {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": node_uid, "controller": True}
        ]
        assert spec["nodeName"] == NODE and spec["driver"] == DRIVER
        # A new pool starts at generation 1, as the Go slice controller's.
        assert spec["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
        assert h.devices()["gpu-0"]["capacity"]["memory"]["value"] == "80Gi"
        await h.settle(lambda: h.metric("dra_agent_resourceslices", {"driver": DRIVER}) == 1)


async def test_no_change_resync_makes_zero_writes() -> None:
    async with harness() as h:
        tracker = HealthTracker(h.inventory, FakeClock(), hold_seconds=60)
        await tracker.handle(XID)  # a stored taint gains timeAdded: still no rewrite
        await h.settle(lambda: bool(h.taints("gpu-1")))
        await anyio.sleep(0.1)
        h.emu.reset_writes()
        result = await h.publisher.reconcile()
        h.inventory.set_devices(h.inventory.devices())
        h.publisher.trigger()
        await anyio.sleep(0.2)
        assert result.writes == 0
        assert h.writes() == 0


async def test_restore_after_delete_edit_and_wipe() -> None:
    async with harness() as h:
        await h.settle(lambda: len(h.devices()) == 4)
        (first,) = h.slices()
        h.emu.delete("resourceslices", first["metadata"]["name"])
        await h.settle(lambda: len(h.devices()) == 4, within=1.0)
        (restored,) = h.slices()
        assert restored["metadata"]["name"] != first["metadata"]["name"]

        body = dict(restored)
        body["spec"] = {**restored["spec"], "devices": restored["spec"]["devices"][:1]}
        h.emu.update("resourceslices", body)
        await h.settle(lambda: len(h.devices()) == 4, within=1.0)

        h.emu.delete_collection("resourceslices", field_selector=f"spec.nodeName={NODE}")
        await h.settle(lambda: len(h.devices()) == 4, within=1.0)


async def test_large_pool_is_split_and_shrinks_with_a_new_generation() -> None:
    async with harness(devices=make_devices(300)) as h:
        await h.settle(lambda: len(h.devices()) == 300)
        slices = h.slices()
        assert sorted(len(s["spec"]["devices"]) for s in slices) == [44, 128, 128]
        assert {
            (s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"]) for s in slices
        } == {(1, 3)}
        h.inventory.set_devices(make_devices(100))
        await h.settle(lambda: len(h.slices()) == 1 and len(h.devices()) == 100)
        (only,) = h.slices()
        assert only["spec"]["pool"]["resourceSliceCount"] == 1
        assert only["spec"]["pool"]["generation"] >= 2


async def test_taint_added_held_and_lifted_with_events() -> None:
    clock = FakeClock()
    async with harness() as h:
        tracker = HealthTracker(h.inventory, clock, hold_seconds=60)
        await h.settle(lambda: len(h.devices()) == 4)
        await tracker.handle(dataclasses.replace(XID, at=clock.time()))
        await h.settle(lambda: bool(h.taints("gpu-1")))
        (taint,) = h.taints("gpu-1")
        assert taint["effect"] in ("NoSchedule", "NoExecute") and taint["timeAdded"]
        assert not h.taints("gpu-0")
        clock.advance(30)
        tracker.expire()
        await anyio.sleep(0.1)
        assert h.taints("gpu-1")
        clock.advance(600)
        tracker.expire()
        await h.settle(lambda: not h.taints("gpu-1"))
        await h.settle(lambda: {"DeviceTainted", "DeviceTaintLifted"} <= set(h.event_reasons()))
        assert (
            h.metric(
                "dra_agent_device_taints", {"driver": DRIVER, "key": taint["key"], "effect": taint["effect"]}
            )
            == 0
        )


async def test_flapping_device_ends_in_the_final_state() -> None:
    clock = FakeClock()
    async with harness() as h:
        tracker = HealthTracker(h.inventory, clock, hold_seconds=5)
        await h.settle(lambda: len(h.devices()) == 4)
        lost = HealthEvent("gpu-2", "gpu-lost", Severity.CRITICAL, kind=ConditionKind.STATE)
        for _ in range(20):
            await tracker.handle(dataclasses.replace(lost, at=clock.time()))
            await anyio.sleep(0.002)
            await tracker.handle(dataclasses.replace(lost, cleared=True, at=clock.time()))
            clock.advance(1)
            tracker.expire()
        await tracker.handle(dataclasses.replace(lost, at=clock.time()))
        await h.settle(lambda: bool(h.taints("gpu-2")))
        await anyio.sleep(0.2)
        assert h.taints("gpu-2")


async def test_xid_storm_is_coalesced() -> None:
    clock = FakeClock()
    async with harness(min_write_interval=0.5) as h:
        tracker = HealthTracker(h.inventory, clock, hold_seconds=60)
        await h.settle(lambda: len(h.devices()) == 4)
        await anyio.sleep(0.1)
        h.emu.reset_writes()
        for i in range(1000):
            await tracker.handle(
                HealthEvent(f"gpu-{i % 4}", "xid", Severity.CRITICAL, value=str(40 + i % 30))
            )
            if i % 100 == 0:
                await anyio.sleep(0.05)
        await h.settle(lambda: all(h.taints(f"gpu-{i}") for i in range(4)))
        await anyio.sleep(0.6)
        wanted = TaintPolicy.default().taint_map(h.inventory.devices(), h.kube.info.taint_support)
        await h.settle(
            lambda: {d: len(h.taints(d)) for d in wanted} == {d: len(t) for d, t in wanted.items()}, within=3
        )
        assert h.writes() <= 6, h.emu.writes


async def test_outage_of_a_minute_is_logged_once_and_recovers(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    caplog.set_level(logging.INFO, logger="agent.kube.publisher")
    async with harness(clock=clock, backoff_initial=0.5, backoff_max=10.0) as h:
        tracker = HealthTracker(h.inventory, clock, hold_seconds=600)
        await h.settle(lambda: len(h.devices()) == 4)
        h.emu.faults.outage(True)
        await tracker.handle(XID)
        started = clock.time()
        while clock.time() - started < 60:
            clock.advance(0.5)
            await anyio.sleep(0.005)
        h.emu.faults.outage(False)
        await h.settle(lambda: bool(h.taints("gpu-1")), within=10)
        await h.settle(lambda: any("published again" in r.message for r in caplog.records))
        messages = [r.message for r in caplog.records if r.name == "agent.kube.publisher"]
        assert sum("cannot publish" in m for m in messages) == 1, messages
        assert sum("published again" in m for m in messages) == 1, messages


async def test_conflict_storm_and_server_errors_are_retried() -> None:
    clock = FakeClock()
    async with harness(backoff_max=0.05) as h:
        await h.settle(lambda: len(h.devices()) == 4)
        h.emu.faults.fail_next(15, status=409, verbs={"update"}, resource="resourceslices")
        tracker = HealthTracker(h.inventory, clock, hold_seconds=60)
        await tracker.handle(XID)
        await h.settle(lambda: bool(h.taints("gpu-1")), within=10)
        assert h.metric("dra_agent_api_retries_total", {"reason": "conflict"}) >= 1
        h.emu.faults.fail_next(5, status=500, verbs={"create"}, resource="resourceslices")
        h.emu.delete_collection("resourceslices", field_selector=f"spec.nodeName={NODE}")
        await h.settle(lambda: len(h.devices()) == 4, within=10)
        assert h.metric("dra_agent_api_retries_total", {"reason": "server_error"}) >= 1


async def test_dropped_watches_and_compaction() -> None:
    async with harness() as h:
        await h.settle(lambda: len(h.devices()) == 4)
        h.emu.faults.drop_watches()
        await anyio.sleep(0.1)
        h.emu.delete_collection("resourceslices", field_selector=f"spec.nodeName={NODE}")
        await h.settle(lambda: len(h.devices()) == 4, within=2)
        h.emu.compact()
        h.emu.faults.drop_watches()
        await anyio.sleep(0.1)
        h.emu.delete_collection("resourceslices", field_selector=f"spec.nodeName={NODE}")
        await h.settle(lambda: len(h.devices()) == 4, within=2)
        assert (
            h.metric("dra_agent_watch_restarts_total", {"resource": "resourceslices", "reason": "closed"})
            + h.metric("dra_agent_watch_restarts_total", {"resource": "resourceslices", "reason": "error"})
            >= 1
        )


async def test_node_that_appears_late(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="agent.kube.publisher")
    async with harness(add_node=False) as h:
        await anyio.sleep(0.3)
        assert h.slices() == []
        uid = h.emu.add_node(NODE)
        await h.settle(lambda: len(h.devices()) == 4, within=2)
        assert h.slices()[0]["metadata"]["ownerReferences"][0]["uid"] == uid
        assert sum("node object not found" in r.message for r in caplog.records) == 1


async def test_v1beta1_cluster_publishes_and_reports_untaintable_devices() -> None:
    clock = FakeClock()
    async with harness(version="1.32", gates={}) as h:
        assert h.kube.slice_version == "v1beta1"
        await h.settle(lambda: len(h.devices()) == 4)
        tracker = HealthTracker(h.inventory, clock, hold_seconds=60)
        await tracker.handle(XID)
        await h.settle(
            lambda: (
                h.metric("dra_agent_publish_errors_total", {"driver": DRIVER, "reason": "taints_unsupported"})
                >= 1
            )
        )
        assert "gpu-1" in h.devices() and not h.taints("gpu-1")
        assert not h.publisher.taints_in_slices
        await anyio.sleep(0.1)
        h.emu.reset_writes()
        assert (await h.publisher.reconcile()).writes == 0  # v1beta1's `basic` compares equal
        assert h.writes() == 0


async def test_dropped_taints_make_devices_unpublishable(caplog: pytest.LogCaptureFixture) -> None:
    """No DeviceTaintRule fallback: upstream the rules need ``DRADeviceTaintRules``, which needs
    ``DRADeviceTaints`` (``pkg/features/kube_features.go``), so a cluster that drops slice taints
    also ignores rules. The devices are reported as unpublishable instead: one Event and one log
    line naming the gate per episode, a gauge, a readiness detail."""
    caplog.set_level(logging.INFO, logger="agent.kube.publisher")
    clock = FakeClock()
    readiness: list[tuple[bool, str]] = []

    def on_published(ok: bool, detail: str) -> None:
        readiness.append((ok, detail))

    async with harness(version="1.34", resync_seconds=0.3, on_published=on_published) as h:
        await h.settle(lambda: len(h.devices()) == 4)
        h.emu.set_feature_gate("DRADeviceTaints", False)
        tracker = HealthTracker(h.inventory, clock, hold_seconds=60)
        await tracker.handle(XID)
        await h.settle(lambda: not h.publisher.taints_in_slices)
        unpublishable = {"driver": DRIVER}
        await h.settle(lambda: h.metric("dra_agent_unpublishable_devices", unpublishable) == 1)
        await tracker.handle(dataclasses.replace(XID, device="gpu-2"))
        await h.settle(lambda: h.metric("dra_agent_unpublishable_devices", unpublishable) == 2)
        assert readiness[-1][0] and "DRADeviceTaints" in readiness[-1][1]
        assert "gpu-1" in h.devices() and not h.taints("gpu-1")
        assert h.metric("dra_agent_taints_dropped_by_apiserver_total", {"driver": DRIVER}) == 1
        errors = {"driver": DRIVER, "reason": "taints_unsupported"}
        assert h.metric("dra_agent_publish_errors_total", errors) == 1  # one episode
        await h.settle(lambda: "DeviceTaintUnsupported" in h.event_reasons())
        assert h.event_reasons().count("DeviceTaintUnsupported") == 1
        gate_lines = [r for r in caplog.records if "enable the DRADeviceTaints" in r.getMessage()]
        assert len(gate_lines) == 1
        assert h.writes("devicetaintrules") == 0

        # The gate comes back: the next resync probes again and the taints are published.
        h.emu.set_feature_gate("DRADeviceTaints", True)
        await h.settle(lambda: bool(h.taints("gpu-1")) and bool(h.taints("gpu-2")))
        await h.settle(lambda: h.metric("dra_agent_unpublishable_devices", unpublishable) == 0)
        await h.settle(lambda: readiness[-1] == (True, ""))


async def test_a_slow_events_endpoint_does_not_delay_taints() -> None:
    """Events go out from their own bounded queue: with each Event POST hanging until the client's
    timeout (2 s here), a second taint is still published before the first Event gives up."""
    clock = FakeClock()
    async with harness() as h:
        await h.settle(lambda: len(h.devices()) == 4)
        h.emu.faults.slow["events"] = 2.5  # beyond the client's 2 s timeout
        tracker = HealthTracker(h.inventory, clock, hold_seconds=60)
        await tracker.handle(XID)
        await h.settle(lambda: bool(h.taints("gpu-1")))
        await h.settle(lambda: h.emu.requests[("create", "events")] >= 1)
        await tracker.handle(dataclasses.replace(XID, device="gpu-2"))
        await h.settle(lambda: bool(h.taints("gpu-2")))
        failed = {"resource": "events", "verb": "create", "result": "error"}
        assert h.metric("dra_agent_api_writes_total", failed) == 0  # the first Event is still in flight


async def test_a_full_event_queue_drops_events_without_blocking() -> None:
    async with harness(start=False, event_queue_size=2) as h:
        queue = h.publisher.events
        assert queue is not None
        assert [queue.post("R", f"m{i}") for i in range(3)] == [True, True, False]
        assert queue.dropped == 1


async def test_capabilities_are_probed_not_read_from_the_version() -> None:
    """A 1.34 server with the gate off drops taints from the probe: known before any taint."""
    async with harness(version="1.34", gates={"DRADeviceTaints": False}) as h:
        await h.settle(lambda: len(h.devices()) == 4)
        caps = h.publisher.capabilities
        assert caps is not None and caps.probed and not caps.slice_taints
        assert h.emu.requests[("create", "resourceslices")] >= 1 and len(h.slices()) == 1  # dry-run


async def test_control_plane_upgrade_is_probed_again() -> None:
    async with harness(version="1.34", resync_seconds=0.2) as h:
        await h.settle(lambda: len(h.devices()) == 4)
        before = h.publisher.capabilities
        assert before is not None and not before.none_effect and before.max_taints_per_device == 4
        h.emu.version = "1.35"  # the control plane is upgraded under the running agent
        h.emu.registry.release = "1.35"

        def upgraded() -> bool:
            caps = h.publisher.capabilities
            return caps is not None and caps.none_effect and caps.max_taints_per_device == 16

        await h.settle(upgraded)
        assert h.publisher.capabilities is not None
        assert h.publisher.capabilities.server_version.startswith("v1.35")


class FiveTaints:
    """A policy that ignores the cluster's limit, to prove validation catches it."""

    def taint_map(
        self, devices: Sequence[Device], support: ClusterTaintSupport
    ) -> dict[str, tuple[DeviceTaint, ...]]:
        return {"gpu-3": tuple(DeviceTaint(f"{DRIVER}/c{i}", "NoSchedule") for i in range(5))}


async def test_invalid_devices_are_left_out() -> None:
    devices: Sequence[Device] = make_devices(4)
    bad = make_devices(1)[0]
    object.__setattr__(bad, "name", "Bad_Name")  # bypass the model's own checks
    async with harness(devices=[*devices[:3], bad, devices[3]], policy=FiveTaints()) as h:
        await h.settle(lambda: set(h.devices()) == {"gpu-0", "gpu-1", "gpu-2"})
        await h.settle(lambda: h.event_reasons().count("DeviceRejected") == 2)
        assert h.metric("dra_agent_rejected_devices_total", {"driver": DRIVER, "reason": "name"}) == 1
        assert h.metric("dra_agent_rejected_devices_total", {"driver": DRIVER, "reason": "taints"}) == 1
        await anyio.sleep(0.1)
        await h.publisher.reconcile()
        assert h.metric("dra_agent_rejected_devices_total", {"driver": DRIVER, "reason": "name"}) == 1


async def test_multiple_drivers_do_not_touch_each_other() -> None:
    async with harness() as h:
        await h.settle(lambda: len(h.devices()) == 4)
        other = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": "other-slice"},
            "spec": {
                "driver": "other.example.com",
                "nodeName": NODE,
                "pool": {"name": NODE, "generation": 0, "resourceSliceCount": 1},
                "devices": [],
            },
        }
        h.emu.create("resourceslices", other)
        await anyio.sleep(0.2)
        assert h.emu.get("resourceslices", "other-slice") is not None
        await eventually(lambda: len(h.devices()) == 4)


class BrokenOnce:
    """A taint policy that fails on its first call, like a bug would."""

    def __init__(self) -> None:
        self.calls = 0

    def taint_map(
        self, devices: Sequence[Device], support: ClusterTaintSupport
    ) -> dict[str, tuple[DeviceTaint, ...]]:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("boom")
        return {}


async def test_unexpected_errors_and_refusals_never_end_the_publisher(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="agent.kube.publisher")
    policy = BrokenOnce()
    async with harness(policy=policy, start=False) as h:
        h.emu.faults.fail_next(3, status=403, verbs={"create"}, resource="resourceslices")
        h.emu.faults.fail_next(2, status=429, verbs={"create"}, resource="resourceslices")
        async with anyio.create_task_group() as tg:
            tg.start_soon(h.publisher.run)
            await h.settle(lambda: len(h.devices()) == 4)
            tg.cancel_scope.cancel()
        assert policy.calls >= 2
        messages = [r.message for r in caplog.records]
        assert sum("unexpected error" in m for m in messages) == 1
        assert sum("refused a ResourceSlice write" in m for m in messages) == 1
        assert h.metric("dra_agent_api_retries_total", {"reason": "throttled"}) >= 1
        assert h.metric("dra_agent_api_retries_total", {"reason": "http_403"}) >= 1


async def test_on_135_tainted_pools_use_64_device_slices_and_one_write_per_change() -> None:
    clock = FakeClock()
    async with harness(version="1.35", devices=make_devices(130)) as h:
        await h.settle(lambda: len(h.devices()) == 130)
        assert sorted(len(s["spec"]["devices"]) for s in h.slices()) == [2, 64, 64]
        await anyio.sleep(0.1)
        h.emu.reset_writes()
        tracker = HealthTracker(h.inventory, clock, hold_seconds=60)
        await tracker.handle(dataclasses.replace(XID, device="gpu-70"))
        await h.settle(lambda: bool(h.taints("gpu-70")))
        await anyio.sleep(0.1)
        assert h.writes() == h.emu.writes[("update", "resourceslices")] == 1


async def test_publisher_runs_discovery_itself() -> None:
    async with harness(start=False) as h:
        h.kube._info = None  # as if built without discovery
        result = await h.publisher.reconcile()
        assert result.created == 1 and h.kube.slice_version == "v1"


async def test_two_changed_slices_bump_the_generation_of_the_whole_pool() -> None:
    """The Go slice controller's rule (``resourceslicecontroller.go``, ``syncPool``): the generation
    stays only when no slice is added and at most one changes. The agent used to rewrite just the
    two changed slices under the old generation."""
    clock = FakeClock()
    async with harness(devices=make_devices(300), start=False) as h:
        await h.publisher.reconcile()
        assert {s["spec"]["pool"]["generation"] for s in h.slices()} == {1}
        h.emu.reset_writes()
        tracker = HealthTracker(h.inventory, clock, hold_seconds=60)
        await tracker.handle(dataclasses.replace(XID, device="gpu-1"))
        await tracker.handle(dataclasses.replace(XID, device="gpu-200"))
        result = await h.publisher.reconcile()
        assert result.updated == 3 and result.writes == 3
        assert {s["spec"]["pool"]["generation"] for s in h.slices()} == {2}
        assert h.taints("gpu-1") and h.taints("gpu-200")
        await tracker.handle(dataclasses.replace(XID, device="gpu-2"))
        assert (await h.publisher.reconcile()).writes == 1  # one changed slice: generation kept
        assert {s["spec"]["pool"]["generation"] for s in h.slices()} == {2}


async def test_time_added_survives_updates_of_other_taints() -> None:
    clock = FakeClock()
    async with harness() as h:
        tracker = HealthTracker(h.inventory, clock, hold_seconds=60)
        await tracker.handle(XID)
        await h.settle(lambda: len(h.taints("gpu-1")) == 1)
        (first,) = h.taints("gpu-1")
        lost = HealthEvent("gpu-1", "gpu-lost", Severity.CRITICAL, kind=ConditionKind.STATE)
        await tracker.handle(lost)
        await h.settle(lambda: len(h.taints("gpu-1")) == 2)
        kept = [t for t in h.taints("gpu-1") if t["key"] == first["key"]]
        assert kept == [first]


async def test_recreated_node_gets_slices_owned_by_its_new_uid() -> None:
    async with harness() as h:
        await h.settle(lambda: len(h.devices()) == 4)
        old_uid = h.emu.get("nodes", NODE)["metadata"]["uid"]
        h.emu.delete("nodes", NODE)
        h.emu.collect_garbage()
        new_uid = h.emu.add_node(NODE)
        assert new_uid != old_uid

        def owned_by_new_node() -> bool:
            slices = h.slices()
            return len(slices) == 1 and slices[0]["metadata"]["ownerReferences"][0]["uid"] == new_uid

        await h.settle(owned_by_new_node, within=3)
        await anyio.sleep(0.2)
        assert owned_by_new_node()


@pytest.mark.parametrize("version", ["1.33", "1.34", "1.35", "1.36"])
async def test_each_api_version_publishes_taints_without_rewrites(version: str) -> None:
    async with harness(version=version) as h:
        tracker = HealthTracker(h.inventory, FakeClock(), hold_seconds=60)
        await tracker.handle(XID)
        await h.settle(lambda: len(h.devices()) == 4 and bool(h.taints("gpu-1")))
        await anyio.sleep(0.1)
        h.emu.reset_writes()
        assert (await h.publisher.reconcile()).writes == 0
        assert h.writes() == 0


async def test_kube_none_prints_exactly_what_is_published() -> None:
    """``--kube none`` prints `build_pool`'s slices: the publisher's chunking, owner, shape and taints."""
    clock = FakeClock()
    async with harness(version="1.35", devices=make_devices(130)) as h:
        tracker = HealthTracker(h.inventory, clock, hold_seconds=60)
        await tracker.handle(dataclasses.replace(XID, device="gpu-70"))
        await h.settle(lambda: len(h.devices()) == 130 and bool(h.taints("gpu-70")))
        devices = h.inventory.devices()
        support = ClusterTaintSupport(max_taints_per_device=16, none_effect=True)
        uid = h.emu.get("nodes", NODE)["metadata"]["uid"]
        printed = build_pool(
            driver=DRIVER,
            node_name=NODE,
            node_uid=uid,
            devices=devices,
            taints=TaintPolicy.default().taint_map(devices, support),
            support=support,
        )

        def comparable(obj: dict[str, Any]) -> tuple[Any, ...]:
            meta, spec = obj["metadata"], obj["spec"]
            for device in spec["devices"]:
                for taint in device.get("taints", []):
                    taint.pop("timeAdded", None)  # set by the API server
            return (
                obj["apiVersion"],
                meta["generateName"],
                meta["labels"],
                meta["ownerReferences"],
                spec["nodeName"],
                spec["pool"],
                spec["devices"],
            )

        published = sorted((comparable(s) for s in h.slices()), key=repr)
        assert sorted((comparable(s) for s in printed), key=repr) == published


async def test_an_api_server_restart_is_discovered_without_waiting_for_the_resync() -> None:
    """An upgrade restarts the API server: the broken watch makes the publisher look again."""
    async with harness(version="1.34") as h:
        await h.settle(lambda: len(h.devices()) == 4)
        h.emu.faults.outage(True)
        await h.settle(
            lambda: (
                h.metric("dra_agent_watch_restarts_total", {"resource": "resourceslices", "reason": "error"})
                >= 1
            )
        )
        h.emu.version = "1.35"
        h.emu.registry.release = "1.35"
        h.emu.faults.outage(False)

        def probed_again() -> bool:
            caps = h.publisher.capabilities
            return caps is not None and caps.none_effect

        await h.settle(probed_again, within=3)


async def test_on_136_the_gate_is_on_by_default_and_probed() -> None:
    """``DRADeviceTaints`` is beta and on by default from 1.36 (``pkg/features/kube_features.go``)."""
    async with harness(version="1.36", gates={}) as h:
        await h.settle(lambda: len(h.devices()) == 4)
        caps = h.publisher.capabilities
        assert caps is not None and caps.probed and caps.slice_taints and caps.none_effect
