"""Fake-backend profiles: the shipped ones are shaped like real hardware; bad ones fail clearly."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from agent.core.backend import BackendOptions
from agent.core.errors import ConfigError
from agent.core.model import Device, Version
from agent.core.quantity import Quantity
from agent.core.semver import is_semver
from backends.fake import create_backend
from backends.fake.backend import FakeBackend
from backends.fake.profile import ProfileError, load_profile, parse_profile, shipped_profiles

MIG_NAME = re.compile(r"^gpu-(\d+)-mig-(\d+g\d+gb)-(\d+)-(\d+)$")


def by_name(profile: str) -> dict[str, Device]:
    return {d.name: d for drv in load_profile(profile).drivers for d in drv.devices}


def test_shipped_profiles_exist() -> None:
    assert shipped_profiles() == [
        "amd-mi300x-8x",
        "amd-mi300x-8x-cpx",
        "mixed",
        "nvidia-a100-8x",
        "nvidia-h100-8x",
    ]


@pytest.mark.parametrize(
    "name", ["amd-mi300x-8x", "amd-mi300x-8x-cpx", "mixed", "nvidia-a100-8x", "nvidia-h100-8x"]
)
def test_every_shipped_device_is_valid(name: str) -> None:
    profile = load_profile(name)
    for driver in profile.drivers:
        assert driver.devices
        for device in driver.devices:
            assert device.driver == driver.name
            for value in device.attributes.values():
                if isinstance(value, Version):
                    assert is_semver(value.value)
            assert device.uuid and device.pci_bus_id and device.product


def test_nvidia_a100_names_and_attributes() -> None:
    devices = by_name("nvidia-a100-8x")
    gpus = sorted(n for n in devices if "-mig-" not in n)
    assert gpus == [f"gpu-{i}" for i in range(6)]
    gpu = devices["gpu-0"]
    assert gpu.driver == "gpu.nvidia.com"
    attrs = gpu.attributes
    assert attrs["type"] == "gpu"
    assert attrs["productName"] == "NVIDIA A100-SXM4-80GB"
    assert attrs["brand"] == "Nvidia"
    assert attrs["architecture"] == "Ampere"
    assert attrs["cudaComputeCapability"] == Version("8.0.0")
    assert attrs["driverVersion"] == Version("550.54.15")
    assert attrs["cudaDriverVersion"] == Version("12.4.0")
    assert str(attrs["uuid"]).startswith("GPU-")
    assert attrs["resource.kubernetes.io/pciBusID"] == "0000:07:00.0"
    assert str(attrs["resource.kubernetes.io/pcieRoot"]).startswith("pci")
    assert gpu.capacity["memory"] == Quantity.parse("80Gi")


def test_nvidia_h100_names_and_attributes() -> None:
    """Shaped as NVIDIA's H100 SXM5 80GB reports itself (product name as ``nvidia-smi -q``):
    Hopper, compute capability 9.0; the product is one `backends.fake.migtables` knows."""
    devices = by_name("nvidia-h100-8x")
    assert sorted(devices) == [f"gpu-{i}" for i in range(8)]
    assert len({d.uuid for d in devices.values()}) == 8
    assert len({d.attributes["resource.kubernetes.io/pcieRoot"] for d in devices.values()}) == 8
    gpu = devices["gpu-0"]
    assert gpu.product == gpu.attributes["productName"] == "NVIDIA H100 80GB HBM3"
    assert gpu.attributes["architecture"] == "Hopper"
    assert gpu.attributes["cudaComputeCapability"] == Version("9.0.0")
    assert gpu.attributes["type"] == "gpu" and gpu.attributes["uuid"] == gpu.uuid
    assert gpu.capacity["memory"] == Quantity.parse("80Gi")


def test_nvidia_mig_devices_replace_their_gpus() -> None:
    devices = by_name("nvidia-a100-8x")
    migs = {n: d for n, d in devices.items() if "-mig-" in n}
    assert "gpu-6" not in devices and "gpu-7" not in devices
    assert {n.split("-mig-")[0] for n in migs} == {"gpu-6", "gpu-7"}
    assert "gpu-6-mig-3g40gb-9-0" in migs and "gpu-6-mig-3g40gb-9-4" in migs
    for name, mig in migs.items():
        match = MIG_NAME.match(name)
        assert match, name
        assert mig.attributes["type"] == "mig"
        assert str(mig.attributes["profile"]).replace(".", "") == match.group(2)
        assert mig.attributes["migProfile"] == mig.attributes["profile"]
        assert str(mig.attributes["parentUUID"]).startswith("GPU-")
        assert str(mig.attributes["uuid"]).startswith("MIG-")
        assert mig.parent == f"gpu-{match.group(1)}"
        assert set(mig.capacity) == {
            "multiprocessors",
            "copyEngines",
            "decoders",
            "encoders",
            "jpegEngines",
            "ofaEngines",
            "memory",
        }
    assert migs["gpu-6-mig-3g40gb-9-0"].capacity["memory"] >= Quantity.parse("39Gi")


def test_amd_mi300x_spx() -> None:
    devices = by_name("amd-mi300x-8x")
    assert sorted(devices) == sorted(f"gpu-{1 + i}-{128 + i}" for i in range(8))
    gpu = devices["gpu-1-128"]
    a = gpu.attributes
    assert gpu.driver == "gpu.amd.com"
    assert a["type"] == "amdgpu"
    assert (a["cardIndex"], a["renderIndex"]) == (1, 128)
    assert a["productName"] == "AMD_Instinct_MI300X_OAM"
    assert a["partitionProfile"] == "spx_nps1"
    assert a["family"] == "AI"
    assert isinstance(a["deviceID"], str) and a["deviceID"].isdigit()
    assert isinstance(a["driverVersion"], Version)
    assert isinstance(a["numaNode"], int)
    assert a["pciAddr"] == a["resource.kubernetes.io/pciBusID"]
    assert gpu.capacity["memory"] == Quantity.parse("192Gi")
    assert gpu.capacity["computeUnits"] == Quantity.parse("304")
    assert "simdUnits" in gpu.capacity


def test_amd_mi300x_cpx_partitions_share_their_parent_device_id() -> None:
    devices = by_name("amd-mi300x-8x-cpx")
    assert len(devices) == 64
    by_parent: dict[str, list[Device]] = {}
    for device in devices.values():
        assert device.attributes["type"] == "amdgpu-partition"
        assert device.attributes["partitionProfile"] == "cpx_nps4"
        assert device.attributes["deviceID"] == device.attributes["parentDeviceID"]
        by_parent.setdefault(str(device.attributes["parentPciAddr"]), []).append(device)
    assert len(by_parent) == 8
    assert all(len(parts) == 8 for parts in by_parent.values())
    assert all(len({p.attributes["deviceID"] for p in parts}) == 1 for parts in by_parent.values())


def test_mixed_profile_gives_two_backends() -> None:
    backends = create_backend(BackendOptions("node-a", settings={"control": "off"}))
    assert [b.driver_name for b in backends] == ["gpu.nvidia.com", "gpu.amd.com"]
    assert all(isinstance(b, FakeBackend) for b in backends)


def test_driver_name_override_for_one_driver_profile() -> None:
    (backend,) = create_backend(
        BackendOptions("n", "gpu.example.com", {"profile": "nvidia-a100-8x", "control": "off"})
    )
    assert backend.driver_name == "gpu.example.com"


def test_driver_setting_is_accepted() -> None:
    options = BackendOptions(
        "n", "gpu.example.com", {"profile": "amd-mi300x-8x", "control": "off", "driver": "gpu.example.com"}
    )
    assert [b.driver_name for b in create_backend(options)] == ["gpu.example.com"]


def test_driver_name_override_refused_for_two_driver_profile() -> None:
    with pytest.raises(ConfigError, match="2 drivers"):
        create_backend(BackendOptions("n", "gpu.example.com", {"profile": "mixed"}))


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"bogus": "1"}, "setting bogus"),
        ({"prepare_fail_rate": "2"}, "prepare_fail_rate"),
        ({"prepare_latency": "soon"}, "prepare_latency"),
        ({"seed": "x"}, "seed"),
    ],
)
def test_bad_settings(settings: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        create_backend(BackendOptions("n", settings=settings))


def test_profile_from_a_path(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        "drivers:\n- name: gpu.example.com\n  devices:\n"
        "  - name: dev-0\n    attributes: {ok: {bool: true}}\n    capacity: {memory: 1Gi}\n"
    )
    (backend,) = create_backend(BackendOptions("n", settings={"profile": str(path), "control": "off"}))
    assert backend.driver_name == "gpu.example.com"


GOOD_DEVICE = "  - name: gpu-0\n    attributes:\n      driverVersion: {version: 550.54.15}\n"


def one_line(error: ProfileError) -> str:
    text = str(error)
    assert "\n" not in text
    return text


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("drivers: [\n", "profile /x.yaml: not valid YAML at line 2"),
        ("drivers: []\n", "profile /x.yaml: drivers: [] must be a non-empty list"),
        ("nodes: 1\n", "profile /x.yaml: nodes: unknown field"),
        (
            "drivers:\n- name: gpu.example.com\n  devices:\n  - name: gpu-0\n    colour: red\n",
            "profile /x.yaml: drivers[0].devices[0].colour: unknown field",
        ),
        (
            "drivers:\n- name: gpu.example.com\n  devices:\n"
            + GOOD_DEVICE
            + "  - name: gpu-1\n    attributes:\n      driverVersion: {version: 'not-a-version'}\n",
            "profile /x.yaml: drivers[0].devices[1].attributes.driverVersion: 'not-a-version' is not",
        ),
        (
            "drivers:\n- name: gpu.example.com\n  devices:\n  - name: gpu-0\n"
            "    attributes:\n      cardIndex: {int: one}\n",
            "profile /x.yaml: drivers[0].devices[0].attributes.cardIndex.int: 'one' must be an integer",
        ),
        (
            "drivers:\n- name: gpu.example.com\n  devices:\n  - name: gpu-0\n"
            "    attributes:\n      cardIndex: {float: 1.5}\n",
            "drivers[0].devices[0].attributes.cardIndex: unknown attribute type 'float'",
        ),
        (
            "drivers:\n- name: gpu.example.com\n  devices:\n  - name: gpu-0\n    attributes:\n      a: 1\n",
            "drivers[0].devices[0].attributes.a: 1 must be one typed value",
        ),
        (
            "drivers:\n- name: gpu.example.com\n  devices:\n  - name: gpu-0\n    capacity: {memory: lots}\n",
            "drivers[0].devices[0].capacity.memory: invalid quantity 'lots'",
        ),
        (
            "drivers:\n- name: gpu.example.com\n  devices:\n  - name: GPU_0\n",
            "drivers[0].devices[0] (GPU_0): name: must be a DNS label",
        ),
        (
            "drivers:\n- name: Not A Driver\n  devices:\n  - name: gpu-0\n",
            "drivers[0].devices[0] (gpu-0): driver:",
        ),
        (
            "drivers:\n- name: gpu.example.com\n  vendor: intel\n",
            "drivers[0].vendor: 'intel' must be one of nvidia, amd, generic",
        ),
        (
            "drivers:\n- name: gpu.example.com\n  devices:\n" + GOOD_DEVICE + GOOD_DEVICE,
            "drivers[0].devices[1].name: 'gpu-0' appears twice",
        ),
    ],
)
def test_malformed_profiles_give_one_clear_line(text: str, expected: str) -> None:
    with pytest.raises(ProfileError) as caught:
        parse_profile(text, "/x.yaml")
    assert expected in one_line(caught.value)


def test_too_many_attributes() -> None:
    attrs = "".join(f"      a{i}: {{int: {i}}}\n" for i in range(33))
    text = "drivers:\n- name: gpu.example.com\n  devices:\n  - name: gpu-0\n    attributes:\n" + attrs
    with pytest.raises(ProfileError) as caught:
        parse_profile(text, "/x.yaml")
    assert "drivers[0].devices[0] (gpu-0): attributes: 33 attributes and capacities, at most 32" in one_line(
        caught.value
    )


def test_string_too_long() -> None:
    text = (
        "drivers:\n- name: gpu.example.com\n  devices:\n  - name: gpu-0\n"
        f"    attributes:\n      productName: {{string: {'x' * 65}}}\n"
    )
    with pytest.raises(ProfileError, match=r"attributes\[productName\]: string of 65 characters"):
        parse_profile(text, "/x.yaml")


def test_missing_profile_file() -> None:
    with pytest.raises(ProfileError) as caught:
        load_profile("/nonexistent/profile.yaml")
    assert "profile /nonexistent/profile.yaml: unreadable" in one_line(caught.value)
    assert "nvidia-a100-8x" in str(caught.value)
