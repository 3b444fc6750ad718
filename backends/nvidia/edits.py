"""Container edits for a prepared NVIDIA device, in the CDI modes (see the package docstring).

- ``own``: the device nodes (``/dev/nvidia<minor>``, ``/dev/nvidiactl``, ``/dev/nvidia-uvm``,
  ``/dev/nvidia-uvm-tools``, ``/dev/nvidia-modeset``, MIG capability nodes) and the driver's files
  with the toolkit's hooks (`backends.nvidia.driverfiles`).
- ``toolkit``: the NVIDIA Container Toolkit's own CDI device ``nvidia.com/gpu=<uuid>``; the
  toolkit's spec carries nodes, libraries and hooks.
- ``auto``: ``toolkit`` when the toolkit's spec names the GPU by UUID, else ``own``.

Both set ``NVIDIA_VISIBLE_DEVICES=void``, never a device list: CDI device nodes say which GPUs a
container has. A container with several claims gets each claim's spec in turn, and CDI keeps the
last value of a variable (``addEnv`` in container-device-interface
``internal/ociedit/spec_editor.go``), so a per-claim list would leave only the last claim's GPUs
in it. ``void`` is what NVIDIA's DRA driver sets in every claim spec (the common edits of
nvidia-container-toolkit ``pkg/nvcdi/wrapper.go``): the toolkit's runtime and legacy hook then
inject nothing of their own (``NewVisibleDevices`` in ``internal/config/image/devices.go``), and
an image's ``NVIDIA_VISIBLE_DEVICES=all`` (CUDA base images set it) cannot add every GPU of the
node. CUDA, with no ``CUDA_VISIBLE_DEVICES``, uses every GPU whose nodes it can open.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from agent.core.backend import ContainerEdits, DeviceNode
from agent.core.errors import BackendError
from agent.core.logs import log_fields
from backends.nvidia.capnodes import cap_files
from backends.nvidia.discovery import NvDevice
from backends.nvidia.driverfiles import DEFAULT_HOOK_PATH, DriverFiles, HostView
from backends.nvidia.toolkitspec import TOOLKIT_KIND

log = logging.getLogger("agent.backends.nvidia")

AUTO, OWN, TOOLKIT = "auto", "own", "toolkit"
CDI_MODES = (AUTO, OWN, TOOLKIT)
VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
VOID = "void"
"""The toolkit's "not a GPU request" value: identical in every claim's spec, so any order composes."""


@dataclass(frozen=True)
class DevDir:
    """Where device nodes are: `view` as the agent sees it, `host` as the runtime does."""

    view: Path
    host: str


@dataclass(frozen=True)
class EditsConfig:
    """Where things are on the host; the roots are injectable for tests.

    `driver_root` and `hook_path` are host paths; `host` maps them to the agent's view.
    """

    mode: str = AUTO
    driver_root: str = "/"
    host: HostView = field(default_factory=HostView)
    dev: DevDir = field(default_factory=lambda: DevDir(Path("/dev"), "/dev"))
    proc_root: Path = Path("/proc")
    hook_path: str = DEFAULT_HOOK_PATH


def _device_node(dev: DevDir, name: str, required: bool) -> DeviceNode | None:
    view = dev.view / name
    container = f"/dev/{name}"
    host = str(PurePosixPath(dev.host) / name)
    try:
        info = os.stat(view)
    except OSError:
        if required:
            raise BackendError(
                f"NVIDIA backend: device node {view} is missing: load the NVIDIA driver "
                "(nvidia-smi creates the nodes), or mount the host's /dev into the agent"
            ) from None
        log.debug("optional device node missing", extra=log_fields(path=str(view)))
        return None
    host_path = "" if host == container else host
    if stat.S_ISCHR(info.st_mode):
        return DeviceNode(
            container, host_path, "c", os.major(info.st_rdev), os.minor(info.st_rdev), permissions="rw"
        )
    # Not a character device (a test tree): let the runtime read the host node.
    return DeviceNode(container, host_path, permissions="rw")


def mig_capability_minors(proc_root: Path, gpu_minor: int, gi: int, ci: int) -> list[int]:
    """Minors of ``/dev/nvidia-caps/nvidia-cap<N>`` giving access to one GPU/compute instance."""
    return [cap.minor for cap in cap_files(proc_root, gpu_minor, gi, ci)]


def resolve_dev_dir(host: HostView, driver_root: str) -> DevDir:
    """Device nodes live under a containerized driver's root when it made them, else in /dev.

    The host's /dev is mounted at /dev in the agent (the chart does), so that view is used for it.
    """
    if driver_root not in ("", "/"):
        candidate = PurePosixPath(driver_root) / "dev"
        if (host.view(candidate) / "nvidiactl").exists():
            return DevDir(host.view(candidate), str(candidate))
    return DevDir(Path("/dev"), "/dev")


def toolkit_edits(device: NvDevice) -> ContainerEdits:
    """``nvidia.com/gpu=<uuid>``: the toolkit's spec carries everything else."""
    return ContainerEdits(
        env={VISIBLE_DEVICES: VOID},
        cdi_device_ids=(f"{TOOLKIT_KIND}={device.uuid}",),
    )


def own_edits(device: NvDevice, config: EditsConfig, files: DriverFiles) -> ContainerEdits:
    """Our own edits for `device` (blocking file reads: run in a worker thread)."""
    nodes: list[DeviceNode] = []
    for name, required in (
        (f"nvidia{device.gpu.minor}", True),
        ("nvidiactl", True),
        ("nvidia-uvm", False),
        ("nvidia-uvm-tools", False),
        ("nvidia-modeset", False),
    ):
        node = _device_node(config.dev, name, required)
        if node is not None:
            nodes.append(node)
    if device.mig is not None:
        for minor in mig_capability_minors(
            config.proc_root, device.gpu.minor, device.mig.gpu_instance_id, device.mig.compute_instance_id
        ):
            node = _device_node(config.dev, f"nvidia-caps/nvidia-cap{minor}", True)
            if node is not None:
                nodes.append(node)
    return ContainerEdits(
        device_nodes=tuple(nodes),
        env={VISIBLE_DEVICES: VOID},
        mounts=files.mounts,
        hooks=files.hooks,
    )
