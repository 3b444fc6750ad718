"""The commands the NVIDIA backend runs for sharing, against stand-in programs that log their input.

Time-slicing as NVIDIA's driver applies it (compute mode DEFAULT, then ``nvidia-smi
compute-policy --set-timeslice``); MPS defaults through ``nvidia-cuda-mps-control`` commands
(``set_default_active_thread_percentage``, ``set_default_device_pinned_mem_limit <uuid> <N>M``,
``quit``), as ``cmd/gpu-kubelet-plugin/sharing.go`` of NVIDIA's driver sends them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.core.errors import BackendError
from agent.core.quantity import Quantity
from agent.core.sharing import OpaqueConfig, select_config
from backends.nvidia.driverfiles import on_path
from backends.nvidia.mps import ControlProgram
from backends.nvidia.sharing import SmiGpuPolicy
from backends.nvidia.sharingconfig import MpsSettings


def logging_program(tmp_path: Path, name: str, exit_code: int = 0) -> tuple[Path, Path]:
    log = tmp_path / f"{name}.log"
    program = tmp_path / name
    program.write_text(f'#!/bin/sh\necho "args: $*" >> {log}\ncat >> {log}\nexit {exit_code}\n')
    program.chmod(0o755)
    return program, log


async def test_time_slice_commands(tmp_path: Path) -> None:
    program, log = logging_program(tmp_path, "nvidia-smi")
    await SmiGpuPolicy(on_path(str(program))).set_interval("GPU-1", 3)
    assert log.read_text().splitlines() == [
        "args: -i GPU-1 -c DEFAULT",
        "args: compute-policy -i GPU-1 --set-timeslice=3",
    ]


async def test_failing_nvidia_smi_says_what_failed(tmp_path: Path) -> None:
    program, _ = logging_program(tmp_path, "nvidia-smi", exit_code=3)
    with pytest.raises(BackendError, match=r"nvidia-smi -i GPU-1 -c DEFAULT failed \(3\)"):
        await SmiGpuPolicy(on_path(str(program))).set_interval("GPU-1", 1)
    with pytest.raises(BackendError, match="time-slicing and MPS need the driver's nvidia-smi"):
        await SmiGpuPolicy(on_path(str(tmp_path / "missing"))).set_interval("GPU-1", 1)


async def test_mps_control_commands(tmp_path: Path) -> None:
    program, log = logging_program(tmp_path, "nvidia-cuda-mps-control")
    control = ControlProgram(on_path(str(program)))
    settings = MpsSettings(active_thread_percentage=40, pinned_memory_limit=Quantity.parse("10Gi"))
    assert control.argv(settings, "GPU-1") == [str(program), "-f"]
    await control.configure({"PATH": "/usr/bin:/bin"}, settings, "GPU-1")
    await control.quit({"PATH": "/usr/bin:/bin"}, 1)
    assert log.read_text().splitlines() == [
        "args: ",
        "set_default_active_thread_percentage 40",
        "args: ",
        "set_default_device_pinned_mem_limit GPU-1 10240M",
        "args: ",
        "quit",
    ]


def test_last_applicable_config_wins() -> None:
    """Class configs come first in the allocation, claim configs after: the last that applies wins."""
    everything = OpaqueConfig("d", {"n": 1}, source="FromClass")
    for_gpu = OpaqueConfig("d", {"n": 2}, requests=("gpu",))
    for_other = OpaqueConfig("d", {"n": 3}, requests=("other",))
    configs = [everything, for_gpu, for_other]
    assert select_config(configs, ["gpu"]) is for_gpu
    assert select_config(configs, ["gpu/small"]) is for_gpu  # a subrequest takes its request's config
    assert select_config(configs, ["third"]) is everything
    assert select_config([for_other], ["gpu"]) is None
