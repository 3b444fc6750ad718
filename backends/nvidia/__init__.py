"""The NVIDIA backend: GPUs and MIG devices through NVML (`pynvml`, package nvidia-ml-py).

Devices look like those of NVIDIA's own DRA driver (driver ``gpu.nvidia.com``, names
``gpu-<minor>`` and ``gpu-<minor>-mig-<profile without dots>-<giProfileId>-<placementStart>``,
the same attribute names), so existing DeviceClasses and CEL selectors keep working.

Settings (``--backend nvidia:key=value,...``):

- ``driver``: the DRA driver name (default ``gpu.nvidia.com``).
- ``driver-root``: where the driver's files are on the host: ``/`` (driver installed on the host,
  default) or ``/run/nvidia/driver`` (GPU Operator). NVML is loaded from there when present.
- ``host-root``: where the agent sees the host's ``/`` (default ``/``; the chart mounts it at
  ``/host``). The driver's files, the hook binary and the toolkit's CDI specs are read through it
  and named in our specs by their host paths, which the container runtime resolves.
- ``cdi-hook-path``: host path of the NVIDIA Container Toolkit's hook binary (default
  ``/usr/bin/nvidia-cdi-hook``; ``nvidia-ctk`` of toolkits before 1.16 works too).
- ``cdi-mode``: how containers get the GPU:

  * ``auto`` (default): ``toolkit`` for a GPU the toolkit's CDI spec names by UUID, else ``own``.
    Each start logs the mode it chose and why; every prepare checks the spec again (the GPU
    Operator may write it after the agent started, an old one may lack a GPU).
  * ``own``: our per-claim CDI spec carries the device nodes (``nvidia<minor>``, ``nvidiactl``,
    ``nvidia-uvm``, ``nvidia-uvm-tools``, ``nvidia-modeset``, MIG capability nodes),
    ``NVIDIA_VISIBLE_DEVICES=void`` (as NVIDIA's DRA driver: the toolkit's runtime adds nothing on
    top of CDI; claims in one container compose) and what the toolkit would mount
    (`backends.nvidia.driverfiles`):
    every driver library, the driver's binaries, EGL/Vulkan vendor files and IPC sockets, at their
    paths below the driver root, plus the toolkit's ``update-ldcache`` and ``create-symlinks``
    hooks when the hook binary is installed, so a plain image finds ``libcuda.so.1``.
  * ``toolkit``: return the toolkit's CDI device ``nvidia.com/gpu=<uuid>`` (and
    ``NVIDIA_VISIBLE_DEVICES=void``); the toolkit's spec (``nvidia-ctk cdi generate``, kept current by
    ``nvidia-cdi-refresh`` or the GPU Operator) carries nodes, libraries and hooks. A claim fails,
    saying what to run, when that spec is missing or lacks the GPU's UUID (``nvidia-ctk`` before
    the ``index,uuid`` default names devices by index only: ``--device-name-strategy=uuid``).

- ``ignored-xids`` / ``critical-xids``: XIDs to treat as informational / to force back to critical
  (``79+94``; ``+`` because ``,`` separates settings). Application XIDs 13, 31, 43, 45, 68, 109
  are informational by default.
- ``telemetry-interval``: minimum seconds between two NVML reads of the counters (default 0: every
  poll reads; the ECC totals are the health pass's readings, never read twice);
  ``health-wait-ms`` (default 500): the event wait step, bounding shutdown time;
  ``recovery-interval`` (default 5 s): how often a lost GPU is asked again.
- ``ecc-correctable-rate`` (default 10), ``pcie-replay-rate`` (default 100), ``nvlink-error-rate``
  (default 10): errors per minute above which the health pass raises the informational trend
  conditions ``ecc-correctable-rate``, ``pcie-replay-rate``, ``nvlink-errors``
  (`backends.nvidia.checks`; a finite number >= 0). The pass itself runs every
  ``--health-interval`` seconds (an agent flag, default 5).

- ``dynamic-mig``: ``true`` publishes each GPU in MIG mode that no one else partitioned as
  partitionable devices (a counter set, the whole GPU and every MIG placement) and creates the MIG
  device at prepare (`backends.nvidia.dynamicmig`), with its missing capability device nodes
  (`backends.nvidia.capnodes`); ``dynamic-mig-dir`` (default ``/var/lib/dra-agent``) holds its
  journal.
- ``consumable-shares``: ``disabled`` (default), ``memory``, ``unlimited`` or a number: publish
  devices shareable by several claims (`agent.core.sharing.ConsumableShares`); claims choose
  time-slicing or MPS in their opaque configuration (`backends.nvidia.sharingconfig`).

A GPU that falls off the bus while the agent runs gets the STATE condition ``gpu-lost`` on all
its devices (so the taint policy taints them), from an event or from the health pass when no event
comes; a rediscovery that cannot read it keeps its last devices published (warned once) until it
answers again or is no longer listed. No GPU on the node publishes an empty pool and logs that
once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agent.core.backend import Backend, BackendOptions
    from backends.nvidia.backend import NvidiaBackend

__all__ = ["NvidiaBackend", "create_backend"]


def create_backend(options: BackendOptions) -> list[Backend]:
    """The entry point (``backends.nvidia:create_backend``): one backend for the NVIDIA driver name."""
    from backends.nvidia.backend import NvidiaBackend

    return [NvidiaBackend(options)]


def __getattr__(name: str) -> Any:
    # The backend module loads on first use: the fake backend imports only the MIG tables of
    # `backends.nvidia.migprofiles`, and this package is imported first (~35 ms at start).
    if name == "NvidiaBackend":
        from backends.nvidia.backend import NvidiaBackend

        return NvidiaBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
