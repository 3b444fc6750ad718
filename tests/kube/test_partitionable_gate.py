"""Partitionable devices (dynamic MIG) on an API server with ``DRAPartitionableDevices`` off.

Upstream ``pkg/features/kube_features.go``: the gate is alpha and off from 1.33, beta and on by
default from 1.36. With it off, ``dropDisabledDRAPartitionableDevicesFields``
(``pkg/registry/resource/resourceslice/strategy.go``) drops ``sharedCounters`` and every device's
``consumesCounters`` unless the old slice already uses such a field. The publisher asks with a
dry-run create, publishes the whole GPUs only, reports the placements as unpublishable naming the
gate, and does not rewrite its slices at each resync.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from agent.core.model import Device
from agent.kube.publisher import _counters_dropped
from backends.fake.migtables import A100_80GB
from backends.nvidia.migprofiles import MigLayout, dynamic_devices
from tests.kube.harness import DRIVER, harness

GATE = "DRAPartitionableDevices"
PLACEMENTS_PER_GPU = 25


def dynamic_gpus(count: int = 2) -> list[Device]:
    """`count` partitionable A100-80GB: the whole GPU and its 25 MIG placements each."""
    devices: list[Device] = []
    for minor in range(count):
        whole = Device(f"gpu-{minor}", DRIVER, {"type": "gpu"}, uuid=f"GPU-{minor}")
        gpu, placements = dynamic_devices(
            whole, f"GPU-{minor}", minor, minor, MigLayout(tuple(A100_80GB.values()))
        )
        devices += [gpu, *(d for d, _ in placements)]
    return devices


async def test_gate_off_publishes_whole_gpus_and_reports_the_placements(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="agent.kube.publisher")
    readiness: list[tuple[bool, str]] = []

    def on_published(ok: bool, detail: str) -> None:
        readiness.append((ok, detail))

    gates = {GATE: False, "DRADeviceTaints": True}
    async with harness(
        version="1.36", gates=gates, devices=dynamic_gpus(), resync_seconds=0.2, on_published=on_published
    ) as h:
        await h.settle(lambda: set(h.devices()) == {"gpu-0", "gpu-1"})
        assert not any(s["spec"].get("sharedCounters") for s in h.slices())
        assert not any(d.get("consumesCounters") for d in h.devices().values())
        labels = {"driver": DRIVER}
        await h.settle(lambda: h.metric("dra_agent_unpublishable_devices", labels) == 2 * PLACEMENTS_PER_GPU)
        assert readiness[-1][0] and GATE in readiness[-1][1] and "50 device(s)" in readiness[-1][1]
        errors = {"driver": DRIVER, "reason": "counters_unsupported"}
        assert h.metric("dra_agent_publish_errors_total", errors) == 1
        await h.settle(lambda: "DeviceCountersUnsupported" in h.event_reasons())

        # No rewriting: resyncs probe again (dry-run creates, nothing stored) and write nothing.
        await h.resyncs_write_nothing()
        assert h.event_reasons().count("DeviceCountersUnsupported") == 1
        assert h.metric("dra_agent_publish_errors_total", errors) == 1
        assert sum(f"enable the {GATE}" in r.getMessage() for r in caplog.records) == 1

        # The gate turned on: the next resync publishes the placements with their counters.
        h.emu.set_feature_gate(GATE, True)
        await h.settle(lambda: len(h.devices()) == 2 * (1 + PLACEMENTS_PER_GPU))
        assert any(s["spec"].get("sharedCounters") for s in h.slices())
        await h.settle(lambda: h.metric("dra_agent_unpublishable_devices", labels) == 0)
        await h.settle(lambda: readiness[-1] == (True, ""))


async def test_gate_turned_off_later_withdraws_the_placements() -> None:
    """Our slices keep their counters on update (they are in use), so only the probe's create shows
    the gate off; the placements are withdrawn at the next resync."""
    gates = {GATE: True, "DRADeviceTaints": True}
    async with harness(version="1.36", gates=gates, devices=dynamic_gpus(1), resync_seconds=0.2) as h:
        await h.settle(lambda: len(h.devices()) == 1 + PLACEMENTS_PER_GPU)
        h.emu.set_feature_gate(GATE, False)
        await h.settle(lambda: set(h.devices()) == {"gpu-0"})
        assert not h.devices()["gpu-0"].get("consumesCounters")
        # The gauge is set once the write's answer is back, after the emulator stored the slice.
        await h.settle(
            lambda: h.metric("dra_agent_unpublishable_devices", {"driver": DRIVER}) == PLACEMENTS_PER_GPU
        )


def test_counters_dropped_from_a_written_slice_are_noticed() -> None:
    """The fallback when the probe cannot run: the answer of a real write lacks what we sent."""
    counters = {"name": "gpu-0-counters", "counters": {"memory-slice-0": {"value": "1"}}}
    consuming = {"name": "gpu-0-mig-1g10gb-19-0", "consumesCounters": [counters]}
    sets: dict[str, Any] = {"spec": {"sharedCounters": [counters]}}
    devices: dict[str, Any] = {"spec": {"devices": [{"name": "gpu-1"}, consuming]}}
    assert _counters_dropped([(sets, {"spec": {}})]) == "gpu-0-counters"
    assert _counters_dropped(
        [(devices, {"spec": {"devices": [{"name": "gpu-1"}, {"name": consuming["name"]}]}})]
    ) == ("gpu-0-mig-1g10gb-19-0")
    assert _counters_dropped([(sets, sets), (devices, devices)]) == ""
    assert _counters_dropped([(devices, {})]) == ""  # no answer body: nothing to compare


async def test_a_refused_probe_falls_back_to_what_the_writes_show(caplog: pytest.LogCaptureFixture) -> None:
    """Both probes refused (403): the pool is written with counters, the answers lack them, and the
    next pass publishes the whole GPU only."""
    caplog.set_level(logging.INFO, logger="agent.kube.publisher")
    gates = {GATE: False, "DRADeviceTaints": True}
    async with harness(version="1.36", gates=gates, devices=dynamic_gpus(1), start=False) as h:
        h.emu.faults.fail_next(2, 403, verbs=["create"], resource="resourceslices")
        await h.publisher.reconcile()
        assert h.publisher.capabilities is not None and h.publisher.capabilities.counters is False
        assert any("dropped the shared counters" in r.getMessage() for r in caplog.records)
        await h.publisher.reconcile()
        assert set(h.devices()) == {"gpu-0"}
        assert h.metric("dra_agent_unpublishable_devices", {"driver": DRIVER}) == PLACEMENTS_PER_GPU
