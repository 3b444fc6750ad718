"""``resource.kubernetes.io/numaNode`` (standard from Kubernetes 1.37: staging/src/k8s.io/api/
resource/v1/types.go, StandardDeviceAttributePrefix) from the host's sysfs ``numa_node`` of each
GPU's PCI function, on the GPU and its MIG devices; none where the host reports -1 or nothing."""

from __future__ import annotations

from pathlib import Path

from agent.kube.slices import device_to_api
from backends.nvidia.discovery import NUMA_NODE, numa_node
from tests.fakes.libnvml import LibNvml
from tests.nvidia.conftest import BackendFactory


def set_numa(sysfs: Path, bus_id: str, value: str) -> None:
    (sysfs / "bus" / "pci" / "devices" / bus_id / "numa_node").write_text(value + "\n")


async def test_gpus_and_mig_devices_carry_their_numa_node(
    make_backend: BackendFactory, fake: LibNvml, sysfs: Path
) -> None:
    set_numa(sysfs, "0000:07:00.0", "0")  # the A100 in MIG mode
    set_numa(sysfs, "0000:18:00.0", "1")  # the H100
    set_numa(sysfs, "0000:3b:00.0", "-1")  # the L4: a host without NUMA information
    backend = make_backend(fake)
    await backend.start()
    try:
        devices = {d.name: d for d in await backend.discover()}
    finally:
        await backend.stop()
    by_bus: dict[str, set[object]] = {}
    for device in devices.values():
        by_bus.setdefault(device.pci_bus_id, set()).add(device.attributes.get(NUMA_NODE))
    assert by_bus["0000:07:00.0"] == {0}
    assert by_bus["0000:18:00.0"] == {1}
    assert by_bus["0000:3b:00.0"] == {None}
    h100 = next(d for d in devices.values() if d.pci_bus_id == "0000:18:00.0")
    assert device_to_api(h100)["attributes"][NUMA_NODE] == {"int": 1}


def test_numa_node_reads_only_what_sysfs_says(tmp_path: Path) -> None:
    device = tmp_path / "bus" / "pci" / "devices" / "0000:18:00.0"
    device.mkdir(parents=True)
    assert numa_node(tmp_path, "0000:18:00.0") is None  # no file
    (device / "numa_node").write_text("garbage\n")
    assert numa_node(tmp_path, "0000:18:00.0") is None
    (device / "numa_node").write_text("3\n")
    assert numa_node(tmp_path, "0000:18:00.0") == 3
    assert numa_node(tmp_path, "") is None
