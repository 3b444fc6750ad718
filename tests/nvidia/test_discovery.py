"""Discovery: names, every attribute and capacity, MIG, degradation, lost GPUs."""

from __future__ import annotations

import logging
from pathlib import Path

import pynvml as real
import pytest

from agent.core.model import Device, Version
from agent.core.quantity import Quantity
from agent.kube.slices import device_to_api
from backends.nvidia.discovery import mig_device_name, mig_profile_name, normalize_bus_id, pcie_root
from tests.fakes.libnvml import MIB, FakeMig, LibNvml, a100_mig, b200_mig, h100, l4
from tests.nvidia.conftest import BackendFactory, build_sysfs

A100_UUID = "GPU-a1000000-0000-0000-0000-000000000000"


async def discover(make_backend: BackendFactory, fake: LibNvml, **settings: str) -> dict[str, Device]:
    backend = make_backend(fake, **settings)
    await backend.start()
    try:
        return {d.name: d for d in await backend.discover()}
    finally:
        await backend.stop()


async def test_names_follow_nvidia_driver(make_backend: BackendFactory, fake: LibNvml) -> None:
    devices = await discover(make_backend, fake)
    assert sorted(devices) == [
        "gpu-0-mig-1g10gb-19-2",
        "gpu-0-mig-1g10gb-19-3",
        "gpu-0-mig-2g20gb-14-0",
        "gpu-0-mig-3g40gb-9-4",
        "gpu-1-mig-7g80gb-0-0",
        "gpu-2",
        "gpu-3",
    ]
    # A GPU in MIG mode publishes its MIG devices, not itself.
    assert "gpu-0" not in devices and "gpu-1" not in devices


async def test_full_gpu_attributes_and_capacity(make_backend: BackendFactory, fake: LibNvml) -> None:
    devices = await discover(make_backend, fake)
    gpu = devices["gpu-2"]
    assert gpu.driver == "gpu.nvidia.com"
    assert dict(gpu.attributes) == {
        "type": "gpu",
        "uuid": "GPU-h1000002-0000-0000-0000-000000000000",
        "index": 2,
        "minor": 2,
        "productName": "NVIDIA H100 80GB HBM3",
        "brand": "Nvidia",
        "architecture": "Hopper",
        "cudaComputeCapability": Version("9.0.0"),
        "driverVersion": Version("550.54.15"),
        "cudaDriverVersion": Version("12.4.0"),
        "resource.kubernetes.io/pciBusID": "0000:18:00.0",
        "pcieBusID": "0000:18:00.0",
        "resource.kubernetes.io/pcieRoot": "pci0000:10",
    }
    assert dict(gpu.capacity) == {"memory": Quantity.binary(81559 * MIB)}
    assert gpu.uuid == "GPU-h1000002-0000-0000-0000-000000000000"
    assert gpu.pci_bus_id == "0000:18:00.0"
    assert gpu.product == "NVIDIA H100 80GB HBM3"
    assert gpu.parent == ""


async def test_l4_without_mig_support_publishes_itself(make_backend: BackendFactory, fake: LibNvml) -> None:
    devices = await discover(make_backend, fake)
    l4_device = devices["gpu-3"]
    assert l4_device.attributes["architecture"] == "Ada Lovelace"
    assert l4_device.attributes["cudaComputeCapability"] == Version("8.9.0")
    # NVML's upper-case bus id becomes the lower-case Linux form.
    assert l4_device.attributes["resource.kubernetes.io/pciBusID"] == "0000:3b:00.0"


