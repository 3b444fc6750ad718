"""Discovery: names, attributes and capacities of GPUs and partitions, and degraded reads."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from agent.core.model import Device, Version
from agent.core.quantity import Quantity
from backends.amd.discovery import NUMA_NODE, PCI_BUS_ID, PCIE_ROOT, ProcessorInfo, Sysfs, build_devices
from tests.amd.conftest import MakeBackend, make_sysfs
from tests.fakes.amd_standin import STATUS_NOT_FOUND, mi210, mi250x, mi300x


async def discover(make_backend: MakeBackend, gpus: list, **kwargs: object) -> list[Device]:  # type: ignore[type-arg]
    backend, _ = make_backend(gpus, **kwargs)
    await backend.start()
    try:
        return list(await backend.discover())
    finally:
        await backend.stop()


async def test_mi300x_spx_nps1_gpu_attributes(make_backend: MakeBackend, tmp_path: Path) -> None:
    gpus = mi300x("spx_nps1")
    root = make_sysfs(tmp_path, gpus)
    backend, fake = make_backend(gpus, settings={"sysfs-root": str(root)})
    await backend.start()
    devices = list(await backend.discover())
    assert [d.name for d in devices] == [
        f"gpu-{c}-{r}" for c, r in zip(range(1, 9), range(128, 136), strict=True)
    ]
    first = devices[0]
    assert first.driver == "gpu.amd.com"
    assert dict(first.attributes) == {
        "type": "amdgpu",
        "cardIndex": 1,
        "renderIndex": 128,
        "deviceID": str(int(gpus[0].asic_serial, 16)),
        "family": "AI",
        "productName": "AMD_Instinct_MI300X_OAM",
        "driverVersion": Version("6.12.12"),
        "partitionProfile": "spx_nps1",
        "pciAddr": "0000:05:00.0",
        "numaNode": 0,
        NUMA_NODE: 0,  # the standard name (Kubernetes 1.37) beside AMD's own
        PCI_BUS_ID: "0000:05:00.0",
        PCIE_ROOT: "pci0000:00",
    }
    assert dict(first.capacity) == {
        "memory": Quantity.binary(196592 * 1024 * 1024),
        "computeUnits": Quantity.parse(304),
        "simdUnits": Quantity.parse(1216),
    }
    assert first.capacity["memory"].canonical() == "196592Mi"
    assert (first.uuid, first.pci_bus_id, first.product, first.parent) == (
        fake.uuid(0),
        "0000:05:00.0",
        "AMD_Instinct_MI300X_OAM",
        "",
    )
    assert devices[7].attributes["numaNode"] == 1
    assert devices[7].attributes[PCIE_ROOT] == "pci0000:c0"
    # Distinct GPUs have distinct deviceIDs.
    assert len({d.attributes["deviceID"] for d in devices}) == 8


async def test_mi300x_cpx_nps4_publishes_eight_partitions_per_gpu(make_backend: MakeBackend) -> None:
    gpus = mi300x("cpx_nps4")
    devices = await discover(make_backend, gpus)
    assert len(devices) == 64
    assert {d.attributes["type"] for d in devices} == {"amdgpu-partition"}
    by_gpu: dict[object, list[Device]] = {}
    for d in devices:
        by_gpu.setdefault(d.attributes["parentPciAddr"], []).append(d)
    assert len(by_gpu) == 8
    assert all(len(parts) == 8 for parts in by_gpu.values())
    part = devices[9]  # second GPU, second partition
    assert part.name == "gpu-10-137"
    assert part.attributes["cardIndex"] == 10
    assert part.attributes["renderIndex"] == 137
    assert part.attributes["pciAddr"] == "0000:26:00.1"
    assert part.attributes["parentPciAddr"] == "0000:26:00.0"
    assert part.attributes[PCI_BUS_ID] == "0000:26:00.0"
    parent_id = str(int(gpus[8].asic_serial, 16))
    assert part.attributes["deviceID"] == parent_id
    assert part.attributes["parentDeviceID"] == parent_id
    assert part.attributes["partitionProfile"] == "cpx_nps4"
    assert part.capacity["computeUnits"] == Quantity.parse(38)
    assert part.capacity["memory"].canonical() == "24574Mi"
    assert part.capacity["simdUnits"] == Quantity.parse(152)
    assert part.parent == "gpu-9-136"
    # The GPU itself is not published in a multi-partition mode.
    assert not any(d.attributes["type"] == "amdgpu" for d in devices)


async def test_mi250x_gcds_are_gpus_without_partition_profile(make_backend: MakeBackend) -> None:
    devices = await discover(make_backend, mi250x())
    assert len(devices) == 8
    d = devices[0]
    assert d.attributes["type"] == "amdgpu"
    assert "partitionProfile" not in d.attributes
    assert d.attributes["productName"] == "AMD_Instinct_MI250X"
    # A four-part amdgpu version keeps the device valid: the fourth part becomes build metadata.
    assert d.attributes["driverVersion"] == Version("6.7.0+60103")
    assert d.capacity["computeUnits"] == Quantity.parse(110)
    assert d.capacity["simdUnits"] == Quantity.parse(440)


async def test_mi210_inbox_driver_version_and_board_name_degrade(
    make_backend: MakeBackend, caplog: pytest.LogCaptureFixture
) -> None:
    """In-box amdgpu: amdsmi answers the kernel release (amd_smi_utils.cc
    smi_amdgpu_get_driver_version reads /proc/version), which is not amdgpu's version (issue 30 #6)."""
    caplog.set_level(logging.INFO, "agent.backends.amd")
    devices = await discover(make_backend, mi210())
    assert len(devices) == 4
    d = devices[0]
    assert "driverVersion" not in d.attributes
    assert d.attributes["productName"] == "AMD_Instinct_MI210"  # market name when FRU has none
    assert "in-box amdgpu" in caplog.text


