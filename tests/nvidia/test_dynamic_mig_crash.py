"""kill -9 at each step of a dynamic-MIG prepare or unprepare, then a restart: no orphan MIG
device and no lost claim. The child (`tests.nvidia.dynmig_crash_child`) runs the backend through
pynvml over the stand-in libnvidia-ml and keeps the driver's MIG state in a file, as the real
driver keeps it across an agent crash."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


def child(tmp_path: Path, kill_at: str, *actions: str) -> tuple[int, list[dict[str, Any]]]:
    args = [
        sys.executable, "-m", "tests.nvidia.dynmig_crash_child",
        str(tmp_path / "hardware.json"), str(tmp_path / "state"), kill_at, *actions,
    ]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode in (0, -signal.SIGKILL), done.stderr
    return done.returncode, [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_a_prepare_passes_the_placement_as_a_pointer(tmp_path: Path) -> None:
    """nvml.h:13016: ``const nvmlGpuInstancePlacement_t *placement``. pynvml sets no argtypes, so a
    structure passed without ``byref`` reaches the library by value and the library reads a wild
    pointer: the process dies with SIGSEGV (the agent on a node did, at its first prepare)."""
    args = [
        sys.executable, "-m", "tests.nvidia.dynmig_crash_child",
        str(tmp_path / "hardware.json"), str(tmp_path / "state"), "-", "prepare", "unprepare",
    ]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode != -signal.SIGSEGV, "the stand-in libnvidia-ml read a wild placement pointer"
    assert done.returncode == 0, done.stderr
    [_start, prepared, unprepared] = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(prepared["migs"]) == 1 and unprepared["migs"] == []


@pytest.mark.parametrize(
    "kill_at",
    [
        "journal:creating-gi",
        "after:nvmlDeviceCreateGpuInstanceWithPlacement",
        "journal:creating-ci",
        "after:nvmlGpuInstanceCreateComputeInstance",
        "journal:ci-created",
    ],
)
def test_kill_during_prepare_leaves_no_orphan(tmp_path: Path, kill_at: str) -> None:
    code, _ = child(tmp_path, kill_at, "prepare")
    assert code == -signal.SIGKILL
    saved = (
        json.loads((tmp_path / "hardware.json").read_text()) if (tmp_path / "hardware.json").exists() else []
    )
    code, [start, prepared, unprepared] = child(tmp_path, "-", "prepare", "unprepare")
    assert code == 0
    assert start["migs"] == [] and start["journal"] == [], f"left behind after {kill_at}: {saved}"
    # The kubelet's retry of the prepare succeeds: the claim is not lost.
    assert len(prepared["migs"]) == 1 and prepared["journal"] == ["prepared"]
    assert unprepared["migs"] == [] and unprepared["journal"] == []


def test_kill_after_prepare_keeps_the_claims_mig_device(tmp_path: Path) -> None:
    code, _ = child(tmp_path, "journal:prepared", "prepare")
    assert code == -signal.SIGKILL
    code, [start, prepared, unprepared] = child(tmp_path, "-", "prepare", "unprepare")
    assert code == 0
    [_mig] = start["migs"]  # exactly one MIG device
    assert start["journal"] == ["prepared"]  # a prepared claim holds it: kept
    assert len(prepared["caps"]) == 2 and prepared["migs"] == start["migs"]
    assert unprepared["migs"] == []


@pytest.mark.parametrize(
    "kill_at", ["journal:destroying", "after:nvmlComputeInstanceDestroy", "before:nvmlGpuInstanceDestroy"]
)
def test_kill_during_unprepare_leaves_no_orphan(tmp_path: Path, kill_at: str) -> None:
    code, lines = child(tmp_path, kill_at, "prepare", "unprepare")
    assert code == -signal.SIGKILL and len(lines[-1]["migs"]) == 1
    code, [start] = child(tmp_path, "-")
    assert code == 0 and start["migs"] == [] and start["journal"] == []
