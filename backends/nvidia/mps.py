"""MPS control daemons: one per physical GPU or MIG device, under ``<state dir>/mps/<device>/``.

Each daemon runs in the foreground (``nvidia-cuda-mps-control -f``) as a child of the agent in
a session of its own, with ``CUDA_VISIBLE_DEVICES`` set to its device's UUID and its pipe and log
directories (``pipe/``, ``log/``) next to a record (``daemon.json``: pid, UUID, settings). It has
its own session on purpose: an agent restart must not take the MPS server from running pods. A
restarted agent re-adopts a daemon whose record names a live process of the right program, and
removes the record (and kills the process) of any daemon no prepared share needs, so daemons are
never duplicated or leaked. The defaults (active-thread percentage, pinned-memory limit) are set
through the control program, as NVIDIA's driver does.

Clients get the pipe directory mounted at ``/tmp/nvidia-mps`` with ``CUDA_MPS_PIPE_DIRECTORY``
pointing at it (what NVIDIA's driver injects); a memory share also gets
``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` for its device and a compute share
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` (`backends.nvidia.sharing` decides which, and when the
claim's config wins). `MpsProgram` is the seam: the real control program here, a small Python
stand-in in the fake backend.

Shared memory: MPS clients and the server exchange POSIX shared memory through ``/dev/shm``.
NVIDIA's DRA driver mounts a dedicated tmpfs as the daemon container's ``/dev/shm`` and the same
tmpfs at ``/dev/shm`` in every client container. We give each daemon a ``shm/`` directory (a
tmpfs when the agent may mount one, CAP_SYS_ADMIN; else a plain directory, logged once per
daemon start) and mount it at ``/dev/shm`` in each of its clients, so one daemon's clients share
one ``/dev/shm`` and clients of different daemons never see each other's. Mounted or not, the
directory is ``1777`` like ``/dev/shm`` itself (the tmpfs is mounted ``mode=1777`` and the
directory is chmod-ed after creation, whatever the umask), so a client container running as
any uid can create its segments there. The daemon is a child
process, not a container: when the tmpfs is mounted (so the agent may mount) and ``unshare`` is
installed, the daemon starts in a mount namespace of its own with that tmpfs bound over its
``/dev/shm`` (``unshare --mount`` execs in place, so the recorded pid is the daemon's); otherwise
it keeps the agent container's ``/dev/shm``. It is also told the directory in
``DRA_AGENT_MPS_SHM_DIRECTORY`` (read by the fake stand-in). What that leaves out is in the
README ("Sharing GPUs").
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import anyio
import anyio.to_thread

from agent.core.backend import ContainerEdits, Mount
from agent.core.errors import BackendError
from agent.core.logs import log_fields
from agent.core.quantity import Quantity
from backends.nvidia.driverfiles import ProgramLocator, on_path
from backends.nvidia.sharingconfig import MpsSettings

log = logging.getLogger("agent.nvidia.mps")

CONTAINER_PIPE_DIR = "/tmp/nvidia-mps"
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
PINNED_LIMIT_ENV = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
ACTIVE_THREADS_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
RECORD = "daemon.json"
STOP_TIMEOUT = 10.0
START_TIMEOUT = 30.0
CONTROL_PIPE = "control"
"""The named pipe a control daemon creates in its pipe directory once it serves clients."""
CONTROL_PROGRAM = "nvidia-cuda-mps-control"
CONTAINER_SHM_DIR = "/dev/shm"
SHM_ENV = "DRA_AGENT_MPS_SHM_DIRECTORY"
"""The daemon's shared-memory directory, in its environment (see the module's docstring)."""
SHM_SUBDIR = "shm"
SHM_MODE = 0o1777
"""World-writable and sticky, as ``/dev/shm``: clients run as any uid, none removes another's files."""
TMPFS_OPTIONS = f"rw,nosuid,nodev,mode={SHM_MODE:o}"


def megabytes(quantity: Quantity) -> str:
    """MPS limits are whole megabytes (MiB): ``20Gi`` -> ``20480M``."""
    return f"{int(quantity.value) // (1024 * 1024)}M"


