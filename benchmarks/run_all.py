"""Run every benchmark, one process each, and print their tables: ``make bench``.

``python -m benchmarks.run_all [--quick]``; the figures and the commands are recorded in
benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

# (module, accepts --quick)
BENCHMARKS = [
    ("benchmarks.agent_bench", True),
    ("benchmarks.publish_bench", True),
    ("benchmarks.prepare_bench", True),
    ("benchmarks.sharing_bench", True),
    ("benchmarks.kubelet_e2e_bench", True),
    ("benchmarks.grpc_bench", True),
    ("benchmarks.scrape_bench", False),
    ("benchmarks.nvidia_bench", True),
    ("benchmarks.amd_bench", False),
    ("benchmarks.dynamic_mig_bench", True),
    ("benchmarks.health_pass_bench", True),
    ("benchmarks.health_latency_bench", True),
]


def main(quick: bool) -> int:
    failed = []
    for module, has_quick in BENCHMARKS:
        command = [sys.executable, "-m", module, *(["--quick"] if quick and has_quick else [])]
        print(f"\n## {' '.join(['python', *command[1:]])}", flush=True)
        start = time.perf_counter()
        if subprocess.run(command, check=False).returncode != 0:
            failed.append(module)
        print(f"({time.perf_counter() - start:.1f} s)", flush=True)
    if failed:
        print(f"\nfailed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="run every benchmark")
    parser.add_argument("--quick", action="store_true", help="shorter runs")
    sys.exit(main(parser.parse_args().quick))
