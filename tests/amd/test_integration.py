"""The AMD backend with the rest of the agent: CEL selectors, matchAttribute, a mixed node, the CLI."""

from __future__ import annotations

import json
from collections.abc import Sequence

import anyio
import pytest

from agent.cli import main
from agent.config import AgentConfig, BackendSpec
from agent.core.backend import (
    BackendOptions,
    ClaimRef,
    ContainerEdits,
    DeviceTelemetry,
    HealthSink,
)
from agent.core.cel import match_attribute, matches
from agent.core.inventory import Inventory
from agent.core.model import Device
from agent.health.taints import ClusterTaintSupport, TaintPolicy
from agent.health.tracker import HealthTracker
from agent.kube.pool import build_pool
from tests.amd.conftest import MakeBackend
from tests.fakes.amd_standin import STATUS_DRIVER_NOT_LOADED, StandIn, mi300x
from tests.support.clock import FakeClock

SEED_SELECTOR = (
    'device.attributes["gpu.amd.com"].productName == "AMD_Instinct_MI300X_OAM" && '
    'device.attributes["gpu.amd.com"].partitionProfile == "spx_nps1"'
)
PARTITION_SELECTOR = 'device.attributes["gpu.amd.com"].type == "amdgpu-partition"'


async def discover(make_backend: MakeBackend, mode: str, count: int = 2) -> list[Device]:
    backend, _ = make_backend(mi300x(mode, count=count))
    await backend.start()
    devices = list(await backend.discover())
    await backend.stop()
    return devices


async def test_seed_selector_picks_spx_gpus_only(make_backend: MakeBackend) -> None:
    spx = await discover(make_backend, "spx_nps1")
    cpx = await discover(make_backend, "cpx_nps4")
    assert all(matches(SEED_SELECTOR, d) for d in spx)
    assert not any(matches(SEED_SELECTOR, d) for d in cpx)
    assert all(matches(PARTITION_SELECTOR, d) for d in cpx)
    assert not any(matches(PARTITION_SELECTOR, d) for d in spx)
    assert all(matches('device.driver == "gpu.amd.com"', d) for d in spx + cpx)


async def test_capacity_and_version_selectors(make_backend: MakeBackend) -> None:
    (gpu,) = await discover(make_backend, "spx_nps1", count=1)
    assert matches('device.capacity["gpu.amd.com"].memory.compareTo(quantity("190Gi")) > 0', gpu)
    # 196592Mi is a little less than 192Gi: AMD reports usable VRAM.
    assert not matches('device.capacity["gpu.amd.com"].memory.isGreaterThan(quantity("192Gi"))', gpu)
    assert matches('device.capacity["gpu.amd.com"].computeUnits == quantity("304")', gpu)
    assert matches('device.attributes["gpu.amd.com"].driverVersion.isGreaterThan(semver("6.8.0"))', gpu)
    assert matches('device.attributes["resource.kubernetes.io"].pciBusID == "0000:05:00.0"', gpu)


async def test_match_attribute_device_id_keeps_partitions_on_one_gpu(make_backend: MakeBackend) -> None:
    parts = await discover(make_backend, "cpx_nps4")
    same_gpu = [parts[0], parts[5]]
    other_gpus = [parts[0], parts[8]]
    assert match_attribute("gpu.amd.com/deviceID", same_gpu)
    assert not match_attribute("gpu.amd.com/deviceID", other_gpus)
    # Whole GPUs in SPX mode never share a deviceID.
    spx = await discover(make_backend, "spx_nps1")
    assert not match_attribute("gpu.amd.com/deviceID", spx)


class NvidiaNamedBackend:
    """A trivial backend under gpu.nvidia.com, standing in for the NVIDIA backend on a mixed node."""

    driver_name = "gpu.nvidia.com"

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def discover(self) -> Sequence[Device]:
        return [Device("gpu-0", self.driver_name, {"type": "gpu", "productName": "NVIDIA H100 80GB HBM3"})]

    async def monitor_health(self, sink: HealthSink) -> None:
        await anyio.sleep_forever()

    async def prepare(self, device: str, claim: ClaimRef) -> ContainerEdits:
        return ContainerEdits()

    async def unprepare(self, device: str, claim: ClaimRef) -> None:
        pass

    async def telemetry(self) -> Sequence[DeviceTelemetry]:
        return []


