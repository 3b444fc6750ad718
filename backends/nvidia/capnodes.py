"""MIG capability device nodes (``/dev/nvidia-caps/nvidia-cap<N>``) of a MIG device created at prepare.

A process needs the capability nodes of its GPU instance and compute instance to use a MIG
device. The driver publishes each capability as
``/proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<G>[/ci<C>]/access`` holding
``DeviceFileMinor``, ``DeviceFileMode`` (292 = 0o444) and ``DeviceFileModify``, and the node is
a character device of the ``nvidia-caps`` major (``/proc/devices``). The driver does not make the
node itself: ``nvidia-modprobe`` does, with that mode, when ``DeviceFileModify`` is 1 (and the
NVIDIA Container Toolkit's ``nvidia-ctk system create-device-nodes`` does the same from
``/proc/driver/nvidia-caps/mig-minors``). A MIG device created by NVML at prepare may therefore
have no node yet; `ensure_cap_nodes` makes the missing ones, as ``nvidia-modprobe`` would.
Nodes are left in place at unprepare: the minor of a capability never changes, and
``nvidia-modprobe`` leaves them too.

Blocking file I/O: run in a worker thread.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from agent.core.errors import BackendError
from agent.core.logs import log_fields

log = logging.getLogger("agent.backends.nvidia")

CAPS_DEVICE = "nvidia-caps"
CAPS_DIR = "nvidia-caps"
DEFAULT_CAP_MODE = 0o444
_FIELD = re.compile(r"^(DeviceFileMinor|DeviceFileMode|DeviceFileModify):\s*(\d+)\s*$", re.MULTILINE)


class CapNodeError(BackendError):
    """A MIG capability node is missing and cannot be made; the message says what to do."""


class NodeMaker(Protocol):
    """Makes a character device node at `path` (``os.mknod`` semantics: `mode` holds the type bits)."""

    def __call__(self, path: Path, mode: int, device: int) -> None: ...


def mknod(path: Path, mode: int, device: int) -> None:
    """``os.mknod`` then ``chmod`` (the umask must not narrow the driver's mode)."""
    os.mknod(path, mode, device)
    os.chmod(path, stat.S_IMODE(mode))


@dataclass(frozen=True)
class CapFile:
    """One capability ``access`` file of the driver."""

    path: Path
    minor: int
    mode: int = DEFAULT_CAP_MODE
    modify: bool = True
    """False (``DeviceFileModify: 0``, ``NVreg_ModifyDeviceFiles=0``): the administrator makes the nodes."""


def cap_files(proc_root: Path, gpu_minor: int, gi: int, ci: int) -> list[CapFile]:
    """The GPU instance's then the compute instance's capability file; raises `CapNodeError`."""
    base = proc_root / "driver" / "nvidia" / "capabilities" / f"gpu{gpu_minor}" / "mig" / f"gi{gi}"
    return [read_cap_file(base / "access"), read_cap_file(base / f"ci{ci}" / "access")]


def read_cap_file(path: Path) -> CapFile:
    try:
        content = path.read_text()
    except OSError as error:
        raise CapNodeError(
            f"NVIDIA backend: cannot read MIG capability file {path}: {error}: mount the host's "
            "/proc/driver/nvidia into the agent, and check that the MIG device still exists "
            "(nvidia-smi mig -lgi)"
        ) from error
    fields = {name: int(value) for name, value in _FIELD.findall(content)}
    if "DeviceFileMinor" not in fields:
        raise CapNodeError(f"NVIDIA backend: {path} has no DeviceFileMinor line: is the driver too old?")
    return CapFile(
        path,
        fields["DeviceFileMinor"],
        stat.S_IMODE(fields.get("DeviceFileMode", DEFAULT_CAP_MODE)),
        fields.get("DeviceFileModify", 1) != 0,
    )


def caps_major(proc_root: Path) -> int:
    """The ``nvidia-caps`` character-device major from ``/proc/devices``; raises `CapNodeError`."""
    path = proc_root / "devices"
    try:
        content = path.read_text()
    except OSError as error:
        raise CapNodeError(f"NVIDIA backend: cannot read {path}: {error}: mount the host's /proc") from error
    in_chars = False
    for line in content.splitlines():
        if line.strip().endswith(":"):
            in_chars = line.strip() == "Character devices:"
            continue
        parts = line.split()
        if in_chars and len(parts) == 2 and parts[1] == CAPS_DEVICE and parts[0].isdigit():
            return int(parts[0])
    raise CapNodeError(
        f"NVIDIA backend: {path} lists no '{CAPS_DEVICE}' character device: the NVIDIA driver does not "
        "expose MIG capabilities (load the nvidia module with MIG support, or run "
        "'nvidia-modprobe -f /proc/driver/nvidia/capabilities/mig/config' on the host)"
    )


def ensure_cap_nodes(
    proc_root: Path, dev_view: Path, gpu_minor: int, gi: int, ci: int, *, make: NodeMaker = mknod
) -> list[Path]:
    """Make the missing capability nodes of one MIG device under `dev_view`; returns those made.

    Raises `CapNodeError` naming the node and the fix when one is missing and cannot be made.
    """
    made: list[Path] = []
    major: int | None = None
    for cap in cap_files(proc_root, gpu_minor, gi, ci):
        node = dev_view / CAPS_DIR / f"nvidia-cap{cap.minor}"
        if node.exists():
            continue
        if not cap.modify:
            raise CapNodeError(
                f"NVIDIA backend: MIG capability node {node} is missing and {cap.path} says the driver "
                "must not create it (DeviceFileModify: 0, NVreg_ModifyDeviceFiles=0): create the "
                "/dev/nvidia-caps nodes on the host, or let the driver modify device files"
            )
        if major is None:
            major = caps_major(proc_root)
        try:
            node.parent.mkdir(mode=0o755, exist_ok=True)
            make(node, stat.S_IFCHR | cap.mode, os.makedev(major, cap.minor))
        except FileExistsError:
            continue  # made by someone else meanwhile (nvidia-modprobe): as good
        except OSError as error:
            raise CapNodeError(
                f"NVIDIA backend: cannot create MIG capability node {node} (char {major}:{cap.minor}): "
                f"{error}: the agent needs CAP_MKNOD and the host's /dev mounted read-write (the chart "
                "runs it privileged), or create the node on the host with 'nvidia-modprobe -f "
                f"{cap.path}'"
            ) from error
        made.append(node)
        log.info(
            "created MIG capability device node",
            extra=log_fields(path=str(node), major=major, minor=cap.minor, mode=oct(cap.mode)),
        )
    return made