async def test_unparseable_driver_version_is_dropped(make_backend: MakeBackend) -> None:
    devices = await discover(make_backend, mi300x(count=1, driver_version="unknown-build"))
    assert "driverVersion" not in devices[0].attributes


async def test_unsupported_calls_degrade_attributes_not_the_device(make_backend: MakeBackend) -> None:
    gpus = mi300x(count=1)
    gpus[0].unsupported = {
        "amdsmi_get_gpu_board_info",
        "amdsmi_get_gpu_vram_info",
        "amdsmi_topo_get_numa_node_number",
        "amdsmi_get_gpu_memory_partition",
        "amdsmi_get_gpu_device_uuid",
        "amdsmi_get_gpu_driver_info",
    }
    devices = await discover(make_backend, gpus)
    d = devices[0]
    assert d.name == "gpu-1-128"
    assert "memory" not in d.capacity
    assert "numaNode" not in d.attributes
    assert "driverVersion" not in d.attributes
    assert d.attributes["partitionProfile"] == "spx"
    assert d.attributes["productName"] == "AMD_Instinct_MI300X"
    assert d.uuid == ""


async def test_asic_info_unsupported_keeps_device_with_fallback_id(make_backend: MakeBackend) -> None:
    gpus = mi300x(count=1)
    gpus[0].unsupported = {"amdsmi_get_gpu_asic_info", "amdsmi_get_gpu_board_info"}
    backend, fake = make_backend(gpus)
    await backend.start()
    d = (await backend.discover())[0]
    assert d.attributes["deviceID"] == fake.uuid(0)
    assert "computeUnits" not in d.capacity
    assert "family" not in d.attributes
    assert "productName" not in d.attributes


async def test_gpu_whose_bdf_fails_is_skipped(make_backend: MakeBackend) -> None:
    gpus = mi300x(count=2)
    gpus[1].lost = True
    gpus[1].lost_code = STATUS_NOT_FOUND
    devices = await discover(make_backend, gpus)
    assert [d.name for d in devices] == ["gpu-1-128"]


async def test_old_amdsmi_without_enumeration_info_uses_kfd_topology(
    make_backend: MakeBackend, tmp_path: Path
) -> None:
    gpus = mi300x("cpx_nps4", count=1)
    for g in gpus:
        g.unsupported = {"amdsmi_get_gpu_enumeration_info"}
    root = make_sysfs(tmp_path, gpus)
    devices = await discover(make_backend, gpus, settings={"sysfs-root": str(root)})
    assert [d.name for d in devices] == [f"gpu-{1 + i}-{128 + i}" for i in range(8)]


async def test_no_drm_indices_skips_the_gpu(make_backend: MakeBackend) -> None:
    gpus = mi300x(count=1)
    gpus[0].unsupported = {"amdsmi_get_gpu_enumeration_info"}
    assert await discover(make_backend, gpus) == []


async def test_no_gpus_is_empty_and_logged_once(
    make_backend: MakeBackend, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "agent.backends.amd")
    backend, _ = make_backend([])
    await backend.start()
    assert list(await backend.discover()) == []
    assert list(await backend.discover()) == []
    await backend.stop()
    assert caplog.text.count("sees no AMD GPUs") == 1


async def test_driver_name_override(make_backend: MakeBackend) -> None:
    devices = await discover(make_backend, mi210(1), driver="gpu.example.org")
    assert devices[0].driver == "gpu.example.org"


def test_sysfs_tolerates_missing_files(tmp_path: Path) -> None:
    sysfs = Sysfs(str(tmp_path))
    assert sysfs.pcie_root("0000:05:00.0") is None
    assert sysfs.kfd_properties(3) == {}
    assert sysfs.card_of_render(128) is None


def test_simd_fallback_by_gfx_and_unknown_family() -> None:
    base = ProcessorInfo(handle=object(), bdf="0000:03:00.0", card=1, render=128, compute_units=48)
    rdna = build_devices([ProcessorInfo(**{**base.__dict__, "gfx_version": "gfx1100"})], "gpu.amd.com")
    assert rdna.devices[0].attributes["family"] == "GC_11_0_0"
    odd = build_devices([ProcessorInfo(**{**base.__dict__, "gfx_version": "gfx805"})], "gpu.amd.com")
    assert "family" not in odd.devices[0].attributes
    assert odd.devices[0].attributes["deviceID"] == "0000:03:00.0"


def test_duplicate_drm_nodes_keep_the_first() -> None:
    a = ProcessorInfo(handle=object(), bdf="0000:03:00.0", card=1, render=128)
    b = ProcessorInfo(handle=object(), bdf="0000:04:00.0", card=1, render=128)
    assert [d.pci_bus_id for d in build_devices([a, b], "gpu.amd.com").devices] == ["0000:03:00.0"]
