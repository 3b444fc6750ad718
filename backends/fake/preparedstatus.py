"""The fake backend's word on a device it prepared (`agent.core.backend.DescribesPrepared`), as the
NVIDIA and AMD backends say it: a MIG device's UUID, parent GPU, GPU and compute instance IDs and
profile (`backends.nvidia.migstatus`), a partition's identity and its GPU's (`backends.amd.partitionstatus`).

The fake's GPU-instance IDs are a function of the placement, so they survive an agent restart
without a journal: ``0`` for a full GPU, ``1 + start/4`` for 4-slice placements, ``3 + start/2``
for 2-slice ones and ``7 + start`` for single slices (instances that can coexist never share one).
A dynamic MIG device's UUID is derived from the claim and the placement.
"""

from __future__ import annotations

import re
import uuid

from agent.core.backend import PreparedStatus
from agent.core.model import Device
from backends.amd.partitionstatus import partition_status
from backends.fake.migtables import layout_for
from backends.nvidia.migprofiles import Placement, PlacementDevice
from backends.nvidia.migstatus import mig_status

_FIRST_ID_BY_SIZE = {8: 0, 4: 1, 2: 3, 1: 7}
_PLACEMENT_START = re.compile(r"-mig-[a-z0-9]+-\d+-(\d+)$")
_MIG_NAMESPACE = uuid.UUID("6f1c6c3e-5b0e-4d55-9a8e-0d7f6a1f3c21")


def gpu_instance_id(placement: Placement) -> int:
    """The fake's GPU-instance ID of a placement (see the module docstring)."""
    return _FIRST_ID_BY_SIZE.get(placement.size, 0) + placement.start // max(placement.size, 1)


def created_mig_status(placement: PlacementDevice, claim_uid: str) -> PreparedStatus:
    """The MIG device "created" at prepare for `claim_uid` (dynamic MIG)."""
    gi_id = gpu_instance_id(placement.placement)
    mig_uuid = f"MIG-{uuid.uuid5(_MIG_NAMESPACE, f'{placement.gpu_uuid}/{gi_id}/{claim_uid}')}"
    return mig_status(
        mig_uuid=mig_uuid,
        parent_uuid=placement.gpu_uuid,
        gi_id=gi_id,
        ci_id=0,
        profile=placement.profile.name,
    )


def device_status(device: Device) -> PreparedStatus:
    """A static MIG device's or a partition's status data; nothing for a whole GPU."""
    attributes = device.attributes
    if attributes.get("type") != "mig":
        return partition_status(device)
    return mig_status(
        mig_uuid=device.uuid,
        parent_uuid=str(attributes.get("parentUUID", "")),
        gi_id=_static_gi_id(device),
        ci_id=0,
        profile=str(attributes.get("profile", "")),
    )


def _static_gi_id(device: Device) -> int | None:
    """From the placement the name ends with (`mig_device_name`) and the product's MIG table."""
    match = _PLACEMENT_START.search(device.name)
    layout = layout_for(device.product)
    if match is None or layout is None:
        return None
    start = int(match.group(1))
    for profile in layout.profiles:
        for placement in profile.placements:
            if profile.name == device.attributes.get("profile") and placement.start == start:
                return gpu_instance_id(placement)
    return None
