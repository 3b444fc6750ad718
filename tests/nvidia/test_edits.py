"""Own-mode container edits: device nodes, MIG capability nodes, driver files with host paths, hooks.

The driver roots are laid out like a real installation (`tests.nvidia.hostfs`); every spec built
from the edits is checked against the CDI JSON schema (`tests.support.cdi_check`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from agent.claims.cdi import CdiDevice, build_claim_spec
from agent.core.backend import ClaimRef, ContainerEdits, DeviceNode, Hook, Mount
from agent.core.errors import BackendError, DeviceNotFoundError
from backends.nvidia.driverfiles import HostView, driver_version, find_driver_files
from backends.nvidia.edits import DevDir, _device_node, mig_capability_minors, resolve_dev_dir
from tests.fakes.libnvml import LibNvml
from tests.nvidia.conftest import BackendFactory
from tests.nvidia.hostfs import LIBDIR, VERSION, logged, make_driver_root
from tests.support.cdi_check import cdi_problems

CLAIM = ClaimRef("default", "claim", "uid-1")
MIG = "gpu-0-mig-3g40gb-9-4"  # gi 2, ci 0 on minor 0
H100_UUID = "GPU-h1000002-0000-0000-0000-000000000000"
LIB = f"/{LIBDIR}"
HOOK = "/usr/bin/nvidia-cdi-hook"


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


async def prepared(
    backend_factory: BackendFactory, fake: LibNvml, device: str, **settings: str
) -> ContainerEdits:
    backend = backend_factory(fake, **settings)
    await backend.start()
    try:
        return await backend.prepare(device, CLAIM)
    finally:
        await backend.stop()


def spec_of(edits: ContainerEdits, name: str = "uid-1-gpu-2") -> dict[str, object]:
    spec = build_claim_spec("gpu.nvidia.com", [CdiDevice(name, edits)])
    assert cdi_problems(spec) == []
    return spec


def lib(name: str, root: str = "") -> Mount:
    return Mount(f"{root}{LIB}/{name}", f"{LIB}/{name}")


async def test_own_mode_full_gpu_on_a_host_installed_driver(
    make_backend: BackendFactory, fake: LibNvml, tmp_path: Path
) -> None:
    """Driver root "/" seen through the agent's mount of the host (host-root): host paths in the spec."""
    make_dev(tmp_path / "dev", ["nvidia2", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset"])
    make_driver_root(tmp_path / "host")
    backend = make_backend(fake, cdi_mode="own")
    await backend.start()
    edits = await backend.prepare("gpu-2", CLAIM)
    again = await backend.prepare("gpu-2", CLAIM)
    await backend.unprepare("gpu-2", CLAIM)
    await backend.unprepare("gpu-2", CLAIM)  # unpreparing twice is fine
    await backend.stop()
    assert again == edits
    assert backend.active_cdi_mode == "own"
    dev = tmp_path / "dev"
    assert edits.device_nodes == tuple(
        DeviceNode(f"/dev/{n}", str(dev / n), permissions="rw")
        for n in ("nvidia2", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
    )
    # The device nodes say which GPU; the variable is the toolkit's "void", the same in every claim.
    assert dict(edits.env) == {"NVIDIA_VISIBLE_DEVICES": "void"}
    assert edits.list_env == frozenset()
    assert edits.cdi_device_ids == ()
    # Every driver library (the files ending in the driver version), at its host path, nothing else.
    assert edits.mounts == (
        *(
            lib(f"{name}.so.{VERSION}")
            for name in (
                "libEGL_nvidia",
                "libGLX_nvidia",
                "libcuda",
                "libnvidia-gpucomp",
                "libnvidia-ml",
                "libnvidia-nvvm",
                "libnvidia-opticalflow",
                "libnvidia-ptxjitcompiler",
            )
        ),
        lib(f"vdpau/libvdpau_nvidia.so.{VERSION}"),
        Mount("/usr/bin/nvidia-smi", "/usr/bin/nvidia-smi"),
        Mount("/usr/bin/nvidia-debugdump", "/usr/bin/nvidia-debugdump"),
        Mount("/usr/share/glvnd/egl_vendor.d/10_nvidia.json", "/usr/share/glvnd/egl_vendor.d/10_nvidia.json"),
        Mount("/usr/share/vulkan/icd.d/nvidia_icd.json", "/usr/share/vulkan/icd.d/nvidia_icd.json"),
        Mount("/run/nvidia-persistenced/socket", "/run/nvidia-persistenced/socket"),
    )
    assert all(m.options == ("ro", "nosuid", "nodev", "bind") for m in edits.mounts)
    # ldconfig makes the .so.1 links in the container; libcuda.so and the GLX link come from the hook.
    assert edits.hooks == (
        Hook(
            "createContainer",
            HOOK,
            ("nvidia-cdi-hook", "update-ldcache", "--folder", LIB, "--folder", f"{LIB}/vdpau"),
        ),
        Hook(
            "createContainer",
            HOOK,
            (
                "nvidia-cdi-hook",
                "create-symlinks",
                "--link",
                f"libcuda.so.1::{LIB}/libcuda.so",
                "--link",
                f"libnvidia-opticalflow.so.1::{LIB}/libnvidia-opticalflow.so",
                "--link",
                f"libGLX_nvidia.so.{VERSION}::{LIB}/libGLX_indirect.so.0",
            ),
        ),
    )
    spec = spec_of(edits)
    assert spec["cdiVersion"] == "0.5.0"


async def test_gpu_operator_driver_root_gives_host_paths_and_its_dev_dir(
    make_backend: BackendFactory, fake: LibNvml, tmp_path: Path
) -> None:
    """Driver root /run/nvidia/driver with the toolkit the GPU Operator installs under /usr/local/nvidia."""
    host = tmp_path / "host"
    root = make_driver_root(
        host / "run/nvidia/driver", hook="usr/local/nvidia/toolkit/nvidia-cdi-hook", host=host
    )
    make_dev(root / "dev", ["nvidia2", "nvidiactl"])
    backend = make_backend(fake, real_dev_dir=True, cdi_mode="own", driver_root="/run/nvidia/driver")
    await backend.start()
    edits = await backend.prepare("gpu-2", CLAIM)
    await backend.stop()
    assert [(n.path, n.host_path) for n in edits.device_nodes] == [
        ("/dev/nvidia2", "/run/nvidia/driver/dev/nvidia2"),
        ("/dev/nvidiactl", "/run/nvidia/driver/dev/nvidiactl"),
    ]
    assert lib(f"libcuda.so.{VERSION}", "/run/nvidia/driver") in edits.mounts
    assert Mount("/run/nvidia/driver/usr/bin/nvidia-smi", "/usr/bin/nvidia-smi") in edits.mounts
    assert not any(str(tmp_path) in m.host_path for m in edits.mounts)
    hook_path = "/usr/local/nvidia/toolkit/nvidia-cdi-hook"
    assert [h.path for h in edits.hooks] == []  # not at the default path: cdi-hook-path says where
    backend = make_backend(
        fake, real_dev_dir=True, cdi_mode="own", driver_root="/run/nvidia/driver", cdi_hook_path=hook_path
    )
    await backend.start()
    edits = await backend.prepare("gpu-2", CLAIM)
    await backend.stop()
    assert [h.path for h in edits.hooks] == [hook_path, hook_path]
    spec_of(edits)


async def test_without_the_hook_binary_the_links_are_mounted_and_a_warning_says_why(
    make_backend: BackendFactory, fake: LibNvml, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    make_dev(tmp_path / "dev", ["nvidia2", "nvidiactl"])
    make_driver_root(tmp_path / "host", hook=None)
    with caplog.at_level(logging.WARNING):
        edits = await prepared(make_backend, fake, "gpu-2", cdi_mode="own")
    assert edits.hooks == ()
    targets = {m.container_path for m in edits.mounts}
    # libcuda.so.1 (the SONAME a CUDA program loads) and libcuda.so exist without ldconfig.
    assert {f"{LIB}/libcuda.so.1", f"{LIB}/libcuda.so", f"{LIB}/libcuda.so.{VERSION}"} <= targets
    assert f"{LIB}/libnvidia-ml.so.1" in targets and f"{LIB}/libGLX_nvidia.so.0" in targets
    assert f"{LIB}/libz.so.1" not in targets  # not the driver's
    fields = logged(caplog.records, "nvidia-cdi-hook not found")
    assert fields["hook_path"] == HOOK and fields["library_dirs"] == f"{LIB},{LIB}/vdpau"
    assert "install nvidia-container-toolkit-base" in str(fields["hint"])
    spec_of(edits)


async def test_nvidia_ctk_as_the_hook_takes_the_hook_subcommand(tmp_path: Path) -> None:
    """Toolkits before 1.16 have no nvidia-cdi-hook: ``nvidia-ctk hook update-ldcache``."""
    make_driver_root(tmp_path, hook="usr/bin/nvidia-ctk")
    files = find_driver_files(HostView(tmp_path), "/", "/usr/bin/nvidia-ctk")
    assert files.hooks[0].args[:3] == ("nvidia-ctk", "hook", "update-ldcache")


async def test_missing_driver_libraries_are_reported(
    make_backend: BackendFactory, fake: LibNvml, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    make_dev(tmp_path / "dev", ["nvidia2", "nvidiactl"])
    with caplog.at_level(logging.WARNING):
        edits = await prepared(make_backend, fake, "gpu-2", cdi_mode="own")
    assert edits.mounts == () and edits.hooks == ()
    fields = logged(caplog.records, "NVIDIA driver libraries missing under the driver root")
    assert fields["missing"] == "libcuda.so,libnvidia-ml.so"
    assert "set driver-root" in str(fields["hint"])
    spec_of(edits)


def test_driver_version_and_unversioned_driver_root(tmp_path: Path) -> None:
    make_driver_root(tmp_path)
    assert driver_version(tmp_path / LIBDIR) == VERSION
    bare = tmp_path / "bare" / LIBDIR
    bare.mkdir(parents=True)
    (bare / "libnvidia-ml.so.1").touch()  # no versioned file: nothing can be matched
    files = find_driver_files(HostView(tmp_path / "bare"), "/", HOOK)
    assert files.version == "" and files.mounts == () and files.missing == ("libcuda.so", "libnvidia-ml.so")
    assert files.hooks == ()  # no hook binary in that tree


async def test_own_mode_mig_device_gets_capability_nodes(
    make_backend: BackendFactory, fake: LibNvml, tmp_path: Path
) -> None:
    make_dev(
        tmp_path / "dev", ["nvidia0", "nvidiactl", "nvidia-caps/nvidia-cap21", "nvidia-caps/nvidia-cap22"]
    )
    make_caps(tmp_path / "proc", gpu=0, gi=2, ci=0, gi_minor=21, ci_minor=22)
    edits = await prepared(make_backend, fake, MIG, cdi_mode="own")
    assert [n.path for n in edits.device_nodes] == [
        "/dev/nvidia0",
        "/dev/nvidiactl",
        "/dev/nvidia-caps/nvidia-cap21",
        "/dev/nvidia-caps/nvidia-cap22",
    ]
    # The capability nodes select the MIG device, as in NVIDIA's DRA driver (no MIG UUID in the env).
    assert dict(edits.env) == {"NVIDIA_VISIBLE_DEVICES": "void"}
    spec_of(edits, "uid-1-gpu-0-mig-3g40gb-9-4")


async def test_missing_required_node_fails_clearly(
    make_backend: BackendFactory, fake: LibNvml, tmp_path: Path
) -> None:
    make_dev(tmp_path / "dev", ["nvidiactl"])
    with pytest.raises(BackendError, match=r"nvidia2 is missing: load the NVIDIA driver"):
        await prepared(make_backend, fake, "gpu-2", cdi_mode="own")


async def test_missing_optional_nodes_are_skipped(
    make_backend: BackendFactory, fake: LibNvml, tmp_path: Path
) -> None:
    make_dev(tmp_path / "dev", ["nvidia3", "nvidiactl"])
    edits = await prepared(make_backend, fake, "gpu-3", cdi_mode="own")
    assert [n.path for n in edits.device_nodes] == ["/dev/nvidia3", "/dev/nvidiactl"]


async def test_missing_mig_capability_file(
    make_backend: BackendFactory, fake: LibNvml, tmp_path: Path
) -> None:
    make_dev(tmp_path / "dev", ["nvidia0", "nvidiactl"])
    with pytest.raises(BackendError, match=r"cannot read MIG capability file .*gi2/access.*mount the host's"):
        await prepared(make_backend, fake, MIG, cdi_mode="own")


def test_capability_file_without_minor(tmp_path: Path) -> None:
    base = tmp_path / "driver" / "nvidia" / "capabilities" / "gpu0" / "mig" / "gi1"
    (base / "ci0").mkdir(parents=True)
    (base / "access").write_text("DeviceFileMode: 292\n")
    with pytest.raises(BackendError, match="no DeviceFileMinor"):
        mig_capability_minors(tmp_path, 0, 1, 0)


async def test_unknown_device(make_backend: BackendFactory, fake: LibNvml) -> None:
    with pytest.raises(DeviceNotFoundError, match="gpu-9"):
        await prepared(make_backend, fake, "gpu-9")


def test_character_device_node_is_read_from_the_host() -> None:
    node = _device_node(DevDir(Path("/dev"), "/dev"), "null", required=True)
    assert node == DeviceNode("/dev/null", "", "c", 1, 3, "rw")
    spec_of(ContainerEdits(device_nodes=(node,)))


def test_dev_dir_of_a_containerized_driver(tmp_path: Path) -> None:
    host = HostView(tmp_path)
    assert resolve_dev_dir(host, "/") == DevDir(Path("/dev"), "/dev")
    assert resolve_dev_dir(host, "/run/nvidia/driver") == DevDir(Path("/dev"), "/dev")
    make_dev(tmp_path / "run/nvidia/driver/dev", ["nvidiactl"])
    assert resolve_dev_dir(host, "/run/nvidia/driver") == DevDir(
        tmp_path / "run/nvidia/driver/dev", "/run/nvidia/driver/dev"
    )


async def test_an_unreadable_driver_root_leaves_device_nodes_only(
    make_backend: BackendFactory,
    fake: LibNvml,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    make_dev(tmp_path / "dev", ["nvidia2", "nvidiactl"])

    def unreadable(*args: object) -> None:
        raise PermissionError(13, "Permission denied", "/host/usr/lib/x86_64-linux-gnu")

    monkeypatch.setattr("backends.nvidia.backend.find_driver_files", unreadable)
    with caplog.at_level(logging.WARNING):
        edits = await prepared(make_backend, fake, "gpu-2", cdi_mode="own")
    assert edits.mounts == () and [n.path for n in edits.device_nodes] == ["/dev/nvidia2", "/dev/nvidiactl"]
    assert "Permission denied" in str(logged(caplog.records, "cannot read the NVIDIA driver root")["error"])
    logged(caplog.records, "NVIDIA driver libraries missing under the driver root")


def test_host_view_follows_the_hosts_symlinks_inside_its_root(tmp_path: Path) -> None:
    (tmp_path / "run/cdi").mkdir(parents=True)
    (tmp_path / "usr/lib").mkdir(parents=True)
    (tmp_path / "var").mkdir()
    (tmp_path / "var/run").symlink_to("/run")  # absolute: a host path
    (tmp_path / "lib").symlink_to("usr/lib")  # relative
    (tmp_path / "loop").symlink_to("loop")
    host = HostView(tmp_path)
    assert host.view("/var/run/cdi") == tmp_path / "run/cdi"
    assert host.view("/lib/libcuda.so.1") == tmp_path / "usr/lib/libcuda.so.1"
    assert host.view("/usr/../var/run") == tmp_path / "run"
    assert host.view("/") == tmp_path
    assert host.view("/loop/x") == tmp_path / "loop/x"  # bounded: reading it then fails
    assert HostView().view("/var/run/cdi") == Path("/var/run/cdi")
