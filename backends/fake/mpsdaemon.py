"""A stand-in MPS control daemon for the fake backend: ``python -m backends.fake.mpsdaemon``.

It does what the agent can observe of the real one: it runs in the foreground until SIGTERM,
and it records what it was started with (device, pipe and shared-memory directories, defaults) in
``$CUDA_MPS_LOG_DIRECTORY/daemon-state.json``, so tests and the demo can see the limits.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from types import FrameType

STATE_FILE = "daemon-state.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fake-mps-control")
    parser.add_argument("--active-thread-percentage", type=int, default=None)
    parser.add_argument("--pinned-limit", default=None, help="UUID=<N>M, the default pinned-memory limit")
    args = parser.parse_args(argv)
    log_dir = Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY", "."))
    state = {
        "pid": os.getpid(),
        "device": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        "pipeDirectory": os.environ.get("CUDA_MPS_PIPE_DIRECTORY", ""),
        "shmDirectory": os.environ.get("DRA_AGENT_MPS_SHM_DIRECTORY", ""),
        "defaultActiveThreadPercentage": args.active_thread_percentage,
        "defaultPinnedDeviceMemoryLimit": args.pinned_limit,
    }
    tmp = log_dir / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state, sort_keys=True))
    os.replace(tmp, log_dir / STATE_FILE)
    # Ready, as the real daemon's control pipe says: after the record, so a reader finds both.
    os.mkfifo(Path(state["pipeDirectory"] or ".") / "control")

    def stop(signum: int, frame: FrameType | None) -> None:
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    while True:
        signal.pause()


if __name__ == "__main__":
    sys.exit(main())
