"""Dynamic MIG placements in the order that makes the scheduler's first fit pack well.

The scheduler's allocator (upstream ``staging/src/k8s.io/dynamic-resource-allocation/structured/
internal/stable/allocator_stable.go``, ``internal/incubating/allocator_incubating.go`` and
``internal/experimental/allocator_experimental.go``, ``allocateOne``) walks the pools, each pool's
slices in the order ``GatherPools``/``addSlice`` (``pools_*.go``) collected them, and each slice's
devices in index order; it takes the first device that is not allocated, matches the claim and
whose consumed counters all fit in what is left of their counter set. Claims of different pods
arrive one at a time, so the published order is the packing policy. `first_fit` replays that
over our devices. The placements are NVIDIA's (MIG user guide, "Supported MIG Profiles"), from
`backends.fake.migtables`.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any

import pytest

from agent.core.model import Device
from agent.kube.pool import build_pool
from backends.fake.migtables import A100_80GB, H100_80GB
from backends.nvidia.migprofiles import MigLayout, MigProfile, dynamic_devices, packing_order
from tests.fakes.libnvml import MigLibNvml, dynamic_gpu
from tests.kube.harness import DRIVER, harness
from tests.nvidia.conftest import BackendFactory

Claim = Callable[[Device], bool]
TABLES = pytest.mark.parametrize("table", [A100_80GB, H100_80GB], ids=["a100-80gb", "h100-80gb"])
CORE = ("1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")
"""The profiles the user guide's diagrams combine (no media extensions, no 1g.20gb)."""


def any_mig(device: Device) -> bool:
    """NVIDIA's ``anymig`` demo claim: any device of the ``mig.nvidia.com`` class."""
    return device.attributes.get("type") == "mig"


def profile(name: str) -> Claim:
    return lambda device: device.attributes.get("profile") == name


def gpu(table: Mapping[int, MigProfile], minor: int = 0) -> list[Device]:
    """One partitionable GPU as the backends publish it: the whole GPU, then the placements."""
    whole = Device(f"gpu-{minor}", "gpu.nvidia.com", {"type": "gpu"}, uuid=f"GPU-{minor}")
    device, placements = dynamic_devices(
        whole, f"GPU-{minor}", minor, minor, MigLayout(tuple(table.values()))
    )
    return [device, *(d for d, _ in placements)]


