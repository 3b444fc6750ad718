"""What a claim's status says of an AMD GPU partition it holds (`agent.core.backend.DescribesPrepared`).

A partition (CPX, DPX...) is one of several devices on one physical GPU: its entry names the
partition (UUID, PCI function, partition profile) and the GPU it is part of (AMD's ``deviceID``
of the GPU, its PCI address, and the UUID of the GPU's first partition, which amdsmi reports
for the GPU as a whole), with the attribute names the slices use.
"""

from __future__ import annotations

from collections.abc import Mapping

from agent.core.backend import STATUS_PARENT_UUID, PreparedStatus
from agent.core.model import Device
from backends.amd.discovery import TYPE_PARTITION

_KEYS = ("pciAddr", "partitionProfile", "parentDeviceID", "parentPciAddr")


def partition_status(device: Device, devices: Mapping[str, Device]) -> PreparedStatus:
    """The status data of a partition; nothing for a whole GPU (its `Device` says it all)."""
    if device.attributes.get("type") != TYPE_PARTITION:
        return {}
    found: dict[str, str | int] = {k: str(device.attributes[k]) for k in _KEYS if k in device.attributes}
    parent = devices.get(device.parent)
    if parent is not None and parent.uuid:
        found[STATUS_PARENT_UUID] = parent.uuid
    return found
