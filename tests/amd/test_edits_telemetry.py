"""Container edits (device nodes read at prepare time) and telemetry (per-field degrade)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from agent.core.backend import ClaimRef, DeviceNode, PlansPrepare, nothing_to_undo
from agent.core.errors import BackendError, DeviceNotFoundError
from backends.amd.edits import read_edits
from tests.amd.conftest import MakeBackend
from tests.amd.test_health import one_pass
from tests.fakes.amd_standin import mi210, mi300x

CLAIM = ClaimRef("default", "claim", "uid-1")
MIB = 1024 * 1024


class FakeDev:
    """A host /dev whose nodes the test defines: path -> (mode, major, minor)."""

    def __init__(self, nodes: dict[str, tuple[int, int, int]]) -> None:
        self.nodes = nodes
        self.calls: list[str] = []

    def __call__(self, path: str) -> os.stat_result:
        self.calls.append(path)
        if path not in self.nodes:
            raise FileNotFoundError(path)
        mode, major, minor = self.nodes[path]
        return os.stat_result((mode, 0, 0, 0, 0, 0, 0, 0, 0, 0), {"st_rdev": os.makedev(major, minor)})


CHR = stat.S_IFCHR | 0o666


def amd_dev(root: str, card: int, render: int, minor_shift: int = 0) -> FakeDev:
    return FakeDev(
        {
            f"{root}/kfd": (CHR, 235, 0),
            f"{root}/dri/card{card}": (CHR, 226, card + minor_shift),
            f"{root}/dri/renderD{render}": (CHR, 226, render + minor_shift),
        }
    )


async def test_prepare_reads_device_nodes_each_time(make_backend: MakeBackend) -> None:
    dev = amd_dev("/host/dev", 3, 130)
    backend, _ = make_backend(
        mi300x("cpx_nps4", count=1),
        settings={"sysfs-root": "/dev/null", "dev-root": "/host/dev"},
        stat_fn=dev,
    )
    await backend.start()
    await backend.discover()
    edits = await backend.prepare("gpu-3-130", CLAIM)
    assert edits.device_nodes == (
        DeviceNode(path="/dev/kfd", type="c", major=235, minor=0, permissions="rw"),
        DeviceNode(path="/dev/dri/card3", type="c", major=226, minor=3, permissions="rw"),
        DeviceNode(path="/dev/dri/renderD130", type="c", major=226, minor=130, permissions="rw"),
    )
    # No visibility variable: a per-claim ROCR/HIP/AMD_VISIBLE_DEVICES would hide the other claims'
    # GPUs in a container with several claims (tests/kubelet/test_cdi_compose.py).
    assert edits.env == {} and edits.list_env == frozenset() and edits.cdi_device_ids == ()
    # Idempotent, and re-read from the host (after a reboot the numbers may differ).
    assert await backend.prepare("gpu-3-130", CLAIM) == edits
    assert len(dev.calls) == 6
    dev.nodes.update(amd_dev("/host/dev", 3, 130, minor_shift=1).nodes)
    again = await backend.prepare("gpu-3-130", CLAIM)
    assert again.device_nodes[2].minor == 131
    # Planned (`agent.core.backend.PlansPrepare`): the same edits, read when the core runs the plan.
    assert isinstance(backend, PlansPrepare)
    plan = backend.plan_prepare("gpu-3-130", CLAIM)
    assert plan is not None and len(dev.calls) == 9
    assert plan() == again and len(dev.calls) == 12
    assert backend.plan_unprepare("gpu-3-130", CLAIM) is nothing_to_undo
    with pytest.raises(DeviceNotFoundError, match="gpu-9-9"):
        backend.plan_prepare("gpu-9-9", CLAIM)
    await backend.unprepare("gpu-3-130", CLAIM)
    await backend.unprepare("gpu-9-9", CLAIM)  # never prepared: fine
    await backend.stop()


def test_missing_node_says_what_to_check() -> None:
    with pytest.raises(BackendError, match=r"/dev/dri/card1 does not exist.*amdgpu driver loaded"):
        read_edits("/dev", 1, 128, FakeDev({"/dev/kfd": (CHR, 235, 0)}))


def test_not_a_device_node() -> None:
    dev = amd_dev("/d", 1, 128)
    dev.nodes["/d/dri/card1"] = (stat.S_IFREG | 0o644, 0, 0)
    with pytest.raises(BackendError, match="not a device node"):
        read_edits("/d", 1, 128, dev)


def test_unreadable_node() -> None:
    def denied(path: str) -> os.stat_result:
        raise PermissionError(13, "Permission denied", path)

    with pytest.raises(BackendError, match="cannot read device node /dev/kfd"):
        read_edits("/dev", 1, 128, denied)


def test_block_device_type(tmp_path: Path) -> None:
    dev = amd_dev("/d", 1, 128)
    dev.nodes["/d/kfd"] = (stat.S_IFBLK | 0o660, 8, 0)
    assert read_edits("/d", 1, 128, dev).device_nodes[0].type == "b"


@pytest.mark.skipif(os.geteuid() != 0, reason="mknod needs root")
def test_real_device_nodes_with_os_stat(tmp_path: Path) -> None:
    (tmp_path / "dri").mkdir()
    os.mknod(tmp_path / "kfd", stat.S_IFCHR | 0o666, os.makedev(235, 0))
    os.mknod(tmp_path / "dri" / "card2", stat.S_IFCHR | 0o666, os.makedev(226, 2))
    os.mknod(tmp_path / "dri" / "renderD129", stat.S_IFCHR | 0o666, os.makedev(226, 129))
    nodes = read_edits(str(tmp_path), 2, 129).device_nodes
    assert [(n.path, n.type, n.major, n.minor) for n in nodes] == [
        ("/dev/kfd", "c", 235, 0),
        ("/dev/dri/card2", "c", 226, 2),
        ("/dev/dri/renderD129", "c", 226, 129),
    ]


async def test_telemetry_fields(make_backend: MakeBackend) -> None:
    gpus = mi300x(count=2)
    gpus[0].gfx_activity = 87
    gpus[0].vram_used_mb = 1024
    gpus[0].temp_hotspot = 71
    gpus[0].socket_power = 612
    gpus[0].ecc_correctable = {"UMC": 3, "GFX": 1}
    gpus[0].ecc_uncorrectable = {"UMC": 1}
    backend, _ = make_backend(gpus)
    await backend.start()
    await backend.discover()
    before, _ = await backend.telemetry()
    assert before.ecc_corrected_total is None  # the health pass has not read ECC yet
    await one_pass(backend)
    first, second = await backend.telemetry()
    await backend.stop()
    assert first.device == "gpu-1-128"
    assert first.utilization_ratio == pytest.approx(0.87)
    assert (first.memory_used_bytes, first.memory_total_bytes) == (1024 * MIB, 196592 * MIB)
    assert (first.temperature_celsius, first.power_watts) == (71.0, 612.0)
    assert (first.ecc_corrected_total, first.ecc_uncorrected_total) == (4, 1)
    assert second.device == "gpu-2-129" and second.ecc_uncorrected_total == 0


async def test_telemetry_failing_field_degrades_only_that_field(make_backend: MakeBackend) -> None:
    gpus = mi210(2)
    gpus[0].temp_hotspot = None  # no junction sensor: NOT_SUPPORTED
    gpus[0].ecc_enabled_mask = 0  # no RAS: the pass has no ECC counts to share
    gpus[0].socket_power = 0xFFFF  # what the binding turns into "N/A"
    gpus[1].temp_hotspot = gpus[1].temp_edge = None
    gpus[1].unsupported = {
        "amdsmi_get_gpu_activity",
        "amdsmi_get_gpu_vram_usage",
        "amdsmi_get_power_info",
    }
    backend, _ = make_backend(gpus)
    await backend.start()
    await backend.discover()
    await one_pass(backend)
    first, second = await backend.telemetry()
    await backend.telemetry()  # warnings are logged once; still works
    await backend.stop()
    assert first.temperature_celsius == 38.0  # edge when junction is unsupported
    assert first.power_watts is None
    assert first.ecc_uncorrected_total is None and first.ecc_corrected_total is None
    assert first.memory_total_bytes == 65520 * MIB
    assert second.temperature_celsius is None
    assert second.utilization_ratio is None
    assert second.memory_used_bytes is None and second.memory_total_bytes is None
    assert second.ecc_uncorrected_total == 0


async def test_telemetry_of_a_lost_gpu_is_empty_not_an_error(make_backend: MakeBackend) -> None:
    gpus = mi210(1)
    backend, _ = make_backend(gpus)
    await backend.start()
    await backend.discover()
    gpus[0].lost = True
    (reading,) = await backend.telemetry()
    await backend.stop()
    assert reading.utilization_ratio is None and reading.temperature_celsius is None