async def test_mig_attributes_and_capacities(make_backend: BackendFactory, fake: LibNvml) -> None:
    devices = await discover(make_backend, fake)
    mig = devices["gpu-0-mig-3g40gb-9-4"]
    attrs = dict(mig.attributes)
    assert attrs == {
        "type": "mig",
        "uuid": "MIG-a1000000-0001-0000-0000-000000000000",
        "parentUUID": A100_UUID,
        "index": 0,
        "minor": 0,
        "profile": "3g.40gb",
        "migProfile": "3g.40gb",
        "productName": "NVIDIA A100-SXM4-80GB",
        "brand": "Nvidia",
        "architecture": "Ampere",
        "cudaComputeCapability": Version("8.0.0"),
        "driverVersion": Version("550.54.15"),
        "cudaDriverVersion": Version("12.4.0"),
        "resource.kubernetes.io/pciBusID": "0000:07:00.0",
        "pcieBusID": "0000:07:00.0",
        "resource.kubernetes.io/pcieRoot": "pci0000:00",
    }
    assert {k: v.canonical() for k, v in mig.capacity.items()} == {
        "multiprocessors": "42",
        "copyEngines": "3",
        "decoders": "2",
        "encoders": "0",
        "jpegEngines": "0",
        "ofaEngines": "0",
        "memory": "40192Mi",  # NVML's 40192 "MB" are MiB
    }
    assert mig.parent == "gpu-0"
    assert mig.uuid == "MIG-a1000000-0001-0000-0000-000000000000"
    full = devices["gpu-1-mig-7g80gb-0-0"]
    assert full.attributes["profile"] == "7g.80gb"
    assert full.capacity["jpegEngines"] == Quantity.parse(1)
    assert full.capacity["memory"].canonical() == "79Gi"  # 80896 MiB
    assert devices["gpu-0-mig-2g20gb-14-0"].attributes["profile"] == "2g.20gb"
    assert devices["gpu-0-mig-1g10gb-19-3"].attributes["profile"] == "1g.10gb"


async def test_api_shape_of_published_devices(make_backend: BackendFactory, fake: LibNvml) -> None:
    devices = await discover(make_backend, fake)
    body = device_to_api(devices["gpu-2"])
    assert body["attributes"]["driverVersion"] == {"version": "550.54.15"}
    assert body["attributes"]["resource.kubernetes.io/pcieRoot"] == {"string": "pci0000:10"}
    assert body["capacity"]["memory"] == {"value": "81559Mi"}


async def test_driver_name_override(make_backend: BackendFactory, fake: LibNvml) -> None:
    backend = make_backend(fake, driver_name="gpu.example.com")
    await backend.start()
    devices = await backend.discover()
    await backend.stop()
    assert backend.driver_name == "gpu.example.com"
    assert {d.driver for d in devices} == {"gpu.example.com"}


async def test_driver_version_is_normalized(make_backend: BackendFactory) -> None:
    fake = LibNvml([h100(0)], driver_version="535.104.05", cuda_version=12020)
    devices = await discover(make_backend, fake)
    assert devices["gpu-0"].attributes["driverVersion"] == Version("535.104.5")
    assert devices["gpu-0"].attributes["cudaDriverVersion"] == Version("12.2.0")


async def test_unusable_driver_version_drops_attribute(make_backend: BackendFactory) -> None:
    fake = LibNvml([h100(0)], driver_version="unknown")
    devices = await discover(make_backend, fake)
    assert "driverVersion" not in devices["gpu-0"].attributes


async def test_old_driver_degrades_attributes_not_devices(make_backend: BackendFactory) -> None:
    fake = LibNvml(
        [h100(0)],
        missing={"nvmlDeviceGetArchitecture", "nvmlDeviceGetBrand", "nvmlSystemGetCudaDriverVersion"},
    )
    devices = await discover(make_backend, fake)
    attrs = devices["gpu-0"].attributes
    assert "brand" not in attrs and "cudaDriverVersion" not in attrs
    # Architecture falls back to the compute capability.
    assert attrs["architecture"] == "Hopper"
    assert attrs["productName"] == "NVIDIA H100 80GB HBM3"


async def test_not_supported_and_failing_calls_degrade(make_backend: BackendFactory) -> None:
    gpu = h100(0)
    fake = LibNvml([gpu])
    fake.fail(gpu.uuid, "nvmlDeviceGetMemoryInfo", int(real.NVML_ERROR_NOT_SUPPORTED))
    fake.fail(gpu.uuid, "nvmlDeviceGetPciInfo", int(real.NVML_ERROR_UNKNOWN))
    devices = await discover(make_backend, fake)
    device = devices["gpu-0"]
    assert dict(device.capacity) == {}
    assert "resource.kubernetes.io/pciBusID" not in device.attributes
    assert "resource.kubernetes.io/pcieRoot" not in device.attributes


