"""Shareable devices on an API server with ``DRAConsumableCapacity`` off.

Upstream ``pkg/features/kube_features.go``: the gate is alpha and off in 1.34 and 1.35, beta and
on by default from 1.36. With it off, ``dropDisabledDRAConsumableCapacityFields``
(``pkg/registry/resource/resourceslice/strategy.go``) drops every device's
``allowMultipleAllocations`` and each capacity's ``requestPolicy`` unless the old slice already
uses one of them (``draConsumableCapacityFeatureInUse``), and the scheduler allocates the devices
exclusively. The publisher asks with a dry-run create, as for dropped taints and counters,
publishes the devices without the sharing fields (so its slices match what is stored and are not
rewritten at each resync), and reports them as unpublishable shares naming the gate.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from agent.core.model import Device, RequestPolicy
from agent.core.quantity import Quantity
from agent.emulator import KubeApiEmulator
from agent.kube.publisher import _shares_dropped
from tests.kube.harness import DRIVER, harness

GATE = "DRAConsumableCapacity"


def shareable(count: int = 2) -> list[Device]:
    policy = RequestPolicy(
        Quantity.parse("1Gi"), Quantity.parse("1Gi"), Quantity.parse("80Gi"), Quantity.parse("1Gi")
    )
    return [
        Device(
            f"gpu-{i}",
            DRIVER,
            {"type": "gpu"},
            capacity={"memory": Quantity.parse("80Gi")},
            allow_multiple_allocations=True,
            request_policies={"memory": policy},
        )
        for i in range(count)
    ]


async def test_gate_off_publishes_exclusive_devices_reports_them_and_stops_rewriting(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="agent.kube.publisher")
    readiness: list[tuple[bool, str]] = []

    def on_published(ok: bool, detail: str) -> None:
        readiness.append((ok, detail))

    async with harness(
        version="1.36",
        gates={GATE: False},
        devices=shareable(),
        resync_seconds=0.2,
        on_published=on_published,
    ) as h:
        await h.settle(lambda: set(h.devices()) == {"gpu-0", "gpu-1"})
        assert not any(d.get("allowMultipleAllocations") for d in h.devices().values())
        assert not any(c.get("requestPolicy") for d in h.devices().values() for c in d["capacity"].values())
        labels = {"driver": DRIVER}
        await h.settle(lambda: h.metric("dra_agent_unpublishable_devices", labels) == 2)
        await h.settle(lambda: bool(readiness) and GATE in readiness[-1][1])
        assert readiness[-1][0] and "2 device(s)" in readiness[-1][1]
        errors = {"driver": DRIVER, "reason": "shares_unsupported"}
        assert h.metric("dra_agent_publish_errors_total", errors) == 1
        await h.settle(lambda: "DeviceSharesUnsupported" in h.event_reasons())

        # No rewriting: resyncs probe again (dry-run creates, nothing stored) and write nothing.
        await h.resyncs_write_nothing()
        assert h.event_reasons().count("DeviceSharesUnsupported") == 1
        assert h.metric("dra_agent_publish_errors_total", errors) == 1
        assert sum(f"enable the {GATE}" in r.getMessage() for r in caplog.records) == 1

        # The gate turned on: the next resync publishes the devices shareable again.
        h.emu.set_feature_gate(GATE, True)
        await h.settle(lambda: all(d.get("allowMultipleAllocations") for d in h.devices().values()))
        await h.settle(lambda: h.metric("dra_agent_unpublishable_devices", labels) == 0)
        await h.settle(lambda: readiness[-1] == (True, ""))


async def test_gate_turned_off_later_publishes_the_devices_exclusive() -> None:
    """Our slices keep the fields on update (they are in use), so only the probe's create shows the
    gate off; the devices lose their sharing fields at the next resync."""
    async with harness(version="1.36", gates={GATE: True}, devices=shareable(1), resync_seconds=0.2) as h:
        await h.settle(lambda: bool(h.devices().get("gpu-0", {}).get("allowMultipleAllocations")))
        h.emu.set_feature_gate(GATE, False)
        await h.settle(lambda: not h.devices()["gpu-0"].get("allowMultipleAllocations"))
        # The gauge is set once the write's answer is back, after the emulator stored the slice.
        await h.settle(lambda: h.metric("dra_agent_unpublishable_devices", {"driver": DRIVER}) == 1)


async def test_a_refused_probe_falls_back_to_what_the_writes_show(caplog: pytest.LogCaptureFixture) -> None:
    """The probes refused (403): the pool is written shareable, the answer lacks the fields, and the
    next pass publishes the devices exclusive."""
    caplog.set_level(logging.INFO, logger="agent.kube.publisher")
    async with harness(version="1.36", gates={GATE: False}, devices=shareable(1), start=False) as h:
        h.emu.faults.fail_next(2, 403, verbs=["create"], resource="resourceslices")
        await h.publisher.reconcile()
        assert h.publisher.capabilities is not None and h.publisher.capabilities.shares is False
        assert any("dropped allowMultipleAllocations" in r.getMessage() for r in caplog.records)
        await h.publisher.reconcile()
        assert not h.devices()["gpu-0"].get("allowMultipleAllocations")
        assert h.metric("dra_agent_unpublishable_devices", {"driver": DRIVER}) == 1


def test_shares_dropped_from_a_written_slice_are_noticed() -> None:
    sent: dict[str, Any] = {"spec": {"devices": [{"name": "gpu-0", "allowMultipleAllocations": True}]}}
    assert _shares_dropped([(sent, {"spec": {"devices": [{"name": "gpu-0"}]}})]) == "gpu-0"
    assert _shares_dropped([(sent, sent)]) == ""
    assert _shares_dropped([(sent, {})]) == ""


def _slice(name: str, device: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": DRIVER,
            "nodeName": "node-1",
            "pool": {"name": name, "generation": 1, "resourceSliceCount": 1},
            "devices": [device],
        },
    }


POLICY = {"default": "1Gi", "validRange": {"min": "1Gi", "max": "80Gi", "step": "1Gi"}}


async def test_emulator_drops_the_fields_unless_the_old_slice_uses_them() -> None:
    """``draConsumableCapacityFeatureInUse``: an old slice with either field set (allowMultipleAllocations,
    even false, or a requestPolicy) keeps both on update; a create with the gate off drops both."""
    async with KubeApiEmulator(version="1.36", feature_gates={GATE: True}) as emu:
        emu.add_node("node-1")
        shared = {
            "name": "gpu-0",
            "allowMultipleAllocations": True,
            "capacity": {"memory": {"value": "80Gi"}},
        }
        emu.create("resourceslices", _slice("a", shared))
        emu.set_feature_gate(GATE, False)
        created = emu.create(
            "resourceslices",
            _slice("b", {**shared, "capacity": {"memory": {"value": "80Gi", "requestPolicy": POLICY}}}),
        )
        (dev,) = created["spec"]["devices"]
        assert "allowMultipleAllocations" not in dev and "requestPolicy" not in dev["capacity"]["memory"]

        # In use through allowMultipleAllocations: an added requestPolicy is kept.
        old = emu.get("resourceslices", "a")
        assert old is not None
        old["spec"]["devices"][0]["capacity"]["memory"]["requestPolicy"] = POLICY
        (dev,) = emu.update("resourceslices", old)["spec"]["devices"]
        assert dev["allowMultipleAllocations"] is True and dev["capacity"]["memory"]["requestPolicy"]

        # In use through an explicit false (the field is set): the update may turn it true.
        emu.set_feature_gate(GATE, True)
        emu.create("resourceslices", _slice("c", {**shared, "allowMultipleAllocations": False}))
        emu.set_feature_gate(GATE, False)
        old = emu.get("resourceslices", "c")
        assert old is not None and old["spec"]["devices"][0]["allowMultipleAllocations"] is False
        old["spec"]["devices"][0]["allowMultipleAllocations"] = True
        (dev,) = emu.update("resourceslices", old)["spec"]["devices"]
        assert dev["allowMultipleAllocations"] is True, "a set field in the old slice counts as in use"
