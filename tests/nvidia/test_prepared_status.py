"""What the NVIDIA backend tells of a prepared MIG device (`DescribesPrepared`), issue 31: the
identity a claim's ``status.devices[].data`` carries and the per-pod series are labelled with.

Upstream: ``pkg/apis/resource/validation/validation.go`` (``validateDeviceStatus``: ``data`` is a
JSON object of at most 10 KiB, whatever the driver puts in it). The NVML calls are pynvml's over
the stand-in libnvidia-ml (`tests.fakes.libnvml`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.core.backend import ClaimRef, prepared_status
from backends.nvidia.dynamicmig import DynamicMigError
from tests.fakes.libnvml import MigLibNvml
from tests.nvidia.conftest import BackendFactory
from tests.nvidia.test_dynamic_mig import PLACEMENT, journal, nvml, started

__all__ = ["nvml"]  # the fixture, used by name

CLAIM = ClaimRef("default", "claim-1", "uid-1")


async def test_a_dynamic_mig_device_is_described_once_created(
    make_backend: BackendFactory, nvml: MigLibNvml, tmp_path: Path
) -> None:
    backend = await started(make_backend, nvml, tmp_path / "state")
    with pytest.raises(DynamicMigError, match="no MIG device created"):
        await prepared_status(backend, PLACEMENT, CLAIM)  # asked again later by the core
    await backend.prepare(PLACEMENT, CLAIM)
    (entry,) = journal(tmp_path / "state").entries()
    status = await prepared_status(backend, PLACEMENT, CLAIM)
    assert status == {
        "uuid": entry.mig_uuid,
        "parentUUID": entry.gpu_uuid,
        "gpuInstanceID": entry.gi_id,
        "computeInstanceID": entry.ci_id,
        "profile": "3g.40gb",
    }
    assert str(status["uuid"]).startswith("MIG-")


async def test_static_mig_devices_and_whole_gpus(
    make_backend: BackendFactory, nvml: MigLibNvml, tmp_path: Path
) -> None:
    backend = await started(make_backend, nvml, tmp_path / "state")
    devices = {d.name: d for d in await backend.discover()}
    static = next(d for d in devices.values() if d.attributes.get("type") == "mig" and d.uuid)
    status = await prepared_status(backend, static.name, CLAIM)
    assert status["uuid"] == static.uuid and status["parentUUID"] == static.attributes["parentUUID"]
    assert isinstance(status["gpuInstanceID"], int) and status["profile"] == static.attributes["profile"]
    whole = next(d for d in devices.values() if d.attributes.get("type") == "gpu")
    assert await prepared_status(backend, whole.name, CLAIM) == {}
