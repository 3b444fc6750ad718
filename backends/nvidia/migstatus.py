"""What a claim's status says of a MIG device it holds (`agent.core.backend.DescribesPrepared`).

The keys are those the slices use for MIG devices (``uuid``, ``parentUUID``, ``profile``) plus
the GPU and compute instance IDs dcgm-exporter labels MIG series with (``GPU_I_ID``): with them a
dynamic MIG device, which has no UUID in any slice, can be told apart and joined per pod.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agent.core.backend import STATUS_GPU_INSTANCE_ID, STATUS_PARENT_UUID, STATUS_UUID, PreparedStatus

if TYPE_CHECKING:
    from backends.nvidia.discovery import NvDevice


def mig_status(
    *, mig_uuid: str, parent_uuid: str, gi_id: int | None, ci_id: int | None, profile: str
) -> PreparedStatus:
    """The status data of one MIG device; what is unknown is left out."""
    found: dict[str, str | int | None] = {
        STATUS_UUID: mig_uuid,
        STATUS_PARENT_UUID: parent_uuid,
        STATUS_GPU_INSTANCE_ID: gi_id,
        "computeInstanceID": ci_id,
        "profile": profile,
    }
    return {key: value for key, value in found.items() if value is not None and value != ""}


def static_mig_status(nv: NvDevice) -> PreparedStatus:
    """A static MIG device's status data; nothing for a whole GPU (its `Device` says it all)."""
    mig = nv.mig
    if mig is None:
        return {}
    return mig_status(
        mig_uuid=mig.uuid,
        parent_uuid=nv.gpu.uuid,
        gi_id=mig.gpu_instance_id,
        ci_id=mig.compute_instance_id,
        profile=mig.profile,
    )