async def test_lost_gpu_is_left_out(make_backend: BackendFactory, caplog: pytest.LogCaptureFixture) -> None:
    first, second = h100(0), l4(1)
    fake = LibNvml([first, second])
    first.lost = True
    with caplog.at_level(logging.ERROR):
        devices = await discover(make_backend, fake)
    assert list(devices) == ["gpu-1"]
    assert "GPU left out of discovery" in caplog.text


async def test_gpu_failing_mid_discovery_is_left_out(make_backend: BackendFactory) -> None:
    first, second = h100(0), l4(1)
    fake = LibNvml([first, second])
    fake.fail(first.uuid, "nvmlDeviceGetMinorNumber", int(real.NVML_ERROR_GPU_IS_LOST))
    assert list(await discover(make_backend, fake)) == ["gpu-1"]


async def test_mig_mode_without_mig_devices_publishes_nothing(make_backend: BackendFactory) -> None:
    gpu = a100_mig(0)
    gpu.migs = []
    fake = LibNvml([gpu, h100(1)])
    assert list(await discover(make_backend, fake)) == ["gpu-1"]


async def test_pending_mig_mode_is_not_applied(make_backend: BackendFactory) -> None:
    # MIG enabled but pending a reset: the current mode (off) counts; nothing is changed.
    gpu = h100(0)
    gpu.mig_mode = (0, 1)
    fake = LibNvml([gpu])
    assert list(await discover(make_backend, fake)) == ["gpu-0"]
    assert not [c for c in fake.calls if "Set" in c and "Event" not in c]


async def test_broken_mig_device_is_left_out(make_backend: BackendFactory) -> None:
    gpu = a100_mig(0)
    gpu.migs.append(FakeMig("MIG-broken", 11, 0, 999, 5, 1))  # a profile NVML does not list
    fake = LibNvml([gpu])
    devices = await discover(make_backend, fake)
    assert len(devices) == 4


async def test_compute_instance_profile_name(make_backend: BackendFactory) -> None:
    gpu = a100_mig(0)
    gpu.migs = [FakeMig("MIG-ci", 1, 0, 9, 0, 4, ci_slices=1)]
    fake = LibNvml([gpu])
    devices = await discover(make_backend, fake)
    assert list(devices) == ["gpu-0-mig-1c3g40gb-9-0"]
    assert devices["gpu-0-mig-1c3g40gb-9-0"].attributes["profile"] == "1c.3g.40gb"


async def test_media_extension_profile(make_backend: BackendFactory) -> None:
    gpu = a100_mig(0)
    gpu.migs = [FakeMig("MIG-me", 1, 0, 20, 6, 1)]
    devices = await discover(make_backend, LibNvml([gpu]))
    assert list(devices) == ["gpu-0-mig-1g10gbme-20-6"]
    assert devices["gpu-0-mig-1g10gbme-20-6"].attributes["profile"] == "1g.10gb+me"


async def test_no_gpus_is_an_empty_pool_said_once(
    make_backend: BackendFactory, caplog: pytest.LogCaptureFixture
) -> None:
    backend = make_backend(LibNvml([]))
    await backend.start()
    with caplog.at_level(logging.WARNING):
        assert list(await backend.discover()) == []
        assert list(await backend.discover()) == []
    await backend.stop()
    assert caplog.text.count("no NVIDIA GPUs found") == 1


def test_profile_names() -> None:
    total = 81920 * MIB
    assert mig_profile_name(1, 1, 9728, total) == "1g.10gb"
    assert mig_profile_name(2, 2, 19968, total) == "2g.20gb"
    assert mig_profile_name(3, 3, 40192, total) == "3g.40gb"
    assert mig_profile_name(4, 4, 40192, total) == "4g.40gb"
    assert mig_profile_name(7, 7, 80896, total) == "7g.80gb"
    assert mig_profile_name(3, 2, 40192, total) == "2c.3g.40gb"
    assert mig_profile_name(1, 1, 9728, total, "+me") == "1g.10gb+me"
    # H100 80GB (81559 MiB): 1g.10gb is 9984 MiB there.
    assert mig_profile_name(1, 1, 9984, 81559 * MIB) == "1g.10gb"
    assert mig_device_name(3, "1c.3g.40gb", 9, 4) == "gpu-3-mig-1c3g40gb-9-4"


