"""Is this GPU lost? Asked as nvml.h allows it to be answered (blocking; worker thread).

- `fresh_handle`: nvml.h:4714-4721 says ``nvmlDeviceGetHandleByUUID`` answers GPU_IS_LOST "if
  *any* GPU has fallen off the bus", so on that answer the target's own is asked through
  ``nvmlDeviceGetHandleByIndex_v2`` (GPU_IS_LOST only "if the target GPU has fallen off the bus",
  nvml.h:4650-4662): one lost GPU never makes a healthy one look lost, nor keeps it from reviving.
- `lost_answer`: after an event wait fails, several getters are asked and only a GPU_IS_LOST-class
  answer counts (`Nvml.is_gpu_lost`): nvml.h only *lists* GPU_IS_LOST for each getter, so a lost GPU
  may still answer its UUID (static identity), and a transient UNKNOWN is not a lost GPU.
"""

from __future__ import annotations

from typing import Any

from backends.nvidia.nvml import Nvml, text

# Getters whose nvml.h return codes list GPU_IS_LOST (nvml.h:5207, 6729, 6579).
LOST_PROBES = ("nvmlDeviceGetUUID", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetPowerUsage")


def fresh_handle(nvml: Nvml, uuid: str, index: int, current: Any) -> Any:
    """A handle for GPU `uuid` asked afresh (one taken before a GPU reset may be stale).

    Raises the target's own error (GPU_IS_LOST when it is the lost one, NOT_FOUND when gone).
    """
    lib = nvml.lib
    try:
        return lib.nvmlDeviceGetHandleByUUID(uuid)
    except Exception as error:
        if not isinstance(error, nvml.error_class("NVMLError_GpuIsLost")) or index < 0:
            raise
    handle = lib.nvmlDeviceGetHandleByIndex(index)
    if text(lib.nvmlDeviceGetUUID(handle)) != uuid:
        return current  # another GPU at that index now: the handle held answers for ours
    return handle


def lost_answer(nvml: Nvml, handle: Any) -> BaseException | None:
    """The first lost-GPU error that any of `LOST_PROBES` answers for `handle`; None if none does."""
    for name in LOST_PROBES:
        try:
            getattr(nvml.lib, name)(handle)
        except Exception as error:
            if not nvml.is_error(error):
                raise
            if nvml.is_gpu_lost(error):
                return error
    return None
