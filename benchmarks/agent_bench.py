"""Whole-process benchmark: start-up time and memory of ``dra-agent run`` on the fake backend.

Starts the agent as a real process with ``--kube none`` (no API server: it prints the slices it
would publish) and the kubelet sockets in a temporary directory, measures the time to the first
printed pool and to the registration sockets, then reads the process's resident memory
(``VmRSS``/``VmHWM`` from /proc) after it has settled and its CPU use while idle (no faults, no
claims: the health tracker, telemetry poller and servers only), for each profile.

Run: ``python -m benchmarks.agent_bench`` (``--quick``: one profile).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SETTLE_SECONDS = 3.0


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of `pid` in KiB (Linux)."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0])
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of `pid` so far (Linux /proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(profile: str, idle_seconds: float) -> list[tuple[str, str]]:
    with tempfile.TemporaryDirectory(prefix="dra-bench-", dir="/tmp") as tmp:
        root = Path(tmp)
        args = [
            sys.executable, "-m", "agent.cli", "run", "--kube", "none",
            "--backend", f"fake:profile={profile},control={root / 'fake.sock'}",
            "--registry-dir", str(root / "registry"), "--plugins-dir", str(root / "plugins"),
            "--cdi-root", str(root / "cdi"), "--state-dir", str(root / "state"),
            "--metrics-address", "127.0.0.1:0", "--log-level", "warning",
        ]  # fmt: skip
        start = time.perf_counter()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True
        ) as proc:
            assert proc.stdout is not None
            proc.stdout.readline()
            first_pool = time.perf_counter() - start
            while not list((root / "registry").glob("*-reg.sock")):
                time.sleep(0.005)
            sockets = time.perf_counter() - start
            time.sleep(SETTLE_SECONDS)
            cpu_before = cpu_seconds(proc.pid)
            time.sleep(idle_seconds)
            idle_cpu = (cpu_seconds(proc.pid) - cpu_before) / idle_seconds
            memory = memory_kib(proc.pid)
            proc.send_signal(signal.SIGTERM)
            stop = time.perf_counter()
            proc.communicate(timeout=30)
            stopped = time.perf_counter() - stop
    return [
        (f"{profile}: start to first pool printed", f"{first_pool * 1000:.0f} ms"),
        (f"{profile}: start to registration socket", f"{sockets * 1000:.0f} ms"),
        (f"{profile}: resident memory after {SETTLE_SECONDS:g} s", f"{memory['VmRSS'] / 1024:.1f} MiB"),
        (f"{profile}: peak resident memory", f"{memory['VmHWM'] / 1024:.1f} MiB"),
        (f"{profile}: idle CPU over {idle_seconds:g} s", f"{idle_cpu * 100:.2f} % of a core"),
        (f"{profile}: SIGTERM to exit", f"{stopped * 1000:.0f} ms"),
    ]


def main(quick: bool) -> None:
    rows: list[tuple[str, str]] = []
    for profile in ["mixed"] if quick else ["mixed", "nvidia-a100-8x", "amd-mi300x-8x-cpx"]:
        rows.extend(measure(profile, 5.0 if quick else 20.0))
    width = max(len(name) for name, _ in rows)
    print(f"{'measure'.ljust(width)}  value")
    for name, value in rows:
        print(f"{name.ljust(width)}  {value}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="dra-agent process start-up and memory")
    parser.add_argument("--quick", action="store_true", help="one profile only")
    main(parser.parse_args().quick)
