"""Container edits in both CDI modes, MIG capability nodes, and their failures."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.core.backend import ClaimRef, ContainerEdits, DeviceNode, Mount
from agent.core.errors import BackendError, DeviceNotFoundError
from backends.nvidia.edits import _device_node, driver_mounts, mig_capability_minors, resolve_dev_root
from tests.fakes.fake_pynvml import FakeNvml
from tests.nvidia.conftest import BackendFactory

CLAIM = ClaimRef("default", "claim", "uid-1")
MIG = "gpu-0-mig-3g40gb-9-4"  # gi 2, ci 0 on minor 0


def make_dev(root: Path, names: list[str]) -> None:
    for name in names:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()


def make_caps(proc: Path, *, gpu: int, gi: int, ci: int, gi_minor: int, ci_minor: int) -> None:
    base = proc / "driver" / "nvidia" / "capabilities" / f"gpu{gpu}" / "mig" / f"gi{gi}"
    (base / f"ci{ci}").mkdir(parents=True)
    (base / "access").write_text(f"DeviceFileMinor: {gi_minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n")
    (base / f"ci{ci}" / "access").write_text(f"DeviceFileMinor: {ci_minor}\nDeviceFileMode: 292\n")


def make_driver_root(root: Path) -> Path:
    libdir = root / "usr" / "lib" / "x86_64-linux-gnu"
    libdir.mkdir(parents=True)
    for name in (
        "libnvidia-ml.so.1",
        "libnvidia-ml.so.550.54.15",
        "libcuda.so.1",
        "libcuda.so.550.54.15",
        "libnvidia-ptxjitcompiler.so.1",
        "libc.so.6",
        "libz.so.1",
    ):
        (libdir / name).touch()
    (root / "usr" / "bin").mkdir(parents=True)
    (root / "usr" / "bin" / "nvidia-smi").touch()
    return root


async def prepared(
    backend_factory: BackendFactory, fake: FakeNvml, device: str, **settings: str
) -> ContainerEdits:
    backend = backend_factory(fake, **settings)
    await backend.start()
    try:
        return await backend.prepare(device, CLAIM)
    finally:
        await backend.stop()


async def test_own_mode_full_gpu(make_backend: BackendFactory, fake: FakeNvml, tmp_path: Path) -> None:
    make_dev(tmp_path / "dev", ["nvidia2", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"])
    driver_root = make_driver_root(tmp_path / "driver")
    backend = make_backend(fake, driver_root=str(driver_root))
    await backend.start()
    edits = await backend.prepare("gpu-2", CLAIM)
    again = await backend.prepare("gpu-2", CLAIM)
    await backend.unprepare("gpu-2", CLAIM)
    await backend.unprepare("gpu-2", CLAIM)  # unpreparing twice is fine
    await backend.stop()
    assert again == edits
    dev = tmp_path / "dev"
    assert edits.device_nodes == (
        DeviceNode("/dev/nvidia2", str(dev / "nvidia2"), permissions="rw"),
        DeviceNode("/dev/nvidiactl", str(dev / "nvidiactl"), permissions="rw"),
        DeviceNode("/dev/nvidia-uvm", str(dev / "nvidia-uvm"), permissions="rw"),
        DeviceNode("/dev/nvidia-uvm-tools", str(dev / "nvidia-uvm-tools"), permissions="rw"),
    )
    assert dict(edits.env) == {"NVIDIA_VISIBLE_DEVICES": "GPU-h1000002-0000-0000-0000-000000000000"}
    assert edits.list_env == {"NVIDIA_VISIBLE_DEVICES"}
    assert edits.cdi_device_ids == ()
    libdir = driver_root / "usr" / "lib" / "x86_64-linux-gnu"
    assert edits.mounts == (
        Mount(str(libdir / "libcuda.so.1"), "/usr/local/nvidia/lib64/libcuda.so.1"),
        Mount(str(libdir / "libcuda.so.550.54.15"), "/usr/local/nvidia/lib64/libcuda.so.550.54.15"),
        Mount(str(libdir / "libnvidia-ml.so.1"), "/usr/local/nvidia/lib64/libnvidia-ml.so.1"),
        Mount(str(libdir / "libnvidia-ml.so.550.54.15"), "/usr/local/nvidia/lib64/libnvidia-ml.so.550.54.15"),
        Mount(
            str(libdir / "libnvidia-ptxjitcompiler.so.1"),
            "/usr/local/nvidia/lib64/libnvidia-ptxjitcompiler.so.1",
        ),
        Mount(str(driver_root / "usr" / "bin" / "nvidia-smi"), "/usr/local/nvidia/bin/nvidia-smi"),
    )
    assert all(m.options == ("ro", "nosuid", "nodev", "bind") for m in edits.mounts)


async def test_own_mode_mig_device_gets_capability_nodes(
    make_backend: BackendFactory, fake: FakeNvml, tmp_path: Path
) -> None:
    make_dev(
        tmp_path / "dev", ["nvidia0", "nvidiactl", "nvidia-caps/nvidia-cap21", "nvidia-caps/nvidia-cap22"]
    )
    make_caps(tmp_path / "proc", gpu=0, gi=2, ci=0, gi_minor=21, ci_minor=22)
    edits = await prepared(make_backend, fake, MIG)
    assert [n.path for n in edits.device_nodes] == [
        "/dev/nvidia0",
        "/dev/nvidiactl",
        "/dev/nvidia-caps/nvidia-cap21",
        "/dev/nvidia-caps/nvidia-cap22",
    ]
    assert dict(edits.env) == {"NVIDIA_VISIBLE_DEVICES": "MIG-a1000000-0001-0000-0000-000000000000"}


async def test_toolkit_mode(make_backend: BackendFactory, fake: FakeNvml) -> None:
    backend = make_backend(fake, cdi_mode="toolkit")
    assert backend.cdi_mode == "toolkit"
    await backend.start()
    gpu = await backend.prepare("gpu-2", CLAIM)
    mig = await backend.prepare(MIG, CLAIM)
    await backend.stop()
    assert gpu.cdi_device_ids == ("nvidia.com/gpu=GPU-h1000002-0000-0000-0000-000000000000",)
    assert gpu.device_nodes == () and gpu.mounts == ()
    assert dict(gpu.env) == {"NVIDIA_VISIBLE_DEVICES": "GPU-h1000002-0000-0000-0000-000000000000"}
    assert mig.cdi_device_ids == ("nvidia.com/gpu=MIG-a1000000-0001-0000-0000-000000000000",)


async def test_missing_required_node_fails_clearly(
    make_backend: BackendFactory, fake: FakeNvml, tmp_path: Path
) -> None:
    make_dev(tmp_path / "dev", ["nvidiactl"])
    with pytest.raises(BackendError, match=r"nvidia2 is missing: load the NVIDIA driver"):
        await prepared(make_backend, fake, "gpu-2")


async def test_missing_uvm_nodes_are_skipped(
    make_backend: BackendFactory, fake: FakeNvml, tmp_path: Path
) -> None:
    make_dev(tmp_path / "dev", ["nvidia3", "nvidiactl"])
    edits = await prepared(make_backend, fake, "gpu-3")
    assert [n.path for n in edits.device_nodes] == ["/dev/nvidia3", "/dev/nvidiactl"]


async def test_missing_mig_capability_file(
    make_backend: BackendFactory, fake: FakeNvml, tmp_path: Path
) -> None:
    make_dev(tmp_path / "dev", ["nvidia0", "nvidiactl"])
    with pytest.raises(BackendError, match=r"cannot read MIG capability file .*gi2/access.*mount the host's"):
        await prepared(make_backend, fake, MIG)


def test_capability_file_without_minor(tmp_path: Path) -> None:
    base = tmp_path / "driver" / "nvidia" / "capabilities" / "gpu0" / "mig" / "gi1"
    (base / "ci0").mkdir(parents=True)
    (base / "access").write_text("DeviceFileMode: 292\n")
    with pytest.raises(BackendError, match="no DeviceFileMinor"):
        mig_capability_minors(tmp_path, 0, 1, 0)


async def test_unknown_device(make_backend: BackendFactory, fake: FakeNvml) -> None:
    with pytest.raises(DeviceNotFoundError, match="gpu-9"):
        await prepared(make_backend, fake, "gpu-9")


def test_character_device_node_is_read_from_the_host() -> None:
    node = _device_node(Path("/dev"), "null", required=True)
    assert node == DeviceNode("/dev/null", "", "c", 1, 3, "rw")


def test_dev_root_of_a_containerized_driver(tmp_path: Path) -> None:
    assert resolve_dev_root(Path("/")) == Path("/dev")
    assert resolve_dev_root(tmp_path) == Path("/dev")
    make_dev(tmp_path / "dev", ["nvidiactl"])
    assert resolve_dev_root(tmp_path) == tmp_path / "dev"


def test_no_driver_libraries(tmp_path: Path) -> None:
    assert driver_mounts(tmp_path) == ()
