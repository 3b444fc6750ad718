"""Dynamic MIG in the fake backend (``dynamic-mig=true``): NVIDIA GPUs of a profile as partitionable.

Each whole NVIDIA GPU whose product is in `migtables` is published as the NVIDIA backend would
publish it in MIG mode with dynamic MIG (`backends.nvidia.migprofiles`): the GPU with its counter
set and one device per MIG placement, in the NVIDIA backend's order (`packing_order`: the
scheduler takes the first placement that fits). Static MIG devices of the profile stay as they are (an
administrator's layout is never reconfigured); other GPUs stay whole, with one log line saying
why. Prepare "creates" the MIG device: it refuses a placement whose counters are taken, as the
driver refuses a GPU instance that does not fit.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence

from agent.core.errors import BackendError
from agent.core.logs import log_fields
from agent.core.model import Device
from backends.fake.migtables import layout_for
from backends.nvidia.migprofiles import MigLayout, PlacementDevice, dynamic_devices, fits, taken_counters

log = logging.getLogger("agent.fake")

_GPU_NAME = re.compile(r"^gpu-(\d+)$")


class FakeDynamicMig:
    """The placements of the partitionable GPUs and the MIG devices "created" for claims."""

    def __init__(self) -> None:
        self.placements: dict[str, PlacementDevice] = {}
        self.layouts: dict[str, MigLayout] = {}
        self.created: dict[tuple[str, str], PlacementDevice] = {}

    def partition(self, devices: Sequence[Device]) -> list[Device]:
        """The devices to publish: capable whole GPUs become partitionable."""
        out: list[Device] = []
        for device in devices:
            match = _GPU_NAME.match(device.name)
            if device.attributes.get("type") != "gpu" or match is None:
                out.append(device)
                continue
            layout = layout_for(device.product)
            if layout is None:
                log.info(
                    "GPU cannot do MIG: published as a whole GPU",
                    extra=log_fields(device=device.name, product=device.product),
                )
                out.append(device)
                continue
            minor = int(match.group(1))
            whole, placements = dynamic_devices(device, device.uuid, minor, minor, layout)
            self.layouts[device.uuid] = layout
            out.append(whole)
            for placement_device, placement in placements:
                self.placements[placement.name] = placement
                out.append(placement_device)
        return out

    def create(self, device: str, claim_uid: str) -> None:
        """Take the placement's counters for the claim; refuse what does not fit."""
        placement = self.placements[device]
        if (claim_uid, device) in self.created:
            return
        layout = self.layouts[placement.gpu_uuid]
        held = [(p.profile, p.placement) for p in self.created.values() if p.gpu_uuid == placement.gpu_uuid]
        if not fits(layout, taken_counters(layout, held), placement.profile, placement.placement):
            raise BackendError(
                f"fake backend: cannot create the GPU instance for {placement.profile.name} at placement "
                f"{placement.placement.start} on GPU {placement.gpu_uuid} (gpu-{placement.minor}): "
                "Insufficient Resources: another MIG device holds part of it"
            )
        self.created[(claim_uid, device)] = placement

    def destroy(self, device: str, claim_uid: str) -> None:
        self.created.pop((claim_uid, device), None)
