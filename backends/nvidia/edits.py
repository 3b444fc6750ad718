"""Container edits for a prepared NVIDIA device, in the two CDI modes (see the package docstring).

- ``own``: the device nodes (``/dev/nvidia<minor>``, ``/dev/nvidiactl``, ``/dev/nvidia-uvm``,
  ``/dev/nvidia-uvm-tools``, MIG capability nodes), ``NVIDIA_VISIBLE_DEVICES`` and bind mounts of
  the driver's user-space libraries (into ``/usr/local/nvidia/lib64``, on the CUDA images'
  ``LD_LIBRARY_PATH``) and ``nvidia-smi`` (``/usr/local/nvidia/bin``).
- ``toolkit``: the NVIDIA Container Toolkit's own CDI device ``nvidia.com/gpu=<uuid>`` plus
  ``NVIDIA_VISIBLE_DEVICES``; the toolkit's spec carries nodes, libraries and hooks.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from agent.core.backend import ContainerEdits, DeviceNode, Mount
from agent.core.errors import BackendError
from agent.core.logs import log_fields
from backends.nvidia.discovery import NvDevice
from backends.nvidia.nvml import find_library_dir

log = logging.getLogger("agent.backends.nvidia")

CDI_MODES = ("own", "toolkit")
TOOLKIT_KIND = "nvidia.com/gpu"
VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
CONTAINER_LIB_DIR = "/usr/local/nvidia/lib64"
CONTAINER_BIN_DIR = "/usr/local/nvidia/bin"
# User-space driver libraries a CUDA/NVML container needs (not the whole host library dir).
_DRIVER_LIBRARY = re.compile(
    r"^lib(cuda|cudadebugger|nvidia-[a-z0-9-]+|nvcuvid|nvoptix|nvidia-ml)\.so(\.[0-9.]+)?$"
)
_CAP_MINOR = re.compile(r"^DeviceFileMinor:\s*(\d+)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class EditsConfig:
    """Where things are on the host; the roots are injectable for tests."""

    mode: str = "own"
    driver_root: Path = Path("/")
    dev_root: Path = Path("/dev")
    proc_root: Path = Path("/proc")


def _device_node(dev_root: Path, name: str, required: bool) -> DeviceNode | None:
    host = dev_root / name
    container = f"/dev/{name}"
    try:
        info = os.stat(host)
    except OSError:
        if required:
            raise BackendError(
                f"NVIDIA backend: device node {host} is missing: load the NVIDIA driver "
                "(nvidia-smi creates the nodes), or mount the host's /dev into the agent"
            ) from None
        log.warning("optional device node missing", extra=log_fields(path=str(host)))
        return None
    host_path = "" if str(host) == container else str(host)
    if stat.S_ISCHR(info.st_mode):
        return DeviceNode(
            container, host_path, "c", os.major(info.st_rdev), os.minor(info.st_rdev), permissions="rw"
        )
    # Not a character device (a test tree): let the runtime read the host node.
    return DeviceNode(container, host_path, permissions="rw")


def mig_capability_minors(proc_root: Path, gpu_minor: int, gi: int, ci: int) -> list[int]:
    """Minors of ``/dev/nvidia-caps/nvidia-cap<N>`` giving access to one GPU/compute instance."""
    base = proc_root / "driver" / "nvidia" / "capabilities" / f"gpu{gpu_minor}" / "mig" / f"gi{gi}"
    minors: list[int] = []
    for access in (base / "access", base / f"ci{ci}" / "access"):
        try:
            content = access.read_text()
        except OSError as error:
            raise BackendError(
                f"NVIDIA backend: cannot read MIG capability file {access}: {error}: mount the host's "
                "/proc/driver/nvidia into the agent, and check that the MIG device still exists "
                "(nvidia-smi mig -lgi)"
            ) from error
        match = _CAP_MINOR.search(content)
        if match is None:
            raise BackendError(
                f"NVIDIA backend: {access} has no DeviceFileMinor line: is the driver too old?"
            )
        minors.append(int(match.group(1)))
    return minors


def resolve_dev_root(driver_root: Path, default: Path = Path("/dev")) -> Path:
    """Device nodes live under a containerized driver's root when it made them, else in /dev."""
    candidate = driver_root / "dev"
    if str(driver_root) not in ("", "/") and (candidate / "nvidiactl").exists():
        return candidate
    return default


def driver_mounts(driver_root: Path) -> tuple[Mount, ...]:
    """Bind mounts of the driver's user-space libraries and nvidia-smi (read-only)."""
    mounts: list[Mount] = []
    libdir = find_library_dir(driver_root)
    if libdir is not None:
        for entry in sorted(libdir.iterdir(), key=lambda p: p.name):
            if _DRIVER_LIBRARY.match(entry.name) and entry.exists():
                mounts.append(Mount(str(entry), f"{CONTAINER_LIB_DIR}/{entry.name}"))
    smi = driver_root / "usr" / "bin" / "nvidia-smi"
    if smi.exists():
        mounts.append(Mount(str(smi), f"{CONTAINER_BIN_DIR}/nvidia-smi"))
    return tuple(mounts)


def container_edits(
    device: NvDevice, config: EditsConfig, mounts: tuple[Mount, ...] | None = None
) -> ContainerEdits:
    """The edits a container needs for `device` (blocking file reads: run in a worker thread)."""
    env = {VISIBLE_DEVICES: device.uuid}
    list_env = frozenset({VISIBLE_DEVICES})
    if config.mode == "toolkit":
        return ContainerEdits(env=env, list_env=list_env, cdi_device_ids=(f"{TOOLKIT_KIND}={device.uuid}",))
    nodes: list[DeviceNode] = []
    for name, required in (
        (f"nvidia{device.gpu.minor}", True),
        ("nvidiactl", True),
        ("nvidia-uvm", False),
        ("nvidia-uvm-tools", False),
    ):
        node = _device_node(config.dev_root, name, required)
        if node is not None:
            nodes.append(node)
    if device.mig is not None:
        for minor in mig_capability_minors(
            config.proc_root, device.gpu.minor, device.mig.gpu_instance_id, device.mig.compute_instance_id
        ):
            node = _device_node(config.dev_root, f"nvidia-caps/nvidia-cap{minor}", True)
            if node is not None:
                nodes.append(node)
    return ContainerEdits(
        device_nodes=tuple(nodes),
        env=env,
        list_env=list_env,
        mounts=mounts if mounts is not None else driver_mounts(config.driver_root),
    )
