"""MIG capability device nodes of a MIG device created at prepare (`backends.nvidia.capnodes`).

The driver publishes ``/proc/driver/nvidia/capabilities/gpu<N>/mig/gi<G>[/ci<C>]/access``
(``DeviceFileMinor``, ``DeviceFileMode: 292``, ``DeviceFileModify``) but does not make
``/dev/nvidia-caps/nvidia-cap<minor>``: ``nvidia-modprobe`` does, and the NVIDIA Container
Toolkit's ``internal/nvcaps/nvcaps.go`` and ``internal/system/nvdevices`` (``createMigDeviceNodes``:
the ``nvidia-caps`` major from ``/proc/devices``, one char node per capability minor) do the same.
The stand-in libnvidia-ml with ``make_nodes=False`` behaves as the driver alone.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from agent.core.backend import ClaimRef, ContainerEdits
from agent.core.errors import BackendError
from backends.nvidia.capnodes import (
    CapNodeError,
    NodeMaker,
    caps_major,
    ensure_cap_nodes,
    mknod,
    read_cap_file,
)
from backends.nvidia.migjournal import MigEntry, MigJournal
from tests.fakes.libnvml import MigLibNvml, dynamic_gpu
from tests.nvidia.conftest import BackendFactory

CLAIM = ClaimRef("default", "claim-1", "uid-1")
PLACEMENT = "gpu-0-mig-3g40gb-9-4"
CAPS_MAJOR = 238
PROC_DEVICES = f"Character devices:\n195 nvidia\n{CAPS_MAJOR} nvidia-caps\n\nBlock devices:\n  7 loop\n"


class Recorder:
    """A `NodeMaker` for tests that cannot mknod: records the call and leaves a plain file."""

    def __init__(self, error: OSError | None = None) -> None:
        self.calls: list[tuple[Path, int, int]] = []
        self.error = error

    def __call__(self, path: Path, mode: int, device: int) -> None:
        self.calls.append((path, mode, device))
        if self.error is not None:
            raise self.error
        path.touch()


@pytest.fixture
def nvml(tmp_path: Path) -> MigLibNvml:
    """A dynamic A100-80GB whose driver makes capability files but no capability nodes."""
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidiactl", "nvidia0"):
        (dev / name).touch()
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "devices").write_text(PROC_DEVICES)
    return MigLibNvml(
        [dynamic_gpu("NVIDIA A100-SXM4-80GB", 0)], proc_root=tmp_path / "proc", dev_root=dev, make_nodes=False
    )


async def prepare(
    make_backend: BackendFactory, nvml: MigLibNvml, tmp_path: Path, maker: NodeMaker
) -> tuple[ContainerEdits | None, BackendError | None]:
    backend = make_backend(
        nvml, cdi_mode="own", dynamic_mig="true", dynamic_mig_dir=str(tmp_path / "state"), make_node=maker
    )
    await backend.start()
    await backend.discover()
    try:
        return await backend.prepare(PLACEMENT, CLAIM), None
    except BackendError as error:
        return None, error


def journal_entries(tmp_path: Path) -> list[MigEntry]:
    journal = MigJournal(tmp_path / "state" / "dynamic-mig-gpu.nvidia.com.json")
    journal.load()
    return list(journal.entries())


async def test_prepare_makes_the_missing_capability_nodes(
    make_backend: BackendFactory, nvml: MigLibNvml, tmp_path: Path
) -> None:
    maker = Recorder()
    edits, error = await prepare(make_backend, nvml, tmp_path, maker)
    assert error is None and edits is not None
    [mig] = nvml.gpus[0].migs
    gi_minor, ci_minor = (1000 + mig.gi_id * 8, 1000 + mig.gi_id * 8 + 1 + mig.ci_id)
    assert maker.calls == [
        (tmp_path / "dev" / "nvidia-caps" / f"nvidia-cap{m}", stat.S_IFCHR | 0o444, os.makedev(CAPS_MAJOR, m))
        for m in (gi_minor, ci_minor)
    ]
    paths = {n.path for n in edits.device_nodes}
    assert {f"/dev/nvidia-caps/nvidia-cap{gi_minor}", f"/dev/nvidia-caps/nvidia-cap{ci_minor}"} <= paths


async def test_existing_nodes_are_left_alone(
    make_backend: BackendFactory, nvml: MigLibNvml, tmp_path: Path
) -> None:
    nvml.make_nodes = True  # nvidia-modprobe made them
    maker = Recorder()
    _, error = await prepare(make_backend, nvml, tmp_path, maker)
    assert error is None and maker.calls == []


async def test_a_node_that_cannot_be_made_fails_the_claim_and_rolls_back(
    make_backend: BackendFactory, nvml: MigLibNvml, tmp_path: Path
) -> None:
    maker = Recorder(PermissionError(1, "Operation not permitted"))
    _, error = await prepare(make_backend, nvml, tmp_path, maker)
    assert isinstance(error, CapNodeError)
    assert "cannot create MIG capability node" in str(error) and "CAP_MKNOD" in str(error)
    assert f"char {CAPS_MAJOR}:" in str(error)
    assert nvml.gpus[0].migs == [] and journal_entries(tmp_path) == []


async def test_no_nvidia_caps_major_fails_the_claim_and_rolls_back(
    make_backend: BackendFactory, nvml: MigLibNvml, tmp_path: Path
) -> None:
    (tmp_path / "proc" / "devices").write_text("Character devices:\n195 nvidia\n\nBlock devices:\n7 loop\n")
    maker = Recorder()
    _, error = await prepare(make_backend, nvml, tmp_path, maker)
    assert isinstance(error, CapNodeError) and "lists no 'nvidia-caps'" in str(error)
    assert maker.calls == [] and nvml.gpus[0].migs == [] and journal_entries(tmp_path) == []


def write_cap(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_modify_zero_means_the_administrator_makes_the_nodes(tmp_path: Path) -> None:
    base = tmp_path / "proc" / "driver" / "nvidia" / "capabilities" / "gpu0" / "mig" / "gi1"
    write_cap(base / "access", "DeviceFileMinor: 12\nDeviceFileMode: 292\nDeviceFileModify: 0\n")
    write_cap(base / "ci0" / "access", "DeviceFileMinor: 13\nDeviceFileMode: 292\nDeviceFileModify: 0\n")
    maker = Recorder()
    with pytest.raises(CapNodeError, match=r"nvidia-cap12 is missing.*DeviceFileModify: 0"):
        ensure_cap_nodes(tmp_path / "proc", tmp_path / "dev", 0, 1, 0, make=maker)
    assert maker.calls == []


def test_cap_file_fields_and_defaults(tmp_path: Path) -> None:
    cap = read_cap_file(write_cap(tmp_path / "a", "DeviceFileMinor: 7\nDeviceFileMode: 438\n"))
    assert (cap.minor, cap.mode, cap.modify) == (7, 0o666, True)
    assert read_cap_file(write_cap(tmp_path / "b", "DeviceFileMinor: 8\n")).mode == 0o444
    with pytest.raises(CapNodeError, match="no DeviceFileMinor"):
        read_cap_file(write_cap(tmp_path / "c", "garbage\n"))
    with pytest.raises(CapNodeError, match="cannot read MIG capability file"):
        read_cap_file(tmp_path / "missing")


def test_caps_major_is_a_character_device(tmp_path: Path) -> None:
    (tmp_path / "devices").write_text("Character devices:\n 10 misc\n\nBlock devices:\n238 nvidia-caps\n")
    with pytest.raises(CapNodeError, match="lists no 'nvidia-caps'"):
        caps_major(tmp_path)
    (tmp_path / "devices").write_text(PROC_DEVICES)
    assert caps_major(tmp_path) == CAPS_MAJOR
    with pytest.raises(CapNodeError, match="cannot read"):
        caps_major(tmp_path / "nowhere")


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod of a character device needs root (CAP_MKNOD)")
async def test_as_root_the_nodes_are_real_character_devices(
    make_backend: BackendFactory, nvml: MigLibNvml, tmp_path: Path
) -> None:
    old = os.umask(0o077)  # a narrow umask must not narrow the driver's mode
    try:
        edits, error = await prepare(make_backend, nvml, tmp_path, mknod)
    finally:
        os.umask(old)
    assert error is None and edits is not None
    caps = [n for n in edits.device_nodes if "/nvidia-caps/" in n.path]
    assert len(caps) == 2
    for node in caps:
        info = os.stat(tmp_path / "dev" / node.path.removeprefix("/dev/"))
        assert stat.S_ISCHR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o444
        assert os.major(info.st_rdev) == CAPS_MAJOR
        assert (node.type, node.major, node.minor) == ("c", CAPS_MAJOR, os.minor(info.st_rdev))
