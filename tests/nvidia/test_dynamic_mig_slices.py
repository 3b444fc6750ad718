"""Dynamic MIG as published: counter sets and placements, valid for each served release.

The rules are upstream ``pkg/apis/resource/validation/validation.go`` (``validateResourceSliceSpec``,
``validateCounterSet``, ``validateDeviceCounterConsumption``) of 1.34 and of 1.35/1.36, and the
limits of ``staging/src/k8s.io/api/resource/v1/types.go`` (``ResourceSliceMaxCounterSets`` 8,
``ResourceSliceMaxCountersPerCounterSet`` 32, ``ResourceSliceMaxDeviceCounterConsumptionsPerDevice``
2, ``ResourceSliceMaxDevicesWithAdvancedFeatures`` 64; in 1.34 ``ResourceSliceMaxSharedCounters``
32, ``ResourceSliceMaxCountersPerDevice`` 32, ``ResourceSliceMaxDeviceCountersPerSlice`` 1024).
The 1.35+ checks are the emulator's (`agent.emulator.slice_rules`); it does not check the 1.34
counter rules, so `_check_1_34` adds them here.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import anyio
import pytest
import yaml

from agent.app import create_backends
from agent.config import AgentConfig, parse_backend_spec
from agent.core.backend import BackendOptions, ClaimRef
from agent.core.errors import DeviceNotFoundError
from agent.core.model import Device
from agent.core.quantity import Quantity
from agent.emulator.slice_rules import resource_slice
from agent.emulator.validation import Rules
from agent.kube.pool import build_pool
from agent.kube.slices import semantic_device
from backends.fake import create_backend
from backends.fake.migtables import A100_40GB, A100_80GB, H100_80GB, layout_for
from backends.nvidia.migprofiles import MigLayout, dynamic_devices, gpu_counters
from tests.kube.harness import DRIVER, harness

JSON = dict[str, Any]
GATES = {"DRAPartitionableDevices": True, "DRADeviceTaints": True}


def fake_devices(profile: str = "nvidia-a100-8x") -> list[Device]:
    [backend] = create_backend(
        BackendOptions("node-1", None, {"profile": profile, "dynamic-mig": "true", "control": "off"})
    )
    return list(anyio.run(backend.discover))


def validate(slices: Sequence[JSON], release: str) -> list[str]:
    rules = Rules(release, GATES)
    problems = [f"{c}" for obj in slices for c in resource_slice(obj, None, rules)]
    counts = {obj["spec"]["pool"]["resourceSliceCount"] for obj in slices}
    if counts != {len(slices)}:
        problems.append(f"resourceSliceCount {counts} for {len(slices)} slices")
    if Rules(release, GATES).minor < 35:
        problems += [p for obj in slices for p in _check_1_34(obj)]
    else:
        defined = {s["name"] for obj in slices for s in obj["spec"].get("sharedCounters", [])}
        problems += [
            f"{d['name']} consumes from unknown counter set {c['counterSet']}"
            for obj in slices
            for d in obj["spec"].get("devices", [])
            for c in d.get("consumesCounters", [])
            if c["counterSet"] not in defined
        ]
    return problems


def _check_1_34(obj: JSON) -> list[str]:
    """The 1.34 counter rules the emulator leaves out (validation.go of release-1.34)."""
    spec = obj["spec"]
    sets = {s["name"]: set(s["counters"]) for s in spec.get("sharedCounters", [])}
    out: list[str] = []
    if sum(len(c) for c in sets.values()) > 32:
        out.append("the total number of shared counters must not exceed 32")
    device_total = 0
    for device in spec.get("devices", []):
        consumed = device.get("consumesCounters", [])
        total = sum(len(c["counters"]) for c in consumed)
        device_total += total
        if total > 32:
            out.append(f"{device['name']}: the total number of counters must not exceed 32")
        for c in consumed:
            if c["counterSet"] not in sets:
                out.append(f"{device['name']}: must reference a counterSet defined in the ResourceSlice")
            elif set(c["counters"]) - sets[c["counterSet"]]:
                out.append(f"{device['name']}: must reference a counter defined in the ResourceSlice")
    if device_total > 1024:
        out.append("the total number of counters in devices must not exceed 1024")
    if len(spec.get("devices", [])) > 128:
        out.append("too many devices")
    return out


def pool(devices: Sequence[Device], minor: int | None) -> list[JSON]:
    return build_pool(
        driver="gpu.nvidia.com",
        node_name="node-1",
        node_uid="",
        devices=devices,
        taints={},
        minor=minor,
        max_devices=128 if minor is not None and minor < 35 else 64,  # the 64 limit came with 1.35
    )


@pytest.mark.parametrize(("release", "minor"), [("1.34", 34), ("1.35", 35), ("1.36", 36)])
def test_fake_a100_pool_is_valid_for_each_release(release: str, minor: int) -> None:
    slices = pool(fake_devices(), minor)
    assert validate(slices, release) == []
    names = [d["name"] for obj in slices for d in obj["spec"].get("devices", [])]
    # 6 partitionable A100s (whole + 25 placements) and the profile's 6 static MIG devices.
    assert len(names) == 6 * 26 + 6
    assert "gpu-0-mig-3g40gb-9-4" in names and "gpu-6-mig-3g40gb-9-0" in names
    if minor >= 35:
        assert all(not ("sharedCounters" in o["spec"] and "devices" in o["spec"]) for o in slices)
    else:
        assert all(len(o["spec"].get("sharedCounters", [])) <= 1 for o in slices)


@pytest.mark.parametrize(
    "table", [A100_40GB, A100_80GB, H100_80GB], ids=["a100-40gb", "a100-80gb", "h100-80gb"]
)
def test_eight_gpus_of_each_model_split_within_the_limits(table: Mapping[int, Any]) -> None:
    layout = MigLayout(tuple(table.values()))
    devices: list[Device] = []
    for minor in range(8):
        whole = Device(
            name=f"gpu-{minor}", driver="gpu.nvidia.com", attributes={"type": "gpu"}, uuid=f"GPU-{minor}"
        )
        gpu, placements = dynamic_devices(whole, f"GPU-{minor}", minor, minor, layout)
        devices += [gpu, *(d for d, _ in placements)]
    for release, minor in (("1.34", 34), ("1.36", 36)):
        slices = pool(devices, minor)
        assert validate(slices, release) == []
    newest = pool(devices, None)
    assert len(newest[0]["spec"]["sharedCounters"]) == 8
    # Each GPU's devices stay in one slice: two GPUs (52 devices) per slice of at most 64.
    assert all(len(o["spec"].get("devices", [])) <= 64 for o in newest)


@pytest.mark.parametrize("release", ["1.34", "1.35", "1.36"])
def test_cli_kube_none_prints_a_valid_pool_for_each_release(tmp_path: Path, release: str) -> None:
    """``--print-for`` prints the pool as the publisher would write it to that release."""
    args = [
        sys.executable, "-m", "agent.cli", "run", "--kube", "none", "--node-name", "node-1",
        "--print-for", release,
        "--backend", "fake:profile=nvidia-a100-8x,dynamic-mig=true,control=off",
        "--serve-kubelet", "false", "--state-dir", str(tmp_path / "state"),
        "--metrics-address", "127.0.0.1:0",
    ]  # fmt: skip
    # Buffered stdout (no PYTHONUNBUFFERED): an unbuffered pipe write may be cut short by SIGTERM.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    log = (tmp_path / "stderr").open("w+")
    with subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log, env=env, text=True) as proc:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "---"
        # The printer writes each pool in one write: it is all in the pipe once '---' is.
        proc.send_signal(signal.SIGTERM)
        rest = proc.stdout.read()  # through the reader's buffer (communicate() would skip it)
        proc.wait(timeout=20)
    log.seek(0)
    assert proc.returncode == 0, log.read()
    items = next(iter(yaml.safe_load_all(rest)))["items"]
    assert validate(items, release) == []
    assert "sharedCounters" in items[0]["spec"]


# -- the scheduler's arithmetic over the published counters --------------------------------------


def first_fit(slices: Sequence[JSON], gpu: str, profiles: Sequence[str]) -> list[str | None]:
    """Allocate one claim per profile as the scheduler does: the first device, in slice order,
    whose profile matches and whose counters are all free (validation of the verified 1.36 shapes)."""
    totals = {
        (s["name"], k): Fraction(Quantity.parse(v["value"]).value)
        for obj in slices
        for s in obj["spec"].get("sharedCounters", [])
        for k, v in s["counters"].items()
    }
    used: dict[tuple[str, str], Fraction] = {}
    devices = [d for obj in slices for d in obj["spec"].get("devices", [])]
    taken: set[str] = set()
    out: list[str | None] = []
    for profile in profiles:
        chosen = None
        for device in devices:
            attrs = device.get("attributes", {})
            if device["name"] in taken or attrs.get("profile", {}).get("string") != profile:
                continue
            if not device["name"].startswith(f"{gpu}-"):
                continue
            need = [
                ((c["counterSet"], k), Fraction(Quantity.parse(v["value"]).value))
                for c in device.get("consumesCounters", [])
                for k, v in c["counters"].items()
            ]
            if all(used.get(key, 0) + value <= totals[key] for key, value in need):
                for key, value in need:
                    used[key] = used.get(key, 0) + value
                chosen = device["name"]
                taken.add(chosen)
                break
        out.append(chosen)
    return out


@pytest.mark.parametrize("minor", [34, 36])
def test_a_3g_and_two_2g_fit_on_one_a100_80gb_and_a_fourth_does_not(minor: int) -> None:
    slices = pool(fake_devices(), minor)
    got = first_fit(slices, "gpu-0", ["3g.40gb", "2g.20gb", "2g.20gb", "2g.20gb"])
    assert got[0] == "gpu-0-mig-3g40gb-9-4" and got[3] is None
    assert set(got[1:3]) == {"gpu-0-mig-2g20gb-14-0", "gpu-0-mig-2g20gb-14-2"}
    # Nothing else fits either: every memory slice is taken.
    assert first_fit(slices, "gpu-0", ["3g.40gb", "2g.20gb", "2g.20gb", "1g.10gb"])[-1] is None


def test_the_whole_gpu_and_a_placement_exclude_each_other() -> None:
    slices = pool(fake_devices(), None)
    whole = [d for obj in slices for d in obj["spec"].get("devices", []) if d["name"] == "gpu-0"]
    assert whole and whole[0]["attributes"]["type"] == {"string": "gpu"}
    consumed = whole[0]["consumesCounters"][0]["counters"]
    layout = layout_for("NVIDIA A100-SXM4-80GB")
    assert layout is not None
    assert set(consumed) == set(gpu_counters(layout))
    # Engines come from NVML's profile info: the 7g profile's 5 decoders, 1 JPEG, 1 OFA; no encoders.
    assert consumed["decoders"] == {"value": "5"} and "encoders" not in consumed


def test_placement_devices_carry_the_static_mig_attributes() -> None:
    devices = {d.name: d for d in fake_devices()}
    dynamic = devices["gpu-0-mig-1g10gbme-20-6"]
    static = devices["gpu-6-mig-3g40gb-9-0"]
    assert dynamic.attributes["profile"] == "1g.10gb+me" and dynamic.attributes["type"] == "mig"
    assert dynamic.attributes["parentUUID"] == devices["gpu-0"].uuid
    assert set(static.capacity) == set(dynamic.capacity)
    assert set(static.attributes) - set(dynamic.attributes) <= {"uuid", "index", "minor"}
    assert not static.consumes_counters  # the administrator's static layout publishes no counters


def test_a_changed_consumption_is_a_change_for_the_publisher() -> None:
    entry = {
        "name": "d",
        "consumesCounters": [{"counterSet": "s", "counters": {"memory-slice-0": {"value": "1"}}}],
    }
    same = {
        "name": "d",
        "consumesCounters": [{"counterSet": "s", "counters": {"memory-slice-0": {"value": 1}}}],
    }
    moved = {
        "name": "d",
        "consumesCounters": [{"counterSet": "s", "counters": {"memory-slice-1": {"value": "1"}}}],
    }
    assert semantic_device(entry) == semantic_device(same) != semantic_device(moved)


@pytest.mark.parametrize("version", ["1.34", "1.36"])
async def test_the_publisher_writes_the_pool_for_the_served_release_and_then_nothing(version: str) -> None:
    devices = [dataclasses.replace(d, driver=DRIVER) for d in await anyio.to_thread.run_sync(fake_devices)]
    gates = {"DRADeviceTaints": True, "DRAPartitionableDevices": True}
    async with harness(version=version, gates=gates, devices=devices) as h:
        await h.settle(lambda: len(h.devices()) == len(devices))
        slices = h.slices()
        assert validate(slices, version) == []
        assert sum(len(s["spec"].get("sharedCounters", [])) for s in slices) == 6
        h.emu.reset_writes()
        assert (await h.publisher.reconcile()).writes == 0
        # A GPU handed to an administrator's static layout: its counter set and placements go.
        static = [d for d in devices if not d.name.startswith("gpu-0")]
        h.inventory.set_devices(static)
        await h.settle(lambda: len(h.devices()) == len(static) and validate(h.slices(), version) == [])
        assert validate(h.slices(), version) == []
        assert "gpu-0-counters" not in {
            c["name"] for s in h.slices() for c in s["spec"].get("sharedCounters", [])
        }


# -- exclude-devices of a partitionable GPU ------------------------------------------------------


@pytest.mark.parametrize(("release", "minor"), [("1.34", 34), ("1.35", 35), ("1.36", 36)])
async def test_excluding_a_partitionable_gpu_excludes_its_placements(release: str, minor: int) -> None:
    """Excluding ``gpu-0`` drops its counter set, so its placements go too: upstream
    ``validateResourceSliceSpec`` (1.34: "must reference a counterSet defined in the
    ResourceSlice") and the 1.35+ pool rule refuse a device consuming an undefined counter set."""
    config = AgentConfig(
        backends=(parse_backend_spec("fake:profile=nvidia-a100-8x,dynamic-mig=true,exclude-devices=gpu-0"),)
    )
    (backend,) = create_backends(config)
    await backend.start()
    try:
        devices = list(await backend.discover())
        names = {d.name for d in devices}
        assert "gpu-1-mig-3g40gb-9-4" in names and not {n for n in names if n.startswith("gpu-0")}
        assert validate(pool(devices, minor), release) == []
        with pytest.raises(DeviceNotFoundError):
            await backend.prepare("gpu-0-mig-3g40gb-9-4", ClaimRef("ns", "c", "u"))
        assert not any(t.device.startswith("gpu-0") for t in await backend.telemetry())
    finally:
        await backend.stop()
