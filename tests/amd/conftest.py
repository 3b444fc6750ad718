"""Fixtures of the AMD backend tests: the fake amdsmi installed as ``amdsmi`` and a fake sysfs."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from agent.core.backend import BackendOptions
from backends.amd.backend import AmdBackend
from backends.amd.edits import StatFn
from tests.fakes.fake_amdsmi import FakeAmdSmi, FakeGpu
from tests.support.clock import FakeClock

MakeBackend = Callable[..., tuple[AmdBackend, FakeAmdSmi]]


def make_sysfs(root: Path, gpus: Sequence[FakeGpu], simd_per_cu: int | None = None) -> Path:
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
def make_backend(monkeypatch: pytest.MonkeyPatch, fake_clock: FakeClock) -> MakeBackend:
    """``make_backend(gpus, settings=..., stat_fn=..., **fake_kwargs)`` -> (backend, fake module)."""

    def make(
        gpus: Sequence[FakeGpu],
        settings: dict[str, str] | None = None,
        driver: str | None = None,
        stat_fn: StatFn = os.stat,
        **fake_kwargs: object,
    ) -> tuple[AmdBackend, FakeAmdSmi]:
        fake = FakeAmdSmi(gpus, **fake_kwargs)  # type: ignore[arg-type]
        monkeypatch.setitem(sys.modules, "amdsmi", fake)
        options = BackendOptions("node-1", driver, settings or {"sysfs-root": os.devnull})
        return AmdBackend(options, clock=fake_clock, stat_fn=stat_fn), fake

    return make
