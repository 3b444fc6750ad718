"""The CEL selectors users write for NVIDIA's driver select the right devices of ours."""

from __future__ import annotations

import pytest

from agent.core.cel import CelError, match_attribute, matches
from agent.core.model import Device, Version
from agent.core.quantity import Quantity
from agent.kube.slices import device_to_api
from tests.fakes.libnvml import LibNvml
from tests.nvidia.conftest import BackendFactory

MIG_CLASS = "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'mig'"
GPU_CLASS = "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'"


@pytest.fixture
async def devices(make_backend: BackendFactory, fake: LibNvml) -> dict[str, Device]:
    backend = make_backend(fake)
    await backend.start()
    found = {d.name: d for d in await backend.discover()}
    await backend.stop()
    return found


def selected(expression: str, devices: dict[str, Device]) -> set[str]:
    return {name for name, d in devices.items() if matches(expression, d)}


A100_MIGS = {
    "gpu-0-mig-1g10gb-19-2",
    "gpu-0-mig-1g10gb-19-3",
    "gpu-0-mig-2g20gb-14-0",
    "gpu-0-mig-3g40gb-9-4",
    "gpu-1-mig-7g80gb-0-0",
}


async def test_memory_selector(devices: dict[str, Device]) -> None:
    # 3g.40gb has 40192 MiB, less than 40 GiB, exactly as with NVIDIA's driver.
    assert selected("device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0", devices) == {
        "gpu-1-mig-7g80gb-0-0",
        "gpu-2",
    }
    assert "gpu-0-mig-3g40gb-9-4" in selected(
        "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('39Gi')) >= 0", devices
    )


async def test_architecture_selector(devices: dict[str, Device]) -> None:
    expression = "device.attributes['gpu.nvidia.com'].architecture in ['Ampere','Hopper','Blackwell']"
    assert selected(expression, devices) == A100_MIGS | {"gpu-2"}


async def test_compute_capability_selector(devices: dict[str, Device]) -> None:
    expression = "device.attributes['gpu.nvidia.com'].cudaComputeCapability.isGreaterThan(semver('8.0.0'))"
    assert selected(expression, devices) == {"gpu-2", "gpu-3"}


async def test_product_name_selector(devices: dict[str, Device]) -> None:
    expression = "device.attributes['gpu.nvidia.com'].productName == 'NVIDIA A100-SXM4-80GB'"
    assert selected(expression, devices) == A100_MIGS


async def test_profile_selectors_after_the_mig_class(devices: dict[str, Device]) -> None:
    for attribute in ("profile", "migProfile"):
        expression = f"{MIG_CLASS} && device.attributes['gpu.nvidia.com'].{attribute} == '3g.40gb'"
        assert selected(expression, devices) == {"gpu-0-mig-3g40gb-9-4"}
    assert selected(GPU_CLASS, devices) == {"gpu-2", "gpu-3"}
    assert selected(MIG_CLASS, devices) == A100_MIGS


async def test_profile_on_a_full_gpu_is_an_error_as_in_kubernetes(devices: dict[str, Device]) -> None:
    with pytest.raises(CelError):
        matches("device.attributes['gpu.nvidia.com'].profile == '3g.40gb'", devices["gpu-2"])


async def test_match_attribute_pcie_root(devices: dict[str, Device]) -> None:
    # The H100 and the L4 share pci0000:10; the A100s are on pci0000:00.
    assert match_attribute("resource.kubernetes.io/pcieRoot", [devices["gpu-2"], devices["gpu-3"]])
    assert match_attribute(
        "resource.kubernetes.io/pcieRoot", [devices["gpu-0-mig-3g40gb-9-4"], devices["gpu-1-mig-7g80gb-0-0"]]
    )
    assert not match_attribute(
        "resource.kubernetes.io/pcieRoot", [devices["gpu-2"], devices["gpu-1-mig-7g80gb-0-0"]]
    )
    assert match_attribute(
        "gpu.nvidia.com/productName", [devices["gpu-0-mig-2g20gb-14-0"], devices["gpu-1-mig-7g80gb-0-0"]]
    )
    assert not match_attribute("gpu.nvidia.com/profile", [devices["gpu-2"], devices["gpu-3"]])


async def test_selectors_on_slice_dicts(devices: dict[str, Device]) -> None:
    body = device_to_api(devices["gpu-2"])
    assert matches(
        "device.attributes['resource.kubernetes.io'].pcieRoot == 'pci0000:10'", body, "gpu.nvidia.com"
    )
    assert matches(
        "device.capacity['gpu.nvidia.com'].memory.isGreaterThan(quantity('64Gi'))",
        device_to_api(devices["gpu-2"], api_version="v1beta1"),
        driver="gpu.nvidia.com",
    )
    with pytest.raises(CelError, match="driver"):
        matches("true", body)


def test_cel_helper_semantics() -> None:
    device = Device(
        name="d",
        driver="gpu.example.com",
        attributes={"v": Version("1.2.3-rc.1"), "n": 3, "b": True, "other.example.com/x": "y"},
        capacity={"mem": Quantity.parse("1Gi")},
    )
    assert matches("device.attributes['gpu.example.com'].v.isLessThan(semver('1.2.3'))", device)
    assert matches("device.attributes['gpu.example.com'].v.major() == 1", device)
    assert matches("device.attributes['gpu.example.com'].v.minor() == 2", device)
    assert matches("device.attributes['gpu.example.com'].v.patch() == 3", device)
    assert matches(
        "device.attributes['gpu.example.com'].n == 3 && device.attributes['gpu.example.com'].b", device
    )
    assert matches("device.attributes['other.example.com'].x == 'y'", device)
    # An unknown domain is an empty map; has() tests presence.
    assert not matches("has(device.attributes['nowhere.example.com'].x)", device)
    assert matches("device.capacity['gpu.example.com'].mem.compareTo(quantity('1024Mi')) == 0", device)
    assert matches("device.capacity['gpu.example.com'].mem.sub(quantity('1Gi')).sign() == 0", device)
    assert matches("quantity('1500m').add(1).isGreaterThan(quantity('2'))", device)
    assert matches(
        "quantity('2k').asInteger() == 2000 && quantity('1.5').asApproximateFloat() == 1.5", device
    )
    assert matches("!quantity('1.5').isInteger() && isQuantity('1Gi') && !isQuantity('x')", device)
    assert matches("isSemver('1.0.0') && !isSemver('1.0') && semver('1.0', true) == semver('1.0.0')", device)
    assert matches("semver('1.0.0-alpha.1').isLessThan(semver('1.0.0-alpha.beta'))", device)
    assert matches("semver('1.0.0-2').isLessThan(semver('1.0.0-10'))", device)
    for bad in (
        "device.attributes['gpu.example.com'].missing == 1",
        "device.capacity['gpu.example.com'].mem.compareTo(semver('1.0.0')) == 0",
        "device.attributes['gpu.example.com'].n.compareTo(1) == 0",
        "quantity('1.5').asInteger() == 1",
        "'x'",
        "device.attributes[",
    ):
        with pytest.raises(CelError):
            matches(bad, device)
