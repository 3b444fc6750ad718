"""Shared helpers of the fake-backend tests."""

from __future__ import annotations

import atexit
import functools
import itertools
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

import anyio.lowlevel

from agent.core.backend import BackendOptions, HealthEvent
from agent.core.clock import Clock
from backends.fake import create_backend
from backends.fake.backend import FakeBackend
from backends.fake.faults import FaultInjector


def make_backends(
    profile: str = "mixed", clock: Clock | None = None, control: str = "off", **settings: str
) -> tuple[list[FakeBackend], FaultInjector]:
    """Fake backends of `profile` and their shared injector."""
    made = create_backend(
        BackendOptions("node-a", settings={"profile": profile, "control": control, **settings}), clock=clock
    )
    backends = [b for b in made if isinstance(b, FakeBackend)]
    assert len(backends) == len(made)
    return backends, backends[0].injector


@functools.cache
def _socket_dir() -> Path:
    # One short folder per test process (tmp_path can exceed the 108-byte socket path limit).
    folder = Path(tempfile.mkdtemp(dir="/tmp", prefix="dra-fake-"))
    atexit.register(shutil.rmtree, folder, True)
    return folder


def short_socket_path() -> str:
    """A fresh Unix socket path short enough for the kernel's limit."""
    return str(_socket_dir() / f"{next(_counter)}.sock")


_counter = itertools.count()


class Collector:
    """A `HealthSink` that keeps what it gets."""

    def __init__(self) -> None:
        self.events: list[HealthEvent] = []

    async def __call__(self, event: HealthEvent) -> None:
        self.events.append(event)

    def conditions(self) -> Sequence[tuple[str, str, str, bool]]:
        return [(e.device, e.condition, e.value, e.cleared) for e in self.events]


def exists(path: str) -> bool:
    """Sync file check (keeps blocking calls out of async test bodies)."""
    return Path(path).exists()


def write_text(path: str, text: str) -> None:
    Path(path).write_text(text)


def read_text(path: str) -> str:
    return Path(path).read_text()


async def settle(rounds: int = 10) -> None:
    """Let woken tasks run (``wait_all_tasks_blocked`` polls every 100 ms on asyncio: too slow in loops)."""
    for _ in range(rounds):
        await anyio.lowlevel.checkpoint()
