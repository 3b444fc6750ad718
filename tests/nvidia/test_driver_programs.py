"""The NVIDIA backend runs the host driver's nvidia-smi and nvidia-cuda-mps-control (issue 15 follow-up).

The agent's image carries no driver: the chart mounts the host's ``/`` at ``/host``
(``host-root``) and the driver sits at ``driver-root`` below it (``/`` or the GPU Operator's
``/run/nvidia/driver``), laid out here by `tests.nvidia.hostfs.make_driver_root`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.core.backend import BackendOptions, ClaimRef
from agent.core.sharing import DeviceShare, OpaqueConfig
from backends.nvidia import NvidiaBackend
from backends.nvidia.driverfiles import DriverProgramMissingError, HostView, driver_program
from backends.nvidia.mps import NoMounter
from tests.deploy.chart import CI_VALUES, load_values, render_objects
from tests.fakes.libnvml import LibNvml, h100
from tests.nvidia.conftest import build_sysfs
from tests.nvidia.hostfs import LIBDIR, VERSION, make_driver_root
from tests.support.clock import FakeClock

CONFIG = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"}
GPU_OPERATOR_ROOT = "/run/nvidia/driver"


def logging_binary(driver_root: Path, name: str, log: Path) -> None:
    """An executable at ``usr/bin/<name>`` that logs its arguments and library path."""
    path = driver_root / "usr" / "bin" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\necho "{name} $* LD=$LD_LIBRARY_PATH" >> {log}\n')
    path.chmod(0o755)


def nvidia(tmp_path: Path, driver_root: str = "/") -> NvidiaBackend:
    (tmp_path / "dev").mkdir(exist_ok=True)
    for node in ("nvidia0", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset"):
        (tmp_path / "dev" / node).touch()
    settings = {"host-root": str(tmp_path / "host"), "driver-root": driver_root}
    return NvidiaBackend(
        BackendOptions("node-1", settings=settings, state_dir=tmp_path / "state"),
        nvml_module=LibNvml([h100(0)]).module,
        clock=FakeClock(),
        sysfs_root=build_sysfs(tmp_path / "sys"),
        proc_root=tmp_path / "proc",
        dev_root=tmp_path / "dev",
        mps_shm=NoMounter(),
    )


def share(strategy: str) -> DeviceShare:
    config = OpaqueConfig("gpu.nvidia.com", {**CONFIG, "sharing": {"strategy": strategy}})
    return DeviceShare("gpu-0", ClaimRef("default", "c", "uid-c"), config=config)


@pytest.mark.parametrize("driver_root", ["/", GPU_OPERATOR_ROOT])
def test_programs_are_found_under_the_driver_root_in_the_host_root(tmp_path: Path, driver_root: str) -> None:
    root = make_driver_root(tmp_path / "host" / driver_root.lstrip("/"))
    logging_binary(root, "nvidia-smi", tmp_path / "log")
    links = tmp_path / "links"
    program = driver_program(HostView(tmp_path / "host"), driver_root, "nvidia-smi", links)()
    assert program.path == str(root / "usr" / "bin" / "nvidia-smi")
    assert program.env == {"PATH": str(root / "usr" / "bin"), "LD_LIBRARY_PATH": str(links)}
    # The driver's libraries only: the host's libc must not replace the agent image's.
    assert "libnvidia-ml.so.1" in os.listdir(links) and f"libcuda.so.{VERSION}" in os.listdir(links)
    assert not [n for n in os.listdir(links) if n.startswith(("libc.", "libz."))]
    assert (links / "libnvidia-ml.so.1").resolve() == (root / LIBDIR / f"libnvidia-ml.so.{VERSION}").resolve()
    env = program.environ({"PATH": "/usr/bin"})
    assert env["PATH"] == f"{root / 'usr' / 'bin'}:/usr/bin"


def test_a_program_that_is_not_executable_is_not_found(tmp_path: Path) -> None:
    make_driver_root(tmp_path / "host")  # its nvidia-smi is a plain file
    locate = driver_program(HostView(tmp_path / "host"), "/", "nvidia-smi", tmp_path / "links")
    with pytest.raises(
        DriverProgramMissingError, match="nvidia-smi is not installed under the driver root /"
    ):
        locate()


async def test_time_slicing_runs_the_hosts_nvidia_smi(tmp_path: Path) -> None:
    root = make_driver_root(tmp_path / "host" / GPU_OPERATOR_ROOT.lstrip("/"))
    logging_binary(root, "nvidia-smi", tmp_path / "log")
    nv = nvidia(tmp_path, GPU_OPERATOR_ROOT)
    await nv.start()
    try:
        await nv.prepare_share(share("TimeSlicing"), [])
    finally:
        await nv.stop()
    uuid = h100(0).uuid
    links = tmp_path / "state" / "driver-libraries" / "gpu.nvidia.com"
    assert (tmp_path / "log").read_text().splitlines() == [
        f"nvidia-smi -i {uuid} -c DEFAULT LD={links}",
        f"nvidia-smi compute-policy -i {uuid} --set-timeslice=0 LD={links}",
    ]


async def test_mps_without_the_control_program_fails_the_claim_and_undoes_the_compute_mode(
    tmp_path: Path,
) -> None:
    root = make_driver_root(tmp_path / "host")
    logging_binary(root, "nvidia-smi", tmp_path / "log")
    nv = nvidia(tmp_path)
    await nv.start()
    try:
        with pytest.raises(DriverProgramMissingError) as caught:
            await nv.prepare_share(share("MPS"), [])
    finally:
        await nv.stop()
    message = str(caught.value)
    assert "nvidia-cuda-mps-control is not installed under the driver root /" in message
    assert str(tmp_path / "host" / "usr" / "sbin") in message and "driver-root" in message
    modes = [line.split(" LD=")[0].rsplit(" ", 1)[-1] for line in (tmp_path / "log").read_text().splitlines()]
    assert modes == ["EXCLUSIVE_PROCESS", "DEFAULT"]
    daemons = tmp_path / "state" / "mps" / "gpu.nvidia.com"
    assert not daemons.exists() or not os.listdir(daemons)


@pytest.mark.parametrize("variant", [v for v in sorted(CI_VALUES) if v != "amd"])
def test_the_chart_gives_sharing_what_nvidia_smi_and_tmpfs_need(variant: str) -> None:
    """Compute mode and time-slice changes need CAP_SYS_ADMIN in the NVIDIA kernel module's
    administrator check, as does mounting the MPS tmpfs: the chart's default is privileged."""
    (ds,) = [o for o in render_objects(load_values(variant)) if o["kind"] == "DaemonSet"]
    (container,) = ds["spec"]["template"]["spec"]["containers"]
    assert container["securityContext"]["privileged"] is True
    assert container["securityContext"]["runAsUser"] == 0