class MpsProgram(Protocol):
    """How to run and configure a control daemon (the real one or the fake backend's)."""

    marker: str
    """A string of the daemon's command line, to recognise its process after a restart."""

    def argv(self, settings: MpsSettings, uuid: str) -> list[str]:
        """The foreground daemon's command line."""
        ...

    async def configure(self, env: Mapping[str, str], settings: MpsSettings, uuid: str) -> None:
        """Apply the defaults to a started daemon; raise `BackendError` when it refuses."""
        ...

    async def quit(self, env: Mapping[str, str], pid: int) -> None:
        """Ask the daemon `pid` to exit (the caller kills it if it does not)."""
        ...

    def launch_env(self, env: Mapping[str, str]) -> dict[str, str]:
        """The daemon's environment from `env` (blocking: may look the program up)."""
        ...


class ControlProgram:
    """NVIDIA's ``nvidia-cuda-mps-control``, found by `locate` (the driver's, or on the PATH)."""

    marker = CONTROL_PROGRAM

    def __init__(self, locate: ProgramLocator | None = None) -> None:
        self._locate = locate or on_path(CONTROL_PROGRAM)

    def argv(self, settings: MpsSettings, uuid: str) -> list[str]:
        return [self._locate().path, "-f"]

    def launch_env(self, env: Mapping[str, str]) -> dict[str, str]:
        return self._locate().environ(env)

    async def _send(self, env: Mapping[str, str], command: str) -> None:
        program = await anyio.to_thread.run_sync(self._locate)
        result = await anyio.run_process(
            [program.path], input=f"{command}\n".encode(), env=program.environ(env), check=False
        )
        if result.returncode != 0:
            raise BackendError(
                f"MPS control command {command!r} failed ({result.returncode}): "
                f"{result.stderr.decode(errors='replace').strip()}; see the daemon log in {env.get(LOG_ENV)}"
            )

    async def configure(self, env: Mapping[str, str], settings: MpsSettings, uuid: str) -> None:
        if settings.active_thread_percentage is not None:
            await self._send(env, f"set_default_active_thread_percentage {settings.active_thread_percentage}")
        pinned = settings.pinned_for(uuid)
        if pinned is not None:
            await self._send(env, f"set_default_device_pinned_mem_limit {uuid} {megabytes(pinned)}")

    async def quit(self, env: Mapping[str, str], pid: int) -> None:
        await self._send(env, "quit")


class ShmMounter(Protocol):
    """Mounts a tmpfs for a daemon's shared memory (blocking: called in a worker thread)."""

    def mount(self, path: Path) -> str:
        """Mount a tmpfs at `path`; "" on success, else why not (the directory then stays plain)."""
        ...

    def unmount(self, path: Path) -> None:
        """Unmount what `mount` mounted at `path`."""
        ...

    def wrap(self, argv: list[str], path: Path) -> list[str]:
        """The daemon's command line with `path` (a mounted tmpfs) as its ``/dev/shm``."""
        ...


class TmpfsMounter:
    """Through ``mount -t tmpfs`` (needs CAP_SYS_ADMIN: the chart's privileged container has it)."""

    def mount(self, path: Path) -> str:
        try:
            result = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", TMPFS_OPTIONS, "tmpfs", str(path)],
                capture_output=True,
                check=False,
                timeout=STOP_TIMEOUT,
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            return str(error)
        if result.returncode != 0:
            said = (result.stderr or result.stdout).decode(errors="replace").strip()
            return said or f"mount exited {result.returncode}"
        return ""

    def unmount(self, path: Path) -> None:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            subprocess.run(["umount", str(path)], capture_output=True, check=False, timeout=STOP_TIMEOUT)

    def wrap(self, argv: list[str], path: Path) -> list[str]:
        unshare = shutil.which("unshare")
        if unshare is None:
            log.warning(
                "unshare not found: the MPS daemon keeps the agent's /dev/shm, its clients another",
                extra=log_fields(directory=str(path), fix="install util-linux in the agent image"),
            )
            return argv
        # A private mount namespace: the bind stays the daemon's, and exec keeps its pid.
        script = 'mount --bind "$0" /dev/shm && exec "$@"'
        return [unshare, "--mount", "--propagation", "private", "--", "sh", "-c", script, str(path), *argv]


class NoMounter:
    """Never mounts (the fake backend: a plain directory stands in for the tmpfs)."""

    def mount(self, path: Path) -> str:
        return "this backend does not mount a tmpfs"

    def unmount(self, path: Path) -> None:
        """Nothing was mounted."""

    def wrap(self, argv: list[str], path: Path) -> list[str]:
        return argv


@dataclass(frozen=True)
class DaemonRecord:
    """What ``daemon.json`` holds."""

    pid: int
    uuid: str
    settings_key: str


