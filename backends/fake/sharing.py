"""The fake backend's stand-ins for time-slicing and MPS (`backends.nvidia.sharing` drives them).

`FakeGpuPolicy` records each GPU's interval in ``<root>/timeslice.json`` (UUID -> interval, 0
is the default) and its compute mode in ``<root>/compute-mode.json`` instead of calling
``nvidia-smi``; `FakeMpsProgram` runs `backends.fake.mpsdaemon`, a real process that the agent
starts, re-adopts and stops exactly like NVIDIA's control daemon, and that records its limits.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path

import anyio
import anyio.to_thread

from backends.nvidia.mps import megabytes
from backends.nvidia.sharingconfig import MpsSettings

TIMESLICE_FILE = "timeslice.json"
COMPUTE_MODE_FILE = "compute-mode.json"


def _read(path: Path) -> dict[str, object]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return dict(raw) if isinstance(raw, dict) else {}


class FakeGpuPolicy:
    """Keeps the intervals in a JSON file (a crash test reads it from outside)."""

    def __init__(self, root: Path) -> None:
        self.path = root / TIMESLICE_FILE
        self.modes_path = root / COMPUTE_MODE_FILE
        # One change at a time: each rewrites a whole file (read, change, replace), and two GPUs
        # set up at once (two MPS claims in one prepare) lost an update or the other's temp file.
        self._writing = anyio.Lock()

    def intervals(self) -> dict[str, int]:
        """UUID -> interval as last set."""
        return {k: int(str(v)) for k, v in _read(self.path).items()}

    @staticmethod
    def _set(path: Path, uuid: str, value: object) -> None:
        values = _read(path)
        values[uuid] = value
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(values, sort_keys=True))
        os.replace(tmp, path)

    async def set_interval(self, uuid: str, interval: int) -> None:
        async with self._writing:
            await anyio.to_thread.run_sync(self._set, self.path, uuid, interval)

    async def set_compute_mode(self, uuid: str, mode: str) -> None:
        async with self._writing:
            await anyio.to_thread.run_sync(self._set, self.modes_path, uuid, mode)

    def modes(self) -> dict[str, str]:
        """UUID -> compute mode as last set."""
        return {k: str(v) for k, v in _read(self.modes_path).items()}


class FakeMpsProgram:
    """Runs `backends.fake.mpsdaemon` with the defaults on its command line."""

    marker = "backends.fake.mpsdaemon"

    def argv(self, settings: MpsSettings, uuid: str) -> list[str]:
        argv = [sys.executable, "-m", self.marker]
        if settings.active_thread_percentage is not None:
            argv += ["--active-thread-percentage", str(settings.active_thread_percentage)]
        pinned = settings.pinned_for(uuid)
        if pinned is not None:
            argv += ["--pinned-limit", f"{uuid}={megabytes(pinned)}"]
        return argv

    async def configure(self, env: Mapping[str, str], settings: MpsSettings, uuid: str) -> None:
        """The defaults went on the command line."""

    def launch_env(self, env: Mapping[str, str]) -> dict[str, str]:
        return dict(env)

    async def quit(self, env: Mapping[str, str], pid: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
