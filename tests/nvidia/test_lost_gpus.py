"""A lost GPU decided by its own answers, as nvml.h defines them (issue 29, points 5 and 6).

nvml.h:4714-4721: ``nvmlDeviceGetHandleByUUID`` answers GPU_IS_LOST "if *any* GPU has fallen off
the bus", ``nvmlDeviceGetHandleByIndex_v2`` only for the target (nvml.h:4650-4662). nvml.h lists
GPU_IS_LOST for each getter (nvml.h:5207 for the UUID): a lost GPU need not answer it to every
one. NVIDIA's driver (k8s-dra-driver-gpu ``device_health.go``) marks devices lost when the event
wait answers GPU_IS_LOST.
"""

from __future__ import annotations

import pynvml as real

from backends.nvidia.nvml import Nvml
from tests.fakes.libnvml import LibNvml, h100, l4
from tests.nvidia.conftest import BackendFactory, Sink, monitoring, until
from tests.support.clock import FakeClock

GPU0 = "GPU-h1000000-0000-0000-0000-000000000000"
L4 = "GPU-0l400003-0000-0000-0000-000000000000"
LOST = int(real.NVML_ERROR_GPU_IS_LOST)


def lost(sink: Sink) -> set[str]:
    """Devices whose gpu-lost is raised and not cleared since."""
    down: set[str] = set()
    for event in sink.events:
        if event.condition == "gpu-lost":
            (down.discard if event.cleared else down.add)(event.device)
    return down


async def test_a_suspect_gpu_is_not_lost_because_another_gpu_is(make_backend: BackendFactory) -> None:
    fake = LibNvml([h100(0), l4(3)])
    sink = Sink()
    backend = make_backend(fake, health_wait_ms="20")
    async with monitoring(backend, sink):
        await sink.wait_passes(1)
        fake.lose(GPU0, event=False)
        await backend.telemetry()  # GPU_IS_LOST: gpu-0 is suspect, the next pass finds it lost
        await sink.wait_for(lambda events: lost(sink) == {"gpu-0"})
        fake.fail(L4, "nvmlDeviceGetPowerUsage", LOST)  # a transient GPU_IS_LOST on the L4
        await backend.telemetry()  # the L4 is suspect now
        del fake.gpu(L4).failures["nvmlDeviceGetPowerUsage"]
        passes = len(sink.passes)
        await sink.wait_passes(passes + 1)  # the pass for the suspect (no interval elapsed)
    assert lost(sink) == {"gpu-0"}
    assert "gpu-3" in sink.passes[-1].devices


async def test_a_gpu_back_is_revived_while_another_is_still_lost(
    make_backend: BackendFactory, fake_clock: FakeClock
) -> None:
    fake = LibNvml([h100(0), l4(3)])
    sink = Sink()
    backend = make_backend(fake, health_wait_ms="20", recovery_interval="5")
    async with monitoring(backend, sink):
        await until(lambda: fake.event_sets and fake.event_sets[-1].waits > 0)
        fake.lose(GPU0)
        fake.lose(L4)
        await sink.wait_for(lambda events: lost(sink) == {"gpu-0", "gpu-3"})
        fake.gpu(L4).lost = False  # the L4 comes back; the H100 stays lost
        fake_clock.advance(5)
        await sink.wait_for(lambda events: lost(sink) == {"gpu-0"})


async def test_a_failed_wait_finds_a_lost_gpu_that_still_answers_its_uuid(
    make_backend: BackendFactory,
) -> None:
    """The wait answers GPU_IS_LOST; the lost GPU still answers nvmlDeviceGetUUID but not its
    memory: it is lost at once, not a health interval later (no clock advance here)."""
    fake = LibNvml([h100(0), l4(3)])
    sink = Sink()
    backend = make_backend(fake, health_wait_ms="20")
    async with monitoring(backend, sink):
        await sink.wait_passes(1)
        await until(lambda: fake.event_sets and fake.event_sets[-1].waits > 0)
        fake.lose(GPU0, still_answers=["nvmlDeviceGetUUID"])
        await sink.wait_for(lambda events: lost(sink) == {"gpu-0"})


async def test_a_failed_wait_with_a_transient_error_marks_nothing_lost(make_backend: BackendFactory) -> None:
    """Only a lost-GPU answer counts: an UNKNOWN from a getter is not a lost GPU."""
    fake = LibNvml([h100(0), l4(3)])
    sink = Sink()
    backend = make_backend(fake, health_wait_ms="20")
    async with monitoring(backend, sink):
        await until(lambda: fake.event_sets and fake.event_sets[-1].waits > 0)
        fake.fail(GPU0, "nvmlDeviceGetUUID", int(real.NVML_ERROR_UNKNOWN))
        waits = fake.event_sets[-1].waits
        fake.emit_error(int(real.NVML_ERROR_UNKNOWN))
        await until(lambda: fake.event_sets[-1].waits > waits + 1)  # waiting again
        del fake.gpu(GPU0).failures["nvmlDeviceGetUUID"]
    assert lost(sink) == set()


def test_no_gpus_found_is_not_a_lost_gpu() -> None:
    """nvml.h:1333: NVML_ERROR_GPU_NOT_FOUND is "No GPUs were found", about the system."""
    fake = LibNvml([h100(0)])
    nvml = Nvml(fake.module)
    assert not nvml.is_gpu_lost(fake.module.NVMLError(int(fake.module.NVML_ERROR_GPU_NOT_FOUND)))
    assert nvml.is_gpu_lost(fake.module.NVMLError(LOST))
