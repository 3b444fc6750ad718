"""Container edits for one AMD GPU or partition: /dev/kfd and its DRM card and render nodes.

Type, major and minor are read from the host's device nodes at prepare time (never cached: they
can change across reboots and driver reloads). `dev_root` is where the host's /dev is visible to
the agent; the paths in the edits stay host paths (``/dev/...``) because the container runtime
resolves them on the host.

No environment: the device nodes are what a container has, as in AMD's DRA driver (per-claim specs
of device nodes only, ROCm/k8s-gpu-dra-driver ``cmd/gpu-kubeletplugin/cdi.go``). A per-claim
``AMD_VISIBLE_DEVICES``, ``ROCR_VISIBLE_DEVICES`` or ``HIP_VISIBLE_DEVICES`` would hide the other
claims' GPUs in a container with several claims: CDI keeps the last claim's value of a variable
(container-device-interface ``internal/ociedit/spec_editor.go``), and ROCm enumerates only the
GPUs those variables list when they are set.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable

import anyio.to_thread

from agent.core.backend import ContainerEdits, DeviceNode
from agent.core.errors import BackendError

KFD = "kfd"

StatFn = Callable[[str], os.stat_result]


def _node(dev_root: str, relative: str, stat_fn: StatFn) -> DeviceNode:
    """Stat one device node (blocking) and describe it for CDI."""
    path = os.path.join(dev_root, relative)
    try:
        info = stat_fn(path)
    except FileNotFoundError as error:
        raise BackendError(
            f"amd backend: device node {path} does not exist: is the amdgpu driver loaded and is the host's "
            "/dev mounted into the agent (set dev-root= when it is mounted elsewhere)?"
        ) from error
    except OSError as error:
        raise BackendError(f"amd backend: cannot read device node {path}: {error}") from error
    if stat.S_ISCHR(info.st_mode):
        kind = "c"
    elif stat.S_ISBLK(info.st_mode):
        kind = "b"
    else:
        raise BackendError(
            f"amd backend: {path} is not a device node; check that the host's /dev is mounted at the dev-root"
        )
    container_path = "/dev/" + relative
    return DeviceNode(
        path=container_path,
        type=kind,
        major=os.major(info.st_rdev),
        minor=os.minor(info.st_rdev),
        permissions="rw",
    )


def read_edits(dev_root: str, card: int, render: int, stat_fn: StatFn = os.stat) -> ContainerEdits:
    """The edits for DRM card `card` and render node `render` (blocking)."""
    nodes = (
        _node(dev_root, KFD, stat_fn),
        _node(dev_root, f"dri/card{card}", stat_fn),
        _node(dev_root, f"dri/renderD{render}", stat_fn),
    )
    return ContainerEdits(device_nodes=nodes)


async def container_edits(dev_root: str, card: int, render: int, stat_fn: StatFn = os.stat) -> ContainerEdits:
    """`read_edits` in a worker thread."""
    return await anyio.to_thread.run_sync(read_edits, dev_root, card, render, stat_fn)
