"""Sockets left behind by another agent pod of this node that died (``kill -9`` during a rollout).

With a pod UID each pod serves ``<plugins>/<driver>/dra-<uid>.sock`` and registers
``<registry>/<driver>-<uid>-reg.sock``. A pod killed with SIGKILL cannot remove them: the kubelet's
plugin watcher keeps the dead registration socket and its calls get UNAVAILABLE. The surviving pod
removes such sockets, but only once connecting proves them dead twice, `CONFIRM_SECONDS` apart,
with the same file (a pod that is just starting binds before it listens: one refused connect is
not proof).
"""

from __future__ import annotations

import logging
import os
import re
import socket
from pathlib import Path

import anyio

from agent.core.clock import Clock
from agent.core.logs import log_fields

log = logging.getLogger("agent.kubelet.peersockets")

SWEEP_SECONDS = 10.0
CONFIRM_SECONDS = 5.0


def refuses(path: Path) -> bool:
    """Whether connecting to the unix socket `path` is refused (nobody listens), blocking."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.1)
        try:
            probe.connect(str(path))
        except ConnectionRefusedError:
            return True
        except OSError:
            return False  # gone, or there but busy: not ours to remove
        return False


class DeadPeerSockets:
    """Finds and removes the dead sockets of other pods of one driver; `run` until cancelled."""

    def __init__(
        self, driver: str, plugins_dir: Path, registry_dir: Path, own_uid: str, clock: Clock
    ) -> None:
        self._clock = clock
        self._own_uid = own_uid
        self._patterns = (
            (plugins_dir / driver, re.compile(r"^dra-(?P<uid>[^/]+)\.sock$")),
            (registry_dir, re.compile(rf"^{re.escape(driver)}-(?P<uid>[^/]+)-reg\.sock$")),
        )
        # path -> (the file's identity, first refused at); a rebound file is another one.
        self._suspects: dict[Path, tuple[tuple[int, int], float]] = {}

    def candidates(self) -> list[Path]:
        """Other pods' sockets of this driver (blocking)."""
        found = []
        for directory, pattern in self._patterns:
            try:
                names = os.listdir(directory)
            except FileNotFoundError:
                continue
            for name in names:
                match = pattern.match(name)
                if match and match["uid"] != self._own_uid:
                    found.append(directory / name)
        return found

    def sweep(self) -> list[Path]:
        """One look (blocking): the sockets removed now."""
        now = self._clock.monotonic()
        removed: list[Path] = []
        seen: dict[Path, tuple[tuple[int, int], float]] = {}
        for path in self.candidates():
            try:
                info = path.lstat()
            except FileNotFoundError:
                continue
            inode = (info.st_ino, info.st_ctime_ns)
            if not refuses(path):
                continue
            first = self._suspects.get(path)
            if first is None or first[0] != inode:
                seen[path] = (inode, now)
                continue
            if now - first[1] < CONFIRM_SECONDS:
                seen[path] = first
                continue
            path.unlink(missing_ok=True)
            removed.append(path)
            log.info("removed the socket of an agent pod that is gone", extra=log_fields(path=str(path)))
        self._suspects = seen
        return removed

    async def run(self) -> None:
        while True:
            await anyio.to_thread.run_sync(self.sweep)
            await self._clock.sleep(SWEEP_SECONDS)
