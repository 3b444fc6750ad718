"""Dynamic MIG in the NVIDIA backend over the stand-in libnvidia-ml: discovery, prepare, unprepare, rollback,
reconcile, health. The GPU-instance calls are pynvml's (`tests.fakes.libnvml.MigLibNvml`)."""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import anyio
import pynvml as real
import pytest

from agent.core.backend import ClaimRef
from agent.core.errors import BackendError, ConfigError
from backends.nvidia import NvidiaBackend
from backends.nvidia.dynamicmig import DynamicMigError
from backends.nvidia.migjournal import PREPARED, MigJournal
from tests.fakes.libnvml import XID_CRITICAL, MigLibNvml, a100_mig, dynamic_gpu, h100, l4
from tests.nvidia.conftest import BackendFactory, Sink, until

A100 = "NVIDIA A100-SXM4-80GB"
H100 = "NVIDIA H100 80GB HBM3"
CLAIM = ClaimRef("default", "claim-1", "uid-1")
PLACEMENT = "gpu-0-mig-3g40gb-9-4"


@pytest.fixture
def nvml(tmp_path: Path) -> MigLibNvml:
    """Dynamic A100-80GB and H100, an A100 with an admin's MIG layout, an H100 with MIG off, an L4.

    The driver's device nodes are in ``tmp_path/dev`` (the backend's), its capability files in
    ``tmp_path/proc``; the stand-in libnvidia-ml adds those of the MIG devices it creates.
    """
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidiactl", "nvidia0", "nvidia1"):
        (dev / name).touch()
    gpus = [dynamic_gpu(A100, 0), dynamic_gpu(H100, 1), a100_mig(2), h100(3), l4(4)]
    return MigLibNvml(gpus, proc_root=tmp_path / "proc", dev_root=dev)


@pytest.fixture
def journal_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"


def backend_on(
    make_backend: BackendFactory, nvml: MigLibNvml, journal_dir: Path, mode: str = "own"
) -> NvidiaBackend:
    return make_backend(nvml, cdi_mode=mode, dynamic_mig="true", dynamic_mig_dir=str(journal_dir))


async def started(make_backend: BackendFactory, nvml: MigLibNvml, journal_dir: Path) -> NvidiaBackend:
    """A started dynamic-MIG backend that has discovered the GPUs."""
    backend = backend_on(make_backend, nvml, journal_dir)
    await backend.start()
    await backend.discover()
    return backend


