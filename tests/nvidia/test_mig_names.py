"""MIG: compute instances of one GPU instance get distinct device names.

NVIDIA's naming (``gpu-<minor>-mig-<profile>-<giProfileId>-<placementStart>``) describes the GPU
instance; two compute instances with the same profile inside it would share a name, and the
inventory would silently keep the last one.
"""

from __future__ import annotations

import logging

import pytest

from tests.fakes.libnvml import FakeMig, LibNvml, a100_mig
from tests.nvidia.conftest import BackendFactory


async def test_two_compute_instances_of_one_gpu_instance(
    make_backend: BackendFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="agent.backends.nvidia")
    gpu = a100_mig(0)
    # A 3g.40gb GPU instance (id 2) split into two 1c.3g.40gb compute instances, listed last first.
    gpu.migs = [
        FakeMig("MIG-a1000000-0012-0000-0000-000000000000", 2, 1, 9, 4, 4, ci_slices=1),
        FakeMig("MIG-a1000000-0011-0000-0000-000000000000", 2, 0, 9, 4, 4, ci_slices=1),
    ]
    backend = make_backend(LibNvml([gpu]))
    await backend.start()
    try:
        devices = {d.name: d for d in await backend.discover()}
    finally:
        await backend.stop()
    assert sorted(devices) == ["gpu-0-mig-1c3g40gb-9-4", "gpu-0-mig-1c3g40gb-9-4-ci1"]
    assert devices["gpu-0-mig-1c3g40gb-9-4"].uuid == "MIG-a1000000-0011-0000-0000-000000000000"
    assert devices["gpu-0-mig-1c3g40gb-9-4-ci1"].uuid == "MIG-a1000000-0012-0000-0000-000000000000"
    (line,) = [r for r in caplog.records if "same device name" in r.getMessage()]
    assert line.levelno == logging.WARNING