def settings_key(settings: MpsSettings) -> str:
    """A stable text of the daemon-wide settings (a daemon is reused only with the same ones)."""
    return json.dumps(
        {
            "activeThreadPercentage": settings.active_thread_percentage,
            "pinned": settings.pinned_memory_limit.canonical() if settings.pinned_memory_limit else None,
            "perDevice": {k: v.canonical() for k, v in sorted(settings.per_device_pinned.items())},
        },
        sort_keys=True,
    )


class MpsDaemons:
    """The MPS control daemons of one backend."""

    def __init__(self, root: Path, program: MpsProgram, shm: ShmMounter | None = None) -> None:
        self.root = root
        self.program = program
        self.shm = shm or TmpfsMounter()
        self._children: dict[str, subprocess.Popen[bytes]] = {}
        """Daemons this process started (reaped when they stop); adopted ones are not here."""

    def directory(self, device: str) -> Path:
        return self.root / device

    def env(self, device: str, uuid: str) -> dict[str, str]:
        """The daemon's (and its control client's) environment."""
        base = self.directory(device)
        return {
            **os.environ,
            "CUDA_VISIBLE_DEVICES": uuid,
            PIPE_ENV: str(base / "pipe"),
            LOG_ENV: str(base / "log"),
            SHM_ENV: str(base / SHM_SUBDIR),
        }

    def _read(self, device: str) -> DaemonRecord | None:
        try:
            raw = json.loads((self.directory(device) / RECORD).read_text())
            return DaemonRecord(pid=int(raw["pid"]), uuid=str(raw["uuid"]), settings_key=str(raw["settings"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _alive(self, record: DaemonRecord) -> bool:
        child = self._children.get(str(record.pid))
        if child is not None:
            # Our own child: poll it (between fork and exec its command line is still ours).
            return child.poll() is None
        try:
            cmdline = (
                Path(f"/proc/{record.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            )
        except OSError:
            return False
        return self.program.marker in cmdline

    def _wait_ready(self, device: str, timeout: float) -> None:
        """Block (in a worker thread) until the daemon's control pipe exists, as NVIDIA's driver waits."""
        record = self._read(device)
        control = self.directory(device) / "pipe" / CONTROL_PIPE
        deadline = time.monotonic() + timeout
        while not control.exists():
            if record is None or not self._alive(record):
                raise BackendError(
                    f"the MPS control daemon for {device} exited at start; see its logs in "
                    f"{self.directory(device) / 'log'}"
                )
            if time.monotonic() > deadline:
                raise BackendError(
                    f"the MPS control daemon for {device} did not open {control} within {timeout:g} s; "
                    f"see its logs in {self.directory(device) / 'log'}"
                )
            time.sleep(0.005)

    def _wait_gone(self, record: DaemonRecord, timeout: float) -> bool:
        """Block (in a worker thread) until the daemon exits; False when it outlives `timeout`."""
        child = self._children.get(str(record.pid))
        if child is not None:
            try:
                child.wait(timeout)
                return True
            except subprocess.TimeoutExpired:
                return False
        deadline = time.monotonic() + timeout
        while self._alive(record):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)  # an adopted daemon is not our child: poll its /proc entry
        return True

    def running(self, device: str) -> bool:
        """True when a live daemon of ours serves `device`."""
        record = self._read(device)
        return record is not None and self._alive(record)

    def devices(self) -> list[str]:
        """Devices with a daemon directory (running or left behind)."""
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir())

    async def ensure(self, device: str, uuid: str, settings: MpsSettings) -> bool:
        """Start the device's daemon unless a live one with the same settings runs; True if started."""
        record = await anyio.to_thread.run_sync(self._read, device)
        if record is not None and await anyio.to_thread.run_sync(self._alive, record):
            if record.settings_key == settings_key(settings) and record.uuid == uuid:
                return False
            await self.stop(device)
        await anyio.to_thread.run_sync(self._spawn, device, uuid, settings)
        try:
            await anyio.to_thread.run_sync(self._wait_ready, device, START_TIMEOUT)
            await self.program.configure(self.env(device, uuid), settings, uuid)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.stop(device)
            raise
        return True

    def _remove(self, device: str) -> None:
        """Remove a daemon's directory, unmounting its shared-memory tmpfs first (blocking)."""
        shm = self.directory(device) / SHM_SUBDIR
        if os.path.ismount(shm):
            self.shm.unmount(shm)
        shutil.rmtree(self.directory(device), ignore_errors=True)

    def _spawn(self, device: str, uuid: str, settings: MpsSettings) -> None:
        base = self.directory(device)
        # Look the program up first: a missing one fails the claim with nothing left behind.
        argv = self.program.argv(settings, uuid)
        env = self.program.launch_env(self.env(device, uuid))
        self._remove(device)
        for sub in ("pipe", "log", SHM_SUBDIR):
            (base / sub).mkdir(parents=True, exist_ok=True)
        if reason := self.shm.mount(base / SHM_SUBDIR):
            log.info(
                "MPS shared memory is a plain directory, not a tmpfs: the agent cannot mount",
                extra=log_fields(device=device, directory=str(base / SHM_SUBDIR), reason=reason),
            )
        else:
            argv = self.shm.wrap(argv, base / SHM_SUBDIR)
        try:
            # mkdir's mode is cut by the umask (0755 as root): clients of any uid must create segments.
            os.chmod(base / SHM_SUBDIR, SHM_MODE)
        except OSError as error:
            self._remove(device)
            raise BackendError(
                f"cannot make the MPS shared-memory directory {base / SHM_SUBDIR} writable by every "
                f"client uid: {error}"
            ) from error
        try:
            with (base / "log" / "agent-launch.log").open("ab") as out:
                child = subprocess.Popen(
                    argv,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=out,
                    start_new_session=True,
                )
        except OSError as error:
            self._remove(device)
            raise BackendError(
                f"cannot start the MPS control daemon for {device}: {error}; check that "
                f"{CONTROL_PROGRAM} is installed with the driver (the nvidia backend's driver-root)"
            ) from error
        self._children[str(child.pid)] = child
        record = {"pid": child.pid, "uuid": uuid, "settings": settings_key(settings)}
        tmp = base / (RECORD + ".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, base / RECORD)
        log.info("started MPS control daemon", extra=log_fields(device=device, pid=child.pid, uuid=uuid))

    async def stop(self, device: str) -> None:
        """Stop the device's daemon (quit, then SIGKILL after `STOP_TIMEOUT`) and remove its directory."""
        record = await anyio.to_thread.run_sync(self._read, device)
        if record is not None and await anyio.to_thread.run_sync(self._alive, record):
            try:
                await self.program.quit(self.env(device, record.uuid), record.pid)
            except (BackendError, OSError) as error:
                log.warning("MPS daemon did not take quit", extra=log_fields(device=device, error=str(error)))
            if not await anyio.to_thread.run_sync(self._wait_gone, record, STOP_TIMEOUT):
                await anyio.to_thread.run_sync(_kill, record.pid)
            log.info("stopped MPS control daemon", extra=log_fields(device=device, pid=record.pid))
        if record is not None:
            child = self._children.pop(str(record.pid), None)
            if child is not None:
                await anyio.to_thread.run_sync(child.wait)
        await anyio.to_thread.run_sync(self._remove, device)

    def edits(
        self, device: str, uuid: str, pinned: Quantity | None, active_threads: int | None = None
    ) -> ContainerEdits:
        """A client's edits: the pipe and shared-memory directories, the pipe variable, the share's
        pinned-memory limit and its active-thread percentage (None: the daemon's default applies)."""
        env = {PIPE_ENV: CONTAINER_PIPE_DIR}
        if pinned is not None:
            env[PINNED_LIMIT_ENV] = f"{uuid}={megabytes(pinned)}"
        if active_threads is not None:
            env[ACTIVE_THREADS_ENV] = str(active_threads)
        return ContainerEdits(
            env=env,
            list_env=frozenset({PINNED_LIMIT_ENV}) if pinned is not None else frozenset(),
            mounts=(
                Mount(
                    str(self.directory(device) / "pipe"),
                    CONTAINER_PIPE_DIR,
                    ("rw", "nosuid", "nodev", "bind"),
                ),
                Mount(
                    str(self.directory(device) / SHM_SUBDIR),
                    CONTAINER_SHM_DIR,
                    ("rw", "nosuid", "nodev", "bind"),
                ),
            ),
        )


def _kill(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)


async def stop_unneeded(daemons: MpsDaemons, needed: Sequence[str]) -> None:
    """Stop every daemon (or leftover directory) of a device not in `needed`."""
    for device in await anyio.to_thread.run_sync(daemons.devices):
        if device not in needed:
            log.info("stopping an MPS daemon no prepared claim uses", extra=log_fields(device=device))
            await daemons.stop(device)
