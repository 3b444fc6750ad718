"""`dra-agent run` exits promptly on SIGTERM while a vendor call hangs (issue 13, point 1).

A wedged driver can make an NVML call never return. Before, the telemetry read held the one
capacity limiter that ``nvmlShutdown`` also needed, the worker thread was waited for on
cancellation and the interpreter joined it at exit: the process only ended with SIGKILL (the
kubelet's grace period later). The child here is the real CLI with the fake ``pynvml`` installed,
whose temperature read never returns; the test reports how long SIGTERM took to end it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.kubelet.grpc_support import short_tmp_dir

# Installs pynvml over the stand-in libnvidia-ml (an H100) whose telemetry read hangs, then runs
# `dra-agent run`.
LAUNCHER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from tests.fakes.libnvml import LibNvml, h100

    fake = LibNvml([h100(0)])
    marker = Path(sys.argv[1])
    # A wedged driver: the temperature read (either symbol) never returns.
    fake.hang("nvmlDeviceGetTemperature")
    fake.hang("nvmlDeviceGetTemperatureV")
    fake.on_hang = marker.write_text
    sys.modules["pynvml"] = fake.module
    from agent.cli import main
    sys.exit(main(sys.argv[2:]))
    """
)


@pytest.fixture
def root() -> Any:
    yield from short_tmp_dir()


def test_sigterm_ends_the_agent_while_a_telemetry_read_hangs(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = root / "hung"
    args = [
        sys.executable,
        "-c",
        LAUNCHER,
        str(marker),
        "run",
        "--kube",
        "none",
        "--node-name",
        "node-1",
        "--backend",
        "nvidia:cdi-mode=toolkit",
        "--registry-dir",
        str(root / "registry"),
        "--plugins-dir",
        str(root / "plugins"),
        "--cdi-root",
        str(root / "cdi"),
        "--state-dir",
        str(root / "state"),
        "--metrics-address",
        "127.0.0.1:0",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with subprocess.Popen(
        args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True
    ) as proc:
        for _ in range(1000):
            if marker.exists() or proc.poll() is not None:
                break
            anyio.run(anyio.sleep, 0.02)
        assert marker.exists(), "the telemetry read never started"
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        try:
            _, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, stderr = proc.communicate()
            pytest.fail(f"still running 30 s after SIGTERM with a vendor call hung:\n{stderr[-3000:]}")
        took = time.monotonic() - sent
    with capsys.disabled():
        print(f"\nSIGTERM to exit with a hung NVML telemetry read: {took:.2f} s")
    assert proc.returncode == 0, stderr
    assert "shutting down" in stderr
    hung = [line for line in stderr.splitlines() if "vendor calls still hung at exit" in line]
    assert hung and "read_telemetry_sync" in hung[0], stderr  # what hangs is named
    assert "Traceback" not in stderr
