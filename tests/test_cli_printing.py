"""Printing commands that finish (issue 25 points 2 and 5): ``dra-agent slices`` prints the pool and
exits; a reader that goes away (``| head``) ends a command quietly, without a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from tests.lifecycle.harness import REPO
from tests.nvidia.test_dynamic_mig_slices import validate

BACKEND = "fake:profile=nvidia-a100-8x,control=off"


def run_cli(*args: str, close_stdout: bool = False, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    with subprocess.Popen(
        [sys.executable, "-m", "agent.cli", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        if close_stdout:
            proc.stdout.close()  # as `| head -0` does: every write of the command fails with EPIPE
            out = ""
        else:
            out = proc.stdout.read()
        err = proc.stderr.read()
        code = proc.wait(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, code, out, err)


def test_slices_prints_the_pool_once_and_exits(tmp_path: Path) -> None:
    done = run_cli("slices", "--backend", BACKEND, "--node-name", "node-1", "--print-for", "1.36")
    assert done.returncode == 0, done.stderr
    (document,) = list(yaml.safe_load_all(done.stdout))
    items = document["items"]
    assert {i["spec"]["driver"] for i in items} == {"gpu.nvidia.com"}
    assert sum(len(i["spec"].get("devices", [])) for i in items) >= 8
    assert validate(items, "1.36") == []


def test_a_closed_pipe_ends_the_command_without_a_traceback() -> None:
    done = run_cli("slices", "--backend", BACKEND, close_stdout=True)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr
