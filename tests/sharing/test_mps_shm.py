"""MPS clients and their control daemon share a dedicated ``/dev/shm`` (issue 15 follow-up).

NVIDIA's DRA driver mounts a tmpfs as its MPS control daemon container's ``/dev/shm`` and the
same tmpfs at ``/dev/shm`` in each client container (its MPS control-daemon templates and
``sharing.go``). Ours: a ``shm/`` directory per daemon, a tmpfs when the agent can mount one,
told to the daemon in its environment and mounted at ``/dev/shm`` in each client's CDI spec.
"""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio.to_thread
import pytest
import yaml

from backends.fake.sharing import FakeMpsProgram
from backends.nvidia.mps import SHM_ENV, MpsDaemons, NoMounter, ShmMounter, TmpfsMounter
from backends.nvidia.sharingconfig import MpsSettings
from tests.kubelet.fakes import FakeClaimSource
from tests.sharing.helpers import (
    MPS,
    NVIDIA,
    claim,
    daemon_state,
    device_state,
    fake_backend,
    mps_dir,
    ref,
    share,
    uid,
)


def spec_mounts(root: Path, claim_uid: str) -> list[dict[str, Any]]:
    spec = yaml.safe_load((root / "cdi" / f"k8s.{NVIDIA}-claim_{claim_uid}.yaml").read_text())
    mounts: list[dict[str, Any]] = []
    for device in spec["devices"]:
        mounts += device["containerEdits"].get("mounts", [])
    return mounts


async def test_clients_and_daemon_get_the_daemons_shm_directory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    c1 = claim(1, share_id=share(1), memory="20Gi", config=MPS)
    c2 = claim(2, share_id=share(2), memory="30Gi", config=MPS)
    state = device_state(tmp_path, FakeClaimSource([c1, c2]), fake_backend(tmp_path))
    await state.start()
    with caplog.at_level(logging.INFO, logger="agent.nvidia.mps"):
        results = await state.prepare([ref(c1), ref(c2)])
    assert [r.error for r in results.values()] == ["", ""]
    shm = mps_dir(tmp_path) / "shm"
    assert shm.is_dir()
    recorded = daemon_state(tmp_path)
    assert recorded is not None and recorded["shmDirectory"] == str(shm)
    for n in (1, 2):
        shm_mounts = [m for m in spec_mounts(tmp_path, uid(n)) if m["containerPath"] == "/dev/shm"]
        assert shm_mounts == [
            {"hostPath": str(shm), "containerPath": "/dev/shm", "options": ["rw", "nosuid", "nodev", "bind"]}
        ]
    plain = [r for r in caplog.records if "plain directory, not a tmpfs" in r.getMessage()]
    assert len(plain) == 1, "one line per daemon start, not per claim"
    assert await state.unprepare([ref(c1), ref(c2)]) == {uid(1): "", uid(2): ""}
    assert not mps_dir(tmp_path).exists()


class RecordingMounter:
    """Mounts nothing; records what it was asked and says a tmpfs is there."""

    def __init__(self, reason: str = "") -> None:
        self.reason = reason
        self.calls: list[tuple[str, Path]] = []

    def mount(self, path: Path) -> str:
        self.calls.append(("mount", path))
        return self.reason

    def unmount(self, path: Path) -> None:
        self.calls.append(("unmount", path))

    def wrap(self, argv: list[str], path: Path) -> list[str]:
        self.calls.append(("wrap", path))
        return argv


async def test_a_mounted_tmpfs_is_unmounted_when_the_daemon_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    mounter = RecordingMounter()
    daemons = MpsDaemons(tmp_path / "mps", FakeMpsProgram(), mounter)
    shm = daemons.directory("gpu-0") / "shm"
    # ismount cannot be faked by the mounter: stand in for the kernel's answer.
    monkeypatch.setattr("os.path.ismount", lambda path: Path(path) == shm and ("mount", shm) in mounter.calls)
    with caplog.at_level(logging.INFO, logger="agent.nvidia.mps"):
        assert await daemons.ensure("gpu-0", "GPU-1", MpsSettings())
    assert not [r for r in caplog.records if "not a tmpfs" in r.getMessage()]
    assert daemons.env("gpu-0", "GPU-1")[SHM_ENV] == str(shm)
    await daemons.stop("gpu-0")
    assert mounter.calls == [("mount", shm), ("wrap", shm), ("unmount", shm)]
    assert not daemons.directory("gpu-0").exists()


