"""Fixtures of the AMD backend tests: AMD's real amdsmi over the stand-in library, and a fake sysfs."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from agent.core.backend import BackendOptions
from backends.amd.backend import AmdBackend
from backends.amd.edits import StatFn
from tests.fakes.amd_standin import GpuSpec, StandIn, load
from tests.support.clock import FakeClock

MakeBackend = Callable[..., tuple[AmdBackend, StandIn]]


def make_sysfs(root: Path, gpus: Sequence[GpuSpec], simd_per_cu: int | None = None) -> Path:
    """A /sys tree with PCI devices under their root complexes and KFD topology nodes."""
    for gpu in gpus:
        domain, bus, _ = gpu.bdf.split(":", 2)
        parent_bdf = gpu.bdf[:-1] + "0"
        real = root / "devices" / f"pci{domain}:{int(bus, 16) & 0xC0:02x}" / f"{domain}:00:01.1" / parent_bdf
        real.mkdir(parents=True, exist_ok=True)
        link = root / "bus" / "pci" / "devices" / parent_bdf
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.exists():
            link.symlink_to(real)
        node = root / "class" / "kfd" / "kfd" / "topology" / "nodes" / str(gpu.kfd_node)
        node.mkdir(parents=True, exist_ok=True)
        simds = gpu.num_compute_units * (simd_per_cu or 4)
        node.joinpath("properties").write_text(
            f"cpu_cores_count 0\nsimd_count {simds}\ndrm_render_minor {gpu.render}\nbad_line x\n"
        )
        drm = root / "class" / "drm" / f"renderD{gpu.render}" / "device" / "drm"
        drm.mkdir(parents=True, exist_ok=True)
        (drm / f"card{gpu.card}").mkdir(exist_ok=True)
        (drm / f"renderD{gpu.render}").mkdir(exist_ok=True)
    return root


@pytest.fixture
def standin() -> Iterator[StandIn]:
    """The stand-in library under the real amdsmi, emptied (and any hung call released) after the test."""
    lib = load()
    yield lib
    lib.release()
    lib.configure([])


@pytest.fixture
def make_backend(standin: StandIn, fake_clock: FakeClock) -> MakeBackend:
    """``make_backend(gpus, settings=..., stat_fn=..., **behaviour)`` -> (backend, stand-in)."""

    def make(
        gpus: Sequence[GpuSpec],
        settings: dict[str, str] | None = None,
        driver: str | None = None,
        stat_fn: StatFn = os.stat,
        **behaviour: object,
    ) -> tuple[AmdBackend, StandIn]:
        standin.configure(gpus, **behaviour)
        options = BackendOptions("node-1", driver, settings or {"sysfs-root": os.devnull})
        return AmdBackend(options, clock=fake_clock, stat_fn=stat_fn), standin

    return make
