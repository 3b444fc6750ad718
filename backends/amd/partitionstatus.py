"""What a claim's status says of an AMD GPU partition it holds (`agent.core.backend.DescribesPrepared`).

A partition (CPX, DPX...) is one of several devices on one physical GPU: its entry names the
partition (its PCI function and partition profile; its UUID is the `Device`'s, when amdsmi gives
each partition its own) and the GPU it is part of (AMD's ``deviceID`` of the GPU and its PCI
address), with the attribute names the slices use. No parent UUID: amdsmi 7.0.x gives every
partition the GPU's UUID and newer versions one per partition, so none names the GPU alone.
"""

from __future__ import annotations

from agent.core.backend import PreparedStatus
from agent.core.model import Device
from backends.amd.discovery import TYPE_PARTITION

_KEYS = ("pciAddr", "partitionProfile", "parentDeviceID", "parentPciAddr")


def partition_status(device: Device) -> PreparedStatus:
    """The status data of a partition; nothing for a whole GPU (its `Device` says it all)."""
    if device.attributes.get("type") != TYPE_PARTITION:
        return {}
    return {key: str(device.attributes[key]) for key in _KEYS if key in device.attributes}