async def test_mixed_node_publishes_both_drivers_and_amd_fault_taints_amd_only(
    monkeypatch: pytest.MonkeyPatch, fake_clock: FakeClock, standin: StandIn
) -> None:
    import agent.app
    from agent.core.backend import load_backend_factory

    fake = standin.configure(mi300x("cpx_nps4", count=1))

    def factory(name: str) -> object:
        if name == "nvidia":
            return lambda options: [NvidiaNamedBackend()]
        return load_backend_factory(name)

    monkeypatch.setattr(agent.app, "load_backend_factory", factory)
    config = AgentConfig(
        node_name="node-1",
        backends=(
            BackendSpec("nvidia"),
            BackendSpec("amd", {"sysfs-root": "/dev/null", "event-timeout-ms": "20"}),
        ),
    )
    backends = agent.app.create_backends(config)
    assert [b.driver_name for b in backends] == ["gpu.nvidia.com", "gpu.amd.com"]
    pools: dict[str, list[dict[str, object]]] = {}
    amd = backends[1]
    for backend in backends:
        await backend.start()
        devices = await backend.discover()
        pools[backend.driver_name] = build_pool(
            driver=backend.driver_name, node_name="node-1", node_uid="uid", devices=devices, taints={}
        )
    nvidia_slice, amd_slice = pools["gpu.nvidia.com"][0], pools["gpu.amd.com"][0]
    assert nvidia_slice["spec"]["driver"] == "gpu.nvidia.com"  # type: ignore[index]
    assert amd_slice["spec"]["driver"] == "gpu.amd.com"  # type: ignore[index]
    amd_devices = amd_slice["spec"]["devices"]  # type: ignore[index]
    assert len(amd_devices) == 8
    assert amd_devices[0]["attributes"]["type"] == {"string": "amdgpu-partition"}
    assert amd_devices[0]["attributes"]["resource.kubernetes.io/pciBusID"] == {"string": "0000:05:00.0"}
    assert amd_devices[0]["capacity"]["memory"] == {"value": "24574Mi"}
    # The slice devices satisfy the same selectors users write.
    assert matches(PARTITION_SELECTOR, amd_devices[0], driver="gpu.amd.com")

    # A reset fed through the real amdsmi over the stand-in ends as taints on the AMD GPU's partitions only.
    inventory = Inventory(amd.driver_name)
    inventory.set_devices(await amd.discover())
    tracker = HealthTracker(inventory, fake_clock, hold_seconds=60)
    async with anyio.create_task_group() as tg:
        tg.start_soon(amd.monitor_health, tracker.handle)
        fake.push_event(4, "GPU_PRE_RESET")
        with anyio.fail_after(5):
            seen = inventory.version
            while not all(d.health.conditions for d in inventory.devices()):
                seen = await inventory.wait_changed(seen)
        tg.cancel_scope.cancel()
    taints = TaintPolicy.default().taint_map(inventory.devices(), ClusterTaintSupport())
    assert set(taints) == {d.name for d in inventory.devices()}
    assert all(any(t.key.endswith("gpu-reset") for t in ts) for ts in taints.values())
    tainted = build_pool(
        driver=amd.driver_name, node_name="node-1", node_uid="uid", devices=inventory.devices(), taints=taints
    )
    assert all(d.get("taints") for s in tainted for d in s["spec"]["devices"])
    for backend in backends:
        await backend.stop()


def test_cli_devices_backend_amd(standin: StandIn, capsys: pytest.CaptureFixture[str]) -> None:
    standin.configure(mi300x("cpx_nps4", count=1))
    assert main(["devices", "--backend", "amd:sysfs-root=/dev/null", "-o", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == [f"gpu-{1 + i}-{128 + i}" for i in range(8)]
    assert rows[0]["driver"] == "gpu.amd.com"
    assert rows[0]["attributes"]["partitionProfile"] == {"string": "cpx_nps4"}
    assert rows[0]["capacity"]["computeUnits"] == "38"


def test_cli_devices_table(standin: StandIn, capsys: pytest.CaptureFixture[str]) -> None:
    standin.configure(mi300x(count=1))
    assert main(["devices", "--backend", "amd:sysfs-root=/dev/null"]) == 0
    out = capsys.readouterr().out
    assert "gpu-1-128" in out and "AMD_Instinct_MI300X_OAM" in out and "196592Mi" in out and "amdgpu" in out


def test_cli_devices_driver_not_loaded(standin: StandIn, capsys: pytest.CaptureFixture[str]) -> None:
    standin.configure([], init_status=STATUS_DRIVER_NOT_LOADED)
    assert main(["devices", "--backend", "amd"]) == 1
    assert "modprobe amdgpu" in capsys.readouterr().err


def test_entry_point_creates_one_backend() -> None:
    from agent.core.backend import load_backend_factory

    (backend,) = load_backend_factory("amd")(BackendOptions("node-1", "gpu.amd.example.com"))
    assert backend.driver_name == "gpu.amd.example.com"