def journal(journal_dir: Path) -> MigJournal:
    loaded = MigJournal(journal_dir / "dynamic-mig-gpu.nvidia.com.json")
    loaded.load()
    return loaded


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"dynamic-mig": "yes"}, "true or false"),
        ({"dynamic-mig": "true", "dynamic-mig-dir": "state"}, "absolute"),
    ],
)
def test_bad_dynamic_mig_settings(
    make_backend: BackendFactory, nvml: MigLibNvml, settings: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        make_backend(nvml, **{k.replace("-", "_"): v for k, v in settings.items()})


def test_consumable_shares_with_dynamic_mig_says_what_is_not_shared(
    make_backend: BackendFactory, nvml: MigLibNvml, journal_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, "agent.backends.nvidia"):
        make_backend(nvml, dynamic_mig="true", dynamic_mig_dir=str(journal_dir), consumable_shares="memory")
        make_backend(nvml, consumable_shares="memory")  # no dynamic MIG: nothing to say
        make_backend(nvml, dynamic_mig="true", dynamic_mig_dir=str(journal_dir))  # no shares: nothing either
    said = [r for r in caplog.records if "consumable-shares with dynamic-mig=true" in r.getMessage()]
    assert len(said) == 1
    assert (
        "exclusive use" in said[0].getMessage()
        and said[0].__dict__["fields"]["consumable_shares"] == "memory"
    )


async def test_discovery_publishes_each_gpu_as_it_can(
    make_backend: BackendFactory, nvml: MigLibNvml, journal_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    backend = backend_on(make_backend, nvml, journal_dir)
    await backend.start()
    with caplog.at_level(logging.INFO, "agent.backends.nvidia"):
        devices = {d.name: d for d in await backend.discover()}
        await backend.discover()
    a100 = [n for n in devices if n.startswith("gpu-0")]
    assert len(a100) == 26 and devices["gpu-0"].counter_sets
    assert devices[PLACEMENT].attributes["profile"] == "3g.40gb"
    assert devices[PLACEMENT].parent == "gpu-0" and "uuid" not in devices[PLACEMENT].attributes
    # H100: engines from NVML's profile info (7 decoders and 7 JPEG engines on the 7g profile).
    h100_set = devices["gpu-1"].counter_sets[0]
    assert h100_set.counters["decoders"].value == 7 and h100_set.counters["jpeg-engines"].value == 7
    assert "gpu-1-mig-1g20gb-15-6" in devices
    # The administrator's layout stays static; MIG off and no MIG publish whole GPUs.
    assert sorted(n for n in devices if n.startswith("gpu-2")) == [
        "gpu-2-mig-1g10gb-19-2",
        "gpu-2-mig-1g10gb-19-3",
        "gpu-2-mig-2g20gb-14-0",
        "gpu-2-mig-3g40gb-9-4",
    ]
    assert not any(d.counter_sets or d.consumes_counters for n, d in devices.items() if n.startswith("gpu-2"))
    assert "gpu-3" in devices and "gpu-4" in devices and not devices["gpu-4"].counter_sets
    said = [r.getMessage() for r in caplog.records]
    for line in ("MIG mode is off", "cannot do MIG", "did not create"):
        assert sum(line in m for m in said) == 1, said  # once per GPU, not per rediscovery


async def test_prepare_creates_and_unprepare_destroys(
    make_backend: BackendFactory, nvml: MigLibNvml, journal_dir: Path
) -> None:
    backend = await started(make_backend, nvml, journal_dir)
    gpu = nvml.gpus[0]
    edits = await backend.prepare(PLACEMENT, CLAIM)
    [mig] = gpu.migs
    assert (mig.profile_id, mig.start, mig.size) == (9, 4, 4) and mig.ci_id == 0
    assert edits.env["NVIDIA_VISIBLE_DEVICES"] == "void"  # the capability nodes carry the MIG device
    # The CDI edits give the new MIG device's capability nodes (GPU instance and compute instance).
    assert sum("/dev/nvidia-caps/" in n.path for n in edits.device_nodes) == 2
    assert [e.step for e in journal(journal_dir).entries()] == [PREPARED]
    # Idempotent, and our own MIG device keeps the GPU partitionable.
    assert await backend.prepare(PLACEMENT, CLAIM) == edits and len(gpu.migs) == 1
    assert PLACEMENT in {d.name for d in await backend.discover()}
    await backend.unprepare(PLACEMENT, CLAIM)
    assert gpu.migs == [] and journal(journal_dir).entries() == []
    await backend.unprepare(PLACEMENT, CLAIM)  # nothing left to do
    # A prepared MIG device survives a restart of the agent and is found again (no lost claim).
    edits = await backend.prepare(PLACEMENT, CLAIM)
    await backend.stop()
    again = backend_on(make_backend, nvml, journal_dir)
    await again.start()
    await again.discover()
    assert len(gpu.migs) == 1 and await again.prepare(PLACEMENT, CLAIM) == edits
    await again.unprepare(PLACEMENT, CLAIM)
    assert gpu.migs == []


STEPS = [
    "nvmlDeviceCreateGpuInstanceWithPlacement",
    "nvmlGpuInstanceGetInfo",
    "nvmlGpuInstanceGetComputeInstanceProfileInfo",
    "nvmlGpuInstanceCreateComputeInstance",
    "nvmlComputeInstanceGetInfo",
    "nvmlDeviceGetUUID",
]


@pytest.mark.parametrize("step", STEPS)
async def test_a_failure_at_each_nvml_step_rolls_back(
    make_backend: BackendFactory, nvml: MigLibNvml, journal_dir: Path, step: str
) -> None:
    backend = await started(make_backend, nvml, journal_dir)
    nvml.fail_once(step, int(real.NVML_ERROR_UNKNOWN))
    with pytest.raises(DynamicMigError) as raised:
        await backend.prepare(PLACEMENT, CLAIM)
    message = str(raised.value)
    assert nvml.gpus[0].uuid in message and "3g.40gb at placement 4" in message and "Unknown Error" in message
    assert nvml.gpus[0].migs == [] and journal(journal_dir).entries() == []
    await backend.prepare(PLACEMENT, CLAIM)  # the transient failure is gone: it works now
    assert len(nvml.gpus[0].migs) == 1


async def test_failed_edits_destroy_the_new_mig_device(
    make_backend: BackendFactory, nvml: MigLibNvml, journal_dir: Path
) -> None:
    backend = await started(make_backend, nvml, journal_dir)
    assert nvml.dev_root is not None
    (nvml.dev_root / "nvidiactl").unlink()  # the edits need it: they fail after the MIG device exists
    with pytest.raises(BackendError, match=r"nvidiactl"):
        await backend.prepare(PLACEMENT, CLAIM)
    assert nvml.gpus[0].migs == [] and journal(journal_dir).entries() == []


async def test_a_failed_rollback_is_finished_by_the_next_start(
    make_backend: BackendFactory, nvml: MigLibNvml, journal_dir: Path
) -> None:
    backend = await started(make_backend, nvml, journal_dir)
    gpu = nvml.gpus[0]
    nvml.fail(gpu.uuid, "nvmlGpuInstanceCreateComputeInstance", int(real.NVML_ERROR_INSUFFICIENT_RESOURCES))
    nvml.fail(gpu.uuid, "nvmlGpuInstanceDestroy", int(real.NVML_ERROR_IN_USE))
    with pytest.raises(DynamicMigError, match="compute instance"):
        await backend.prepare(PLACEMENT, CLAIM)
    assert len(gpu.migs) == 1 and len(journal(journal_dir).entries()) == 1  # GI left, but journaled
    gpu.failures.clear()
    await backend.stop()
    await backend_on(make_backend, nvml, journal_dir).start()
    assert gpu.migs == [] and journal(journal_dir).entries() == []


async def test_a_placement_taken_by_hand_is_a_claim_error_and_left_alone(
    make_backend: BackendFactory, nvml: MigLibNvml, journal_dir: Path
) -> None:
    backend = await started(make_backend, nvml, journal_dir)
    lib, gpu = nvml.module, nvml.gpus[0]
    where = real.c_nvmlGpuInstancePlacement_t()
    where.start, where.size = 4, 4
    lib.nvmlDeviceCreateGpuInstanceWithPlacement(lib.nvmlDeviceGetHandleByIndex(0), 9, ctypes.byref(where))
    with pytest.raises(
        DynamicMigError,
        match=r"3g.40gb at placement 4 on GPU GPU-\S+ \(gpu-0\): Ran out of critical resources",
    ):
        await backend.prepare(PLACEMENT, CLAIM)
    assert len(gpu.migs) == 1 and journal(journal_dir).entries() == []  # the hand-made one is untouched
    # From now on the GPU is the administrator's: no placements are published for it.
    assert not any(n.startswith("gpu-0-") for n in {d.name for d in await backend.discover()})


async def test_a_gpu_taken_out_of_mig_mode_fails_the_claim_cleanly(
    make_backend: BackendFactory, nvml: MigLibNvml, journal_dir: Path
) -> None:
    backend = await started(make_backend, nvml, journal_dir)
    nvml.gpus[0].mig_mode = (0, 0)
    with pytest.raises(DynamicMigError, match="GPU left MIG mode"):
        await backend.prepare(PLACEMENT, CLAIM)
    assert nvml.gpus[0].migs == [] and journal(journal_dir).entries() == []


async def test_a_damaged_journal_stops_the_start_with_a_fix(
    make_backend: BackendFactory, nvml: MigLibNvml, journal_dir: Path
) -> None:
    await anyio.Path(journal_dir).mkdir()
    await anyio.Path(journal_dir / "dynamic-mig-gpu.nvidia.com.json").write_text("{not json")
    with pytest.raises(BackendError, match=r"damaged.*nvidia-smi mig -lgi"):
        await backend_on(make_backend, nvml, journal_dir).start()


async def test_mig_placements_follow_their_gpu_health_with_one_monitor(
    make_backend: BackendFactory, nvml: MigLibNvml, journal_dir: Path
) -> None:
    backend = await started(make_backend, nvml, journal_dir)
    await backend.prepare(PLACEMENT, CLAIM)
    sink = Sink()
    gpu = nvml.gpus[0]
    async with anyio.create_task_group() as tg:
        tg.start_soon(backend.monitor_health, sink)
        await until(lambda: any(gpu.uuid in s.registered for s in nvml.event_sets))
        nvml.emit(gpu.uuid, XID_CRITICAL, 79)
        await sink.wait_for(
            lambda events: {"gpu-0", PLACEMENT, "gpu-0-mig-1g10gb-19-0"} <= {e.device for e in events}
        )
        tg.cancel_scope.cancel()
    assert len(nvml.event_sets) == 1
    assert {e.value for e in sink.events if e.device.startswith("gpu-0")} == {"79"}
    # A placement is no device until created: telemetry reads GPUs, not 26 devices per GPU.
    assert PLACEMENT not in {t.device for t in await backend.telemetry()}


async def test_unprepare_follows_the_journal_even_when_the_gpu_turned_static(
    make_backend: BackendFactory, nvml: MigLibNvml, journal_dir: Path
) -> None:
    backend = await started(make_backend, nvml, journal_dir)
    await backend.prepare(PLACEMENT, CLAIM)
    await backend.stop()
    lib, gpu = nvml.module, nvml.gpus[0]
    where = real.c_nvmlGpuInstancePlacement_t()
    where.start, where.size = 0, 2
    lib.nvmlInit()
    lib.nvmlDeviceCreateGpuInstanceWithPlacement(
        lib.nvmlDeviceGetHandleByIndex(0), 14, ctypes.byref(where)
    )  # by hand
    again = backend_on(make_backend, nvml, journal_dir)
    await again.start()
    # Static now: only the MIG devices that exist are published (ours among them), no counters.
    devices = {d.name: d for d in await again.discover() if d.name.startswith("gpu-0")}
    assert list(devices) == [PLACEMENT] and not devices[PLACEMENT].consumes_counters
    await again.unprepare(PLACEMENT, CLAIM)
    assert [(m.profile_id, m.start) for m in gpu.migs] == [(14, 0)]  # ours gone, the hand-made one kept
    assert journal(journal_dir).entries() == []


async def test_unprepare_of_a_gpu_that_is_gone_forgets_it(
    make_backend: BackendFactory, nvml: MigLibNvml, journal_dir: Path
) -> None:
    backend = await started(make_backend, nvml, journal_dir)
    await backend.prepare(PLACEMENT, CLAIM)
    nvml.gpus[0].lost = True
    await backend.discover()
    await backend.unprepare(PLACEMENT, CLAIM)
    assert journal(journal_dir).entries() == []


async def test_a_burst_of_prepares_and_unprepares_leaves_nothing_behind(
    make_backend: BackendFactory, nvml: MigLibNvml, journal_dir: Path
) -> None:
    """Concurrent prepares of every 1g.10gb placement of the A100, then concurrent unprepares, twice:
    each creates and destroys its MIG device through pynvml over nvml.h's prototypes."""
    backend = await started(make_backend, nvml, journal_dir)
    gpu = nvml.gpus[0]
    names = [f"gpu-0-mig-1g10gb-19-{start}" for start in range(7)]
    claims = [ClaimRef("default", f"claim-{i}", f"uid-{i}") for i in range(len(names))]
    for _ in range(2):
        async with anyio.create_task_group() as tg:
            for name, claim in zip(names, claims, strict=True):
                tg.start_soon(backend.prepare, name, claim)
        assert sorted(m.start for m in gpu.migs) == list(range(7))
        assert len({m.uuid for m in gpu.migs}) == 7 and all(m.uuid for m in gpu.migs)
        async with anyio.create_task_group() as tg:
            for name, claim in zip(names, claims, strict=True):
                tg.start_soon(backend.unprepare, name, claim)
        assert gpu.migs == [] and journal(journal_dir).entries() == []
    assert nvml.crashes == []


async def test_the_new_mig_devices_uuid_comes_from_its_compute_instance(
    make_backend: BackendFactory, nvml: MigLibNvml, journal_dir: Path
) -> None:
    """NVIDIA's driver reads the MIG device from the compute instance info (nvml.h:12757-12764,
    ``device``); walking every MIG slot takes seconds on a loaded GPU."""
    backend = await started(make_backend, nvml, journal_dir)
    before = nvml.count("nvmlDeviceGetMigDeviceHandleByIndex")
    await backend.prepare(PLACEMENT, CLAIM)
    [mig] = nvml.gpus[0].migs
    assert journal(journal_dir).entries()[0].mig_uuid == mig.uuid
    assert nvml.count("nvmlDeviceGetMigDeviceHandleByIndex") == before