def test_bus_ids_and_pcie_root(tmp_path: Path) -> None:
    assert normalize_bus_id("00000000:3B:00.0") == "0000:3b:00.0"
    assert normalize_bus_id("0001:07:00.0") == "0001:07:00.0"
    assert normalize_bus_id("garbage") == "garbage"
    root = build_sysfs(tmp_path / "sys", {"0000:3b:00.0": "pci0000:3a"})
    assert pcie_root(root, "0000:3b:00.0") == "pci0000:3a"
    assert pcie_root(root, "0000:99:00.0") is None
    assert pcie_root(root, "") is None
    # A link that resolves outside any pci root gives nothing.
    odd = root / "bus" / "pci" / "devices" / "0000:55:00.0"
    (tmp_path / "elsewhere").mkdir()
    odd.symlink_to(tmp_path / "elsewhere")
    assert pcie_root(root, "0000:55:00.0") is None


async def test_old_driver_without_profile_info_v2(make_backend: BackendFactory) -> None:
    gpu = a100_mig(0)
    gpu.migs = [FakeMig("MIG-me", 1, 0, 20, 6, 1), FakeMig("MIG-3g", 2, 0, 9, 0, 4)]
    fake = LibNvml([gpu], missing={"nvmlDeviceGetGpuInstanceProfileInfoV"})
    devices = await discover(make_backend, fake)
    # The v1 structure has no profile name: the suffix comes from the profile index, as NVIDIA names it.
    assert sorted(devices) == ["gpu-0-mig-1g10gbme-20-6", "gpu-0-mig-3g40gb-9-0"]
    assert devices["gpu-0-mig-3g40gb-9-0"].capacity["multiprocessors"] == Quantity.parse(42)


@pytest.mark.parametrize(
    "function",
    [
        "nvmlDeviceGetMigDeviceHandleByIndex",
        "nvmlDeviceGetGpuInstanceProfileInfoV",
        "nvmlDeviceGetGpuInstanceId",
    ],
)
async def test_gpu_lost_while_reading_mig_devices(make_backend: BackendFactory, function: str) -> None:
    gpu = a100_mig(0)
    fake = LibNvml([gpu, h100(1)])
    fake.fail(gpu.uuid, function, int(real.NVML_ERROR_GPU_IS_LOST))
    assert list(await discover(make_backend, fake)) == ["gpu-1"]


async def test_mig_slot_errors_skip_the_slot(make_backend: BackendFactory) -> None:
    gpu = a100_mig(0)
    fake = LibNvml([gpu])
    fake.fail(gpu.uuid, "nvmlDeviceGetMigDeviceHandleByIndex", int(real.NVML_ERROR_UNKNOWN))
    assert list(await discover(make_backend, fake)) == []


async def test_newer_profile_names_follow_nvidia_naming(make_backend: BackendFactory) -> None:
    """nvml.h:12531-12549 adds GFX, NO_ME and ALL_ME profiles; NVIDIA names them by profile index
    (go-nvlib pkg/nvlib/device/mig_profile.go): ``+me``, ``+gfx``, ``-me``, ``+me.all``. Each
    distinct profile publishes a distinct ``profile`` attribute. Index 0x11 needs a pynvml whose
    profile count is 0x12 (nvidia-ml-py 13.610.43, the floor): older ones leave that device out."""
    gpu = b200_mig(0)
    devices = await discover(make_backend, LibNvml([gpu]))
    profiles = {d.attributes["profile"] for d in devices.values() if d.attributes.get("type") == "mig"}
    assert profiles == {
        "1g.23gb+me", "1g.23gb+gfx", "1g.23gb-me", "1g.23gb+me.all", "2g.45gb+me.all", "3g.90gb+gfx",
    }  # fmt: skip
