"""Fixtures of the NVIDIA backend tests: an NVML node (pynvml over the stand-in libnvidia-ml), a
sysfs tree, a backend factory."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest

from agent.core.backend import BackendOptions, HealthEvent
from backends.nvidia import NvidiaBackend
from backends.nvidia.capnodes import NodeMaker, mknod
from tests.fakes.libnvml import LibNvml, a100_full_mig, a100_mig, h100, l4
from tests.support.clock import FakeClock

# Bus IDs of the fixture GPUs and their PCIe roots: the two A100s share one root, H100 and L4 another.
PCIE_ROOTS = {
    "0000:07:00.0": "pci0000:00",
    "0000:0f:00.0": "pci0000:00",
    "0000:18:00.0": "pci0000:10",
    "0000:3b:00.0": "pci0000:10",
}


def build_sysfs(root: Path, roots: Mapping[str, str] = PCIE_ROOTS) -> Path:
    """A sysfs tree where /sys/bus/pci/devices/<bus id> links under /sys/devices/<root>/..."""
    for bus_id, pci_root in roots.items():
        device = root / "devices" / pci_root / f"{pci_root[3:]}:01.0" / bus_id
        device.mkdir(parents=True)
        link = root / "bus" / "pci" / "devices" / bus_id
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(device)
    return root


@pytest.fixture
def fake() -> LibNvml:
    """A node with an A100 (four MIG devices), an A100 (one 7g.80gb), an H100 and an L4."""
    return LibNvml([a100_mig(0), a100_full_mig(1), h100(2), l4(3)])


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    return build_sysfs(tmp_path / "sys")


BackendFactory = Callable[..., NvidiaBackend]


@pytest.fixture
def make_backend(tmp_path: Path, sysfs: Path, fake_clock: FakeClock) -> BackendFactory:
    """``make_backend(fake, **settings)``: a backend on the stand-in libnvidia-ml with test roots.

    The host's filesystem is ``tmp_path/host`` (setting ``host-root``) unless a test says otherwise;
    device nodes are read from ``tmp_path/dev`` unless ``real_dev_dir`` (then: as the backend finds them).
    """

    def factory(
        nvml: LibNvml,
        driver_name: str | None = None,
        *,
        real_dev_dir: bool = False,
        make_node: NodeMaker = mknod,
        health_interval: float = 5.0,
        call_timeout: float = 30.0,
        **settings: str,
    ) -> NvidiaBackend:
        # The host is a test tree: never the machine's own /etc/cdi, /var/run/cdi or libraries.
        settings.setdefault("host_root", str(tmp_path / "host"))
        options = BackendOptions(
            "node-1",
            driver_name,
            {k.replace("_", "-"): v for k, v in settings.items()},
            health_interval=health_interval,
        )
        return NvidiaBackend(
            options,
            nvml_module=nvml.module,
            clock=fake_clock,
            sysfs_root=sysfs,
            proc_root=tmp_path / "proc",
            dev_root=None if real_dev_dir else tmp_path / "dev",
            make_node=make_node,
            call_timeout=call_timeout,
        )

    return factory


@asynccontextmanager
async def monitoring(backend: NvidiaBackend, sink: Sink) -> AsyncIterator[anyio.abc.TaskGroup]:
    """Start `backend` and run its health monitor for the duration of the block."""
    await backend.start()
    async with anyio.create_task_group() as tg:
        tg.start_soon(backend.monitor_health, sink)
        yield tg
        tg.cancel_scope.cancel()
    await backend.stop()


@dataclass(frozen=True)
class Pass:
    """One `report_pass` the sink got."""

    devices: frozenset[str]
    failed_checks: tuple[str, ...]


class Sink:
    """A `HealthSink` collecting events and health passes; `wait_for` waits (bounded) until a
    predicate holds."""

    def __init__(self) -> None:
        self.events: list[HealthEvent] = []
        self.passes: list[Pass] = []
        self._changed = anyio.Event()

    async def __call__(self, event: HealthEvent) -> None:
        self.events.append(event)
        self._signal()

    def pass_completed(self, devices: Collection[str], failed_checks: Collection[str] = ()) -> None:
        self.passes.append(Pass(frozenset(devices), tuple(failed_checks)))
        self._signal()

    def _signal(self) -> None:
        changed, self._changed = self._changed, anyio.Event()
        changed.set()

    async def wait_passes(self, count: int) -> None:
        """Until `count` health passes have completed."""
        with anyio.fail_after(5):
            while len(self.passes) < count:
                await self._changed.wait()

    async def wait_for(self, predicate: Callable[[list[HealthEvent]], Any]) -> None:
        with anyio.fail_after(5):
            while not predicate(self.events):
                await self._changed.wait()

    async def wait_count(self, count: int) -> None:
        await self.wait_for(lambda events: len(events) >= count)


async def until(predicate: Callable[[], object]) -> None:
    """Poll (bounded) for a state that a worker thread changes in the stand-in libnvidia-ml; no
    event can signal it."""
    with anyio.fail_after(5):
        for _ in itertools.count():
            if predicate():
                return
            await anyio.sleep(0.005)
