"""What the AMD backend tells of a prepared partition (`DescribesPrepared`), issue 31: its identity
and its GPU's, for the claim's ``status.devices[].data``; nothing beyond the `Device` for a GPU.
Through AMD's real amdsmi over the stand-in library (`tests.fakes.amd_standin`)."""

from __future__ import annotations

import pytest

from agent.core.backend import ClaimRef, prepared_status
from agent.core.errors import DeviceNotFoundError
from tests.amd.conftest import MakeBackend
from tests.fakes.amd_standin import mi300x

CLAIM = ClaimRef("default", "claim-1", "uid-1")


async def test_a_partition_names_itself_and_its_gpu(make_backend: MakeBackend) -> None:
    backend, _ = make_backend(mi300x("cpx_nps4", count=1))
    await backend.start()
    try:
        devices = {d.name: d for d in await backend.discover()}
        part = devices["gpu-2-129"]
        status = await prepared_status(backend, part.name, CLAIM)
        assert status == {
            "pciAddr": part.attributes["pciAddr"],
            "partitionProfile": "cpx_nps4",
            "parentDeviceID": part.attributes["parentDeviceID"],
            "parentPciAddr": part.attributes["parentPciAddr"],
        }
        with pytest.raises(DeviceNotFoundError):
            await prepared_status(backend, "gpu-99-999", CLAIM)
    finally:
        await backend.stop()


async def test_a_whole_gpu_has_nothing_beyond_its_device(make_backend: MakeBackend) -> None:
    backend, _ = make_backend(mi300x("spx_nps1", count=1))
    await backend.start()
    try:
        (gpu,) = await backend.discover()
        assert await prepared_status(backend, gpu.name, CLAIM) == {}
    finally:
        await backend.stop()