def _natural(name: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def previous_order(devices: Sequence[Device]) -> list[Device]:
    """The order published before: every placement by name, in reverse natural order."""
    return [devices[0], *sorted(devices[1:], key=lambda d: _natural(d.name), reverse=True)]


def _totals(devices: Sequence[Device]) -> dict[tuple[str, str], Fraction]:
    return {(s.name, k): v.value for d in devices for s in d.counter_sets for k, v in s.counters.items()}


def _take(
    totals: Mapping[tuple[str, str], Fraction], used: dict[tuple[str, str], Fraction], device: Device
) -> bool:
    """Take `device`'s counters if they all fit in what is left (the allocator's check)."""
    need = [((c.counter_set, k), v.value) for c in device.consumes_counters for k, v in c.counters.items()]
    if any(used.get(key, 0) + value > totals[key] for key, value in need):
        return False
    for key, value in need:
        used[key] = used.get(key, Fraction(0)) + value
    return True


def first_fit(devices: Sequence[Device], claims: Sequence[Claim]) -> list[str | None]:
    """Allocate one claim after the other as the allocator does (None: nothing fits)."""
    totals = _totals(devices)
    used: dict[tuple[str, str], Fraction] = {}
    taken: set[str] = set()
    out: list[str | None] = []
    for wants in claims:
        chosen = next(
            (d.name for d in devices if d.name not in taken and wants(d) and _take(totals, used, d)), None
        )
        if chosen is not None:
            taken.add(chosen)
        out.append(chosen)
    return out


def maximal_layouts(devices: Sequence[Device], profiles: Sequence[str]) -> set[tuple[str, ...]]:
    """Every valid layout of `profiles` to which no placement can be added, as its placements."""
    totals = _totals(devices)
    placements = sorted((d for d in devices if d.attributes.get("profile") in profiles), key=lambda d: d.name)
    found: set[tuple[str, ...]] = set()

    def grow(start: int, chosen: tuple[Device, ...], used: dict[tuple[str, str], Fraction]) -> None:
        room = False
        for i, device in enumerate(placements):
            more = dict(used)
            if not _take(totals, more, device):
                continue
            room = True
            if i >= start:
                grow(i + 1, (*chosen, device), more)
        if not room:
            found.add(tuple(d.name for d in chosen))

    grow(0, (), {})
    return found


def arrivals(devices: Sequence[Device], layouts: set[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """Every distinct arrival order of the layouts' profiles (one claim per MIG device)."""
    by_name = {d.name: str(d.attributes.get("profile")) for d in devices}
    kinds = {tuple(sorted(by_name[n] for n in layout)) for layout in layouts}
    return sorted({order for kind in kinds for order in itertools.permutations(kind)})


def fits_all(devices: Sequence[Device], order: Sequence[str]) -> bool:
    return None not in first_fit(devices, [profile(p) for p in order])


# -- the two cases found against kube-scheduler 1.36 ----------------------------------------------


@TABLES
def test_any_mig_claims_take_the_smallest_placements(table: Mapping[int, MigProfile]) -> None:
    devices = gpu(table)
    got = first_fit(devices, [any_mig] * 3 + [profile("3g.40gb")])
    assert got == [
        "gpu-0-mig-1g10gb-19-2",
        "gpu-0-mig-1g10gb-19-3",
        "gpu-0-mig-1g10gb-19-0",
        "gpu-0-mig-3g40gb-9-4",
    ]
    # Before: the 7g.80gb came first in reverse name order and took the whole GPU.
    assert first_fit(previous_order(devices), [any_mig] * 3) == ["gpu-0-mig-7g80gb-0-0", None, None]


@TABLES
def test_two_2g_then_a_3g_fit(table: Mapping[int, MigProfile]) -> None:
    devices = gpu(table)
    claims = [profile("2g.20gb"), profile("2g.20gb"), profile("3g.40gb")]
    assert first_fit(devices, claims) == [
        "gpu-0-mig-2g20gb-14-0",
        "gpu-0-mig-2g20gb-14-2",
        "gpu-0-mig-3g40gb-9-4",
    ]
    # Before: the 2g.20gb took 4 then 2, and no 3g.40gb placement was left.
    assert first_fit(previous_order(devices), claims) == [
        "gpu-0-mig-2g20gb-14-4",
        "gpu-0-mig-2g20gb-14-2",
        None,
    ]


# -- every arrival order of the valid layouts ----------------------------------------------------


def test_no_fixed_order_fits_every_arrival_order() -> None:
    """A first 2g.20gb must be at 4 for 2g, 4g, 1g and must not be for 2g, 2g, 3g: whatever
    order the 2g.20gb placements are listed in, one of the two fails."""
    devices = gpu(A100_80GB)
    twos = [d for d in devices if d.attributes.get("profile") == "2g.20gb"]
    others = [d for d in devices if d not in twos]
    for listed in itertools.permutations(twos):
        order = [*others, *listed]
        assert not (
            fits_all(order, ["2g.20gb", "4g.40gb", "1g.10gb"])
            and fits_all(order, ["2g.20gb", "2g.20gb", "3g.40gb"])
        )


@TABLES
def test_arrival_orders_of_the_valid_layouts(table: Mapping[int, MigProfile]) -> None:
    """The maximal layouts of the five profiles (19, as the user guide's diagram of A100 and H100
    placements allows) and all 65 arrival orders: the order fits 55 (an exhaustive search over
    every order of the 1g, 2g and 3g placements finds none that fits more); the one before, 50.
    What does not fit: a 4g.40gb after a smaller profile took its only placement (the price of
    keeping the 3g.40gb at 4 free), and a 1g.10gb before the last of two or three 2g.20gb."""
    devices = gpu(table)
    layouts = maximal_layouts(devices, CORE)
    assert len(layouts) == 19
    orders = list(arrivals(devices, layouts))
    assert len(orders) == 65
    failing = {" ".join(p.split(".")[0] for p in o) for o in orders if not fits_all(devices, o)}
    assert failing == {
        "1g 1g 1g 4g",
        "1g 1g 4g 1g",
        "1g 4g 1g 1g",
        "1g 2g 4g",
        "1g 4g 2g",
        "2g 1g 4g",
        "2g 4g 1g",
        "1g 1g 1g 2g 2g",
        "1g 2g 2g 2g",
        "2g 1g 2g 2g",
    }
    assert sum(fits_all(previous_order(devices), o) for o in orders) == 50


@TABLES
def test_layouts_with_media_extensions_and_1g20gb_fit_more_often_than_before(
    table: Mapping[int, MigProfile],
) -> None:
    devices = gpu(table)
    names = sorted({str(d.attributes["profile"]) for d in devices[1:]})
    orders = list(arrivals(devices, maximal_layouts(devices, names)))
    assert len(orders) == 1041
    assert sum(fits_all(devices, o) for o in orders) == 722
    assert sum(fits_all(previous_order(devices), o) for o in orders) == 621


def test_names_stay_and_the_order_is_the_packing_order() -> None:
    devices = gpu(A100_80GB)
    layout = MigLayout(tuple(A100_80GB.values()))
    assert [(d.attributes["profile"], d.name.rsplit("-", 1)[1]) for d in devices[1:]] == [
        (p.name, str(at.start)) for p, at in packing_order(layout)
    ]
    assert len(devices) == 26 and len({d.name for d in devices}) == 26
    assert "gpu-0-mig-3g40gb-9-4" in {d.name for d in devices}


# -- as published ----------------------------------------------------------------------------------


async def test_the_nvidia_backend_discovers_the_placements_in_packing_order(
    make_backend: BackendFactory, tmp_path: Any
) -> None:
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "nvidiactl").touch()
    nvml = MigLibNvml(
        [dynamic_gpu("NVIDIA A100-SXM4-80GB", 0)], proc_root=tmp_path / "proc", dev_root=tmp_path / "dev"
    )
    backend = make_backend(nvml, cdi_mode="own", dynamic_mig="true", dynamic_mig_dir=str(tmp_path / "state"))
    await backend.start()
    try:
        devices = list(await backend.discover())
    finally:
        await backend.stop()
    expected = [d.name for d in gpu(A100_80GB)]
    assert [d.name for d in devices if d.name.startswith("gpu-0")] == expected
    claims = [profile("2g.20gb"), profile("2g.20gb"), profile("3g.40gb")]
    assert None not in first_fit(devices, claims)


def _pool(devices: Sequence[Device], minor: int) -> list[dict[str, Any]]:
    return build_pool(
        driver="gpu.nvidia.com",
        node_name="node-1",
        node_uid="",
        devices=devices,
        taints={},
        minor=minor,
        max_devices=128 if minor < 35 else 64,
    )


@pytest.mark.parametrize("minor", [34, 36])
def test_each_gpu_is_in_one_slice(minor: int) -> None:
    """The allocator takes a pool's slices in the order the informer lists them, which is not
    fixed: only the order inside a slice is ours. Each GPU's devices stay in one slice."""
    devices = [*gpu(A100_80GB, 0), *gpu(H100_80GB, 1), *gpu(A100_80GB, 2)]
    for minor_ in range(3):
        holding = [
            o
            for o in _pool(devices, minor)
            if any(d["name"].startswith(f"gpu-{minor_}") for d in o["spec"].get("devices", []))
        ]
        assert len(holding) == 1


@pytest.mark.parametrize("minor", [34, 36])
def test_the_published_pool_keeps_the_packing_order(minor: int) -> None:
    devices = [*gpu(A100_80GB, 0), *gpu(H100_80GB, 1)]
    slices = _pool(devices, minor)
    published = [d["name"] for o in slices for d in o["spec"].get("devices", [])]
    assert published == [d.name for d in devices]
    by_name = {d.name: d for d in devices}
    in_order = [by_name[n] for n in published]
    assert first_fit(in_order, [any_mig] * 3)[-1] == "gpu-0-mig-1g10gb-19-0"
    assert None not in first_fit(in_order, [profile("2g.20gb"), profile("2g.20gb"), profile("3g.40gb")])


@pytest.mark.parametrize("version", ["1.34", "1.36"])
async def test_the_publisher_writes_the_placements_in_packing_order(version: str) -> None:
    """End to end: the backend's devices through the inventory and the publisher into the slices
    the API server stores; the scheduler then fits 2g, 2g, 3g and three "any MIG" claims."""
    devices = [dataclasses.replace(d, driver=DRIVER) for d in gpu(A100_80GB)]
    gates = {"DRAPartitionableDevices": True, "DRADeviceTaints": True}
    async with harness(version=version, gates=gates, devices=devices) as h:
        await h.settle(lambda: len(h.devices()) == len(devices))
        published = [d["name"] for s in h.slices() for d in s["spec"].get("devices") or []]
    assert published == [d.name for d in devices]
