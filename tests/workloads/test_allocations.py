"""Per-workload metrics: ``dra_agent_device_allocation_info`` follows prepare, unprepare and restarts.

The kubelet side is played by a fake PodResources server (grpclib) on a real unix socket, speaking
the messages of k8s.io/kubelet/pkg/apis/podresources/v1/api.proto (List, ``dynamic_resources`` per
container, ClaimResource's driver/pool/device names since 1.31).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from grpclib.server import Server

from agent.claims.state.machine import DeviceState
from agent.core.inventory import Inventory
from agent.kubelet._protos.v1 import (
    ClaimResource,
    ContainerResources,
    DynamicResource,
    ListPodResourcesRequest,
    ListPodResourcesResponse,
    PodResources,
    PodResourcesListerBase,
)
from agent.kubelet.podresources import ContainerDevice, PodResourcesClient, PodResourcesUnavailable
from agent.kubelet.workloads import WorkloadAttribution
from agent.observe.allocations import Allocation, AllocationSeries
from agent.observe.metrics import Metrics
from tests.kubelet.fakes import DRIVER, NODE, FakeBackend, FakeClaimSource, make_claim, ref_of
from tests.kubelet.grpc_support import short_tmp_dir
from tests.observability.fakes import make_devices

UID = "0b7c6a2e-1111-4222-8333-444455556666"
POD = "trainer-0"


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    yield from short_tmp_dir()


class FakePodResources(PodResourcesListerBase):
    """Answers List with `pods`: (namespace, pod, container, claim namespace, claim, devices)."""

    def __init__(self) -> None:
        self.pods: list[tuple[str, str, str, str, str, Sequence[str]]] = []
        self.calls = 0

    async def list(self, list_pod_resources_request: ListPodResourcesRequest) -> ListPodResourcesResponse:
        self.calls += 1
        return ListPodResourcesResponse(
            pod_resources=[
                PodResources(
                    name=pod,
                    namespace=namespace,
                    containers=[
                        ContainerResources(
                            name=container,
                            dynamic_resources=[
                                DynamicResource(
                                    claim_name=claim,
                                    claim_namespace=claim_ns,
                                    claim_resources=[
                                        ClaimResource(driver_name=DRIVER, pool_name=NODE, device_name=d)
                                        for d in devices
                                    ],
                                )
                            ],
                        )
                    ],
                )
                for namespace, pod, container, claim_ns, claim, devices in self.pods
            ]
        )


@asynccontextmanager
async def serving(path: Path, *handlers: Any) -> AsyncIterator[None]:
    server = Server(list(handlers))
    await server.start(path=str(path))
    try:
        yield
    finally:
        server.close()
        await server.wait_closed()


async def eventually(condition: Callable[[], bool]) -> None:
    with anyio.fail_after(5):
        while not condition():  # noqa: ASYNC110 - polls series another task sets
            await anyio.sleep(0.01)


def series(metrics: Metrics) -> set[tuple[str, ...]]:
    """(device, UUID, namespace, pod, container, claim) of every allocation info series at 1."""
    found = set()
    for family in metrics.registry.collect():
        if family.name == "dra_agent_device_allocation_info":
            for s in family.samples:
                assert s.value == 1
                labels = s.labels
                found.add(
                    tuple(labels[k] for k in ("device", "UUID", "namespace", "pod", "container", "claim"))
                )
    return found


def reserved_claim(devices: Sequence[str] = ("gpu-0", "gpu-1")) -> dict[str, Any]:
    claim = make_claim(UID, name="train", devices=devices)
    claim["status"]["reservedFor"] = [{"resource": "pods", "name": POD, "uid": "pod-uid-1"}]
    return claim


class Rig:
    """A DeviceState whose listener is a running WorkloadAttribution."""

    def __init__(self, tmp_path: Path, source: FakeClaimSource, socket: Path) -> None:
        self.metrics = Metrics()
        inventory = Inventory(DRIVER)
        inventory.set_devices(make_devices(4))
        self.attribution = WorkloadAttribution(
            AllocationSeries(self.metrics),
            node_name=NODE,
            inventories={DRIVER: inventory},
            claims=source,
            pod_resources=PodResourcesClient(socket),
            refresh_seconds=0.05,
            settle_seconds=0.001,
        )
        self.state = DeviceState(
            DRIVER,
            FakeBackend(),
            source,
            node_name=NODE,
            cdi_root=tmp_path / "cdi",
            state_dir=tmp_path / "state",
            boot_id="boot-1",
            listener=self.attribution,
        )


async def test_client_lists_dynamic_resources_over_a_unix_socket(sock_dir: Path) -> None:
    fake = FakePodResources()
    fake.pods.append(("ml", POD, "main", "ml", "train", ("gpu-0", "gpu-1")))
    async with serving(sock_dir / "kubelet.sock", fake):
        devices = await PodResourcesClient(sock_dir / "kubelet.sock").list_devices()
    assert devices == [
        ContainerDevice("ml", POD, "main", "ml", "train", DRIVER, NODE, "gpu-0"),
        ContainerDevice("ml", POD, "main", "ml", "train", DRIVER, NODE, "gpu-1"),
    ]


async def test_client_reports_an_absent_socket_and_an_older_kubelet(sock_dir: Path) -> None:
    with pytest.raises(PodResourcesUnavailable, match="no PodResources socket"):
        await PodResourcesClient(sock_dir / "missing.sock").list_devices()
    async with serving(sock_dir / "old.sock", PodResourcesListerBase()):  # List not implemented
        with pytest.raises(PodResourcesUnavailable, match="does not serve PodResources v1 List"):
            await PodResourcesClient(sock_dir / "old.sock").list_devices()


async def test_series_appear_at_prepare_and_disappear_at_unprepare(tmp_path: Path, sock_dir: Path) -> None:
    claim = reserved_claim()
    claim["metadata"]["namespace"] = "ml"
    claim["status"]["reservedFor"][0]["name"] = POD
    fake = FakePodResources()
    rig = Rig(tmp_path, FakeClaimSource([claim]), sock_dir / "kubelet.sock")
    async with serving(sock_dir / "kubelet.sock", fake), anyio.create_task_group() as tg:
        tg.start_soon(rig.attribution.run)
        await rig.state.start()
        assert series(rig.metrics) == set()
        await rig.state.prepare([ref_of(claim)])
        # The container has not started: the kubelet does not list it yet, reservedFor names the pod.
        await eventually(
            lambda: (
                series(rig.metrics)
                == {
                    ("gpu-0", "GPU-00000000", "ml", POD, "", "train"),
                    ("gpu-1", "GPU-00000001", "ml", POD, "", "train"),
                }
            )
        )
        fake.pods.append(("ml", POD, "main", "ml", "train", ("gpu-0",)))
        fake.pods.append(("ml", POD, "sidecar", "ml", "train", ("gpu-1",)))
        await eventually(
            lambda: (
                series(rig.metrics)
                == {
                    ("gpu-0", "GPU-00000000", "ml", POD, "main", "train"),
                    ("gpu-1", "GPU-00000001", "ml", POD, "sidecar", "train"),
                }
            )
        )
        await rig.state.unprepare([ref_of(claim)])
        assert series(rig.metrics) == set()  # at once, not at the next refresh
        tg.cancel_scope.cancel()


async def test_series_come_back_after_a_restart_from_the_checkpoint(tmp_path: Path, sock_dir: Path) -> None:
    claim = reserved_claim()
    source = FakeClaimSource([claim])
    fake = FakePodResources()
    fake.pods.append(("default", POD, "main", "default", "train", ("gpu-0", "gpu-1")))
    expected = {
        ("gpu-0", "GPU-00000000", "default", POD, "main", "train"),
        ("gpu-1", "GPU-00000001", "default", POD, "main", "train"),
    }
    async with serving(sock_dir / "kubelet.sock", fake):
        first = Rig(tmp_path, source, sock_dir / "kubelet.sock")
        async with anyio.create_task_group() as tg:
            tg.start_soon(first.attribution.run)
            await first.state.start()
            await first.state.prepare([ref_of(claim)])
            await eventually(lambda: series(first.metrics) == expected)
            tg.cancel_scope.cancel()
        restarted = Rig(tmp_path, source, sock_dir / "kubelet.sock")  # a new process: new metrics
        async with anyio.create_task_group() as tg:
            tg.start_soon(restarted.attribution.run)
            await restarted.state.start()
            await eventually(lambda: series(restarted.metrics) == expected)
            tg.cancel_scope.cancel()


async def test_without_pod_resources_the_pod_comes_from_reserved_for_and_is_said_once(
    tmp_path: Path, sock_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    claim = reserved_claim(devices=("gpu-2",))
    rig = Rig(tmp_path, FakeClaimSource([claim]), sock_dir / "absent.sock")
    caplog.set_level(logging.INFO, logger="agent.kubelet.workloads")
    async with anyio.create_task_group() as tg:
        tg.start_soon(rig.attribution.run)
        await rig.state.start()
        await rig.state.prepare([ref_of(claim)])
        await eventually(
            lambda: series(rig.metrics) == {("gpu-2", "GPU-00000002", "default", POD, "", "train")}
        )
        for _ in range(3):  # more refreshes, still one log line
            await rig.attribution.refresh()
        tg.cancel_scope.cancel()
    said = [r for r in caplog.records if "PodResources unavailable" in r.getMessage()]
    assert len(said) == 1
    assert rig.state.claims.gets == 1  # type: ignore[attr-defined]  # the prepare's read served both


async def test_reserved_for_of_a_failed_prepare_is_not_kept(tmp_path: Path, sock_dir: Path) -> None:
    claim = reserved_claim(devices=("gpu-9",))  # not a device of the fake backend: the prepare fails
    rig = Rig(tmp_path, FakeClaimSource([claim]), sock_dir / "absent.sock")
    await rig.state.start()
    assert (await rig.state.prepare([ref_of(claim)]))[UID].error
    assert rig.attribution._reserved_for == {}


async def test_series_are_bounded_by_devices_not_history(tmp_path: Path, sock_dir: Path) -> None:
    rig = Rig(tmp_path, FakeClaimSource(), sock_dir / "absent.sock")
    await rig.state.start()
    async with anyio.create_task_group() as tg:
        tg.start_soon(rig.attribution.run)
        for i in range(20):
            claim = make_claim(f"{UID[:-2]}{i:02d}", name=f"c{i}", devices=(f"gpu-{i % 4}",))
            claim["status"]["reservedFor"] = [{"resource": "pods", "name": f"p{i}", "uid": f"u{i}"}]
            rig.state.claims.add(claim)  # type: ignore[attr-defined]
            await rig.state.prepare([ref_of(claim)])
            pod = f"p{i}"
            await eventually(lambda: any(s[3] == pod for s in series(rig.metrics)))  # noqa: B023
            await rig.state.unprepare([ref_of(claim)])
        assert series(rig.metrics) == set()
        tg.cancel_scope.cancel()


async def test_series_take_the_uuids_of_devices_discovered_after_the_claim(
    tmp_path: Path, sock_dir: Path
) -> None:
    """A claim restored before its backend discovered the devices gets UUIDs at the next refresh
    after discovery: only changed claims are republished, and a new inventory changes them all."""
    claim = reserved_claim(devices=("gpu-3",))
    rig = Rig(tmp_path, FakeClaimSource([claim]), sock_dir / "absent.sock")
    inventory = rig.attribution.inventories[DRIVER]
    inventory.set_devices([])  # not discovered yet
    await rig.state.start()
    await rig.state.prepare([ref_of(claim)])
    await rig.attribution.refresh()
    assert series(rig.metrics) == {("gpu-3", "", "default", POD, "", "train")}
    inventory.set_devices(make_devices(4))
    await rig.attribution.refresh()
    assert series(rig.metrics) == {("gpu-3", "GPU-00000003", "default", POD, "", "train")}


def test_a_claims_series_are_replaced_alone() -> None:
    """`AllocationSeries.set_claim` changes one claim's series: the others stay, none means gone."""
    metrics = Metrics()
    allocations = AllocationSeries(metrics)

    def allocation(device: str, pod: str, claim: str) -> Allocation:
        return Allocation(DRIVER, NODE, device, f"UUID-{device}", "", "default", pod, "", claim)

    allocations.set_claim(DRIVER, "u1", [allocation("gpu-0", "p1", "c1")])
    allocations.set_claim(DRIVER, "u2", [allocation("gpu-1", "p2", "c2")])
    allocations.set_claim(DRIVER, "u1", [allocation("gpu-0", "p1", "c1"), allocation("gpu-2", "p1", "c1")])
    assert series(metrics) == {
        ("gpu-0", "UUID-gpu-0", "default", "p1", "", "c1"),
        ("gpu-2", "UUID-gpu-2", "default", "p1", "", "c1"),
        ("gpu-1", "UUID-gpu-1", "default", "p2", "", "c2"),
    }
    allocations.set_claim(DRIVER, "u1", [allocation("gpu-2", "p3", "c1")])
    allocations.set_claim(DRIVER, "u2", ())
    assert series(metrics) == {("gpu-2", "UUID-gpu-2", "default", "p3", "", "c1")}