async def test_tmpfs_refused_leaves_a_plain_directory_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mounter = RecordingMounter("mount: permission denied")
    daemons = MpsDaemons(tmp_path / "mps", FakeMpsProgram(), mounter)
    with caplog.at_level(logging.INFO, logger="agent.nvidia.mps"):
        assert await daemons.ensure("gpu-0", "GPU-1", MpsSettings())
    try:
        (line,) = [r for r in caplog.records if "not a tmpfs" in r.getMessage()]
        assert getattr(line, "fields", {})["reason"] == "mount: permission denied"
        assert (daemons.directory("gpu-0") / "shm").is_dir()
    finally:
        await daemons.stop("gpu-0")
    assert mounter.calls == [("mount", daemons.directory("gpu-0") / "shm")]


def test_a_mounted_tmpfs_becomes_the_daemons_own_dev_shm(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``unshare`` the daemon runs in its own mount namespace with the tmpfs bound over its
    /dev/shm, and exec keeps the daemon's pid (the one the record names)."""
    monkeypatch.setattr("shutil.which", lambda name: f"/usr/bin/{name}")
    argv = TmpfsMounter().wrap(["/usr/bin/nvidia-cuda-mps-control", "-f"], Path("/state/mps/gpu-0/shm"))
    assert argv[:5] == ["/usr/bin/unshare", "--mount", "--propagation", "private", "--"]
    assert argv[5:7] == ["sh", "-c"]
    assert "mount --bind" in argv[7] and "exec" in argv[7]
    assert argv[8:] == ["/state/mps/gpu-0/shm", "/usr/bin/nvidia-cuda-mps-control", "-f"]


def test_without_unshare_the_daemon_is_started_as_is_and_it_is_said(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr("shutil.which", lambda name: None)
    with caplog.at_level(logging.WARNING, logger="agent.nvidia.mps"):
        argv = TmpfsMounter().wrap(["mps", "-f"], Path("/s/shm"))
    assert argv == ["mps", "-f"]
    assert any("unshare not found" in r.getMessage() for r in caplog.records)


CLIENT_UID = 1000
AS_CLIENT = """
import os, sys
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)  # as root: the container sees only this directory
os.setgroups([])
os.setresgid({uid}, {uid}, {uid})
os.setresuid({uid}, {uid}, {uid})
assert os.geteuid() == {uid}
try:
    os.close(os.open("segment-{uid}", os.O_CREAT | os.O_WRONLY, 0o600, dir_fd=fd))
except OSError as error:
    sys.exit(f"uid {uid}: {{error}}")
"""


def create_as(uid: int, directory: Path) -> subprocess.CompletedProcess[str]:
    """A child that drops to `uid` (as a container's non-root user) and creates a file in `directory`.

    It opens `directory` before dropping root, as a bind mount hands a container the directory
    without the host path above it (pytest's base temp dir is 0700)."""
    return subprocess.run(
        [sys.executable, "-c", AS_CLIENT.format(uid=uid), str(directory)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


@pytest.fixture
def strict_umask() -> Iterator[None]:
    """The agent may run with any umask: 077 makes a plain mkdir 0700."""
    old = os.umask(0o077)
    yield
    os.umask(old)


def _tmpfs_or_skip(path: Path) -> ShmMounter:
    path.mkdir()
    mounter = TmpfsMounter()
    if reason := mounter.mount(path):
        pytest.skip(f"cannot mount a tmpfs here: {reason}")
    mounter.unmount(path)
    return mounter


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another uid needs root")
@pytest.mark.parametrize("mounted", [False, True], ids=["plain-directory", "tmpfs"])
async def test_a_non_root_client_can_create_shared_memory(
    tmp_path: Path, strict_umask: None, mounted: bool
) -> None:
    """Issue 24 point 5: a container running as uid 1000 could not create /dev/shm segments."""
    mounter: ShmMounter = _tmpfs_or_skip(tmp_path / "probe") if mounted else NoMounter()
    daemons = MpsDaemons(tmp_path / "mps", FakeMpsProgram(), mounter)
    assert await daemons.ensure("gpu-0", "GPU-1", MpsSettings())
    shm = daemons.directory("gpu-0") / "shm"
    try:
        assert await anyio.to_thread.run_sync(os.path.ismount, shm) is mounted
        made = create_as(CLIENT_UID, shm)
        assert made.returncode == 0, made.stderr
        assert stat.S_IMODE(shm.stat().st_mode) == 0o1777, "world-writable and sticky, as /dev/shm"
        assert (shm / f"segment-{CLIENT_UID}").stat().st_uid == CLIENT_UID
        other = create_as(CLIENT_UID + 1, shm)  # a second client uid of the same daemon
        assert other.returncode == 0, other.stderr
    finally:
        await daemons.stop("gpu-0")
    assert not daemons.directory("gpu-0").exists()
