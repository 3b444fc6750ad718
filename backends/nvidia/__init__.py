"""The NVIDIA backend: GPUs and MIG devices through NVML (`pynvml`, package nvidia-ml-py).

Devices look like those of NVIDIA's own DRA driver (driver ``gpu.nvidia.com``, names
``gpu-<minor>`` and ``gpu-<minor>-mig-<profile without dots>-<giProfileId>-<placementStart>``,
the same attribute names), so existing DeviceClasses and CEL selectors keep working.

Settings (``--backend nvidia:key=value,...``):

- ``driver``: the DRA driver name (default ``gpu.nvidia.com``).
- ``driver-root``: where the driver's files are: ``/`` (driver installed on the host, default) or
  ``/run/nvidia/driver`` (GPU Operator). NVML is loaded from there when present.
- ``cdi-mode``: how containers get the GPU:

  * ``own`` (default): our per-claim CDI spec carries the device nodes, MIG capability nodes,
    ``NVIDIA_VISIBLE_DEVICES`` and read-only mounts of the driver's libraries (into
    ``/usr/local/nvidia/lib64``, which CUDA images have on ``LD_LIBRARY_PATH``) and ``nvidia-smi``.
    Use it when the NVIDIA Container Toolkit is not installed or does not generate CDI specs.
  * ``toolkit``: return the NVIDIA Container Toolkit's CDI device ``nvidia.com/gpu=<uuid>`` (and
    ``NVIDIA_VISIBLE_DEVICES``). Use it when the GPU Operator or ``nvidia-ctk cdi generate
    --device-name-strategy=uuid`` keeps ``/var/run/cdi/nvidia.yaml`` current: the toolkit then
    adds the libraries, binaries and hooks (ldconfig, IPC sockets) exactly as for its own devices.

- ``ignored-xids`` / ``critical-xids``: XIDs to treat as informational / to force back to critical
  (``79+94``; ``+`` because ``,`` separates settings). Application XIDs 13, 31, 43, 45, 68, 109
  are informational by default.
- ``telemetry-interval``: minimum seconds between two NVML reads of the counters (default 0: every
  poll reads); ``health-wait-ms`` (default 500): the event wait step, bounding shutdown time;
  ``recovery-interval`` (default 5 s): how often the recovery action of a faulted GPU is read.

- ``dynamic-mig``: ``true`` publishes each GPU in MIG mode that no one else partitioned as
  partitionable devices (a counter set, the whole GPU and every MIG placement) and creates the MIG
  device at prepare (`backends.nvidia.dynamicmig`); ``dynamic-mig-dir`` (default
  ``/var/lib/dra-agent``) holds its journal.

A GPU that falls off the bus while the agent runs gets the STATE condition ``gpu-lost`` on all
its devices (so the taint policy taints them) and stays published with it; the next rediscovery
that cannot read the GPU leaves it out, and the devices disappear from the pool. No GPU on the node
publishes an empty pool and logs that once.
"""

from __future__ import annotations

from agent.core.backend import Backend, BackendOptions
from backends.nvidia.backend import NvidiaBackend

__all__ = ["NvidiaBackend", "create_backend"]


def create_backend(options: BackendOptions) -> list[Backend]:
    """The entry point (``backends.nvidia:create_backend``): one backend for the NVIDIA driver name."""
    return [NvidiaBackend(options)]
