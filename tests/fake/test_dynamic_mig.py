"""The fake backend's ``dynamic-mig=true``: partitionable NVIDIA GPUs, placements refused when taken."""

from __future__ import annotations

import logging

import pytest

from agent.core.backend import BackendOptions, ClaimRef
from agent.core.errors import BackendError, ConfigError
from agent.core.model import Device
from agent.core.quantity import Quantity
from backends.fake import FakeBackend, create_backend
from backends.fake.migtables import layout_for
from backends.nvidia.discovery import mig_device_name
from backends.nvidia.migprofiles import packing_order


def backends(profile: str, dynamic: str = "true") -> list[FakeBackend]:
    made = create_backend(
        BackendOptions("node-1", None, {"profile": profile, "dynamic-mig": dynamic, "control": "off"})
    )
    return [b for b in made if isinstance(b, FakeBackend)]


def test_bad_value_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"dynamic-mig.*true or false"):
        backends("nvidia-a100-8x", "maybe")


async def test_a_placement_whose_counters_are_taken_is_refused_until_freed() -> None:
    [backend] = backends("nvidia-a100-8x")
    first, second = ClaimRef("ns", "a", "uid-a"), ClaimRef("ns", "b", "uid-b")
    await backend.prepare("gpu-0-mig-3g40gb-9-4", first)
    await backend.prepare("gpu-0-mig-4g40gb-5-0", second)  # slices 0-3: fits next to it
    with pytest.raises(BackendError, match=r"7g\.80gb at placement 0 on GPU .*\(gpu-0\)"):
        await backend.prepare("gpu-0-mig-7g80gb-0-0", ClaimRef("ns", "c", "uid-c"))
    await backend.unprepare("gpu-0-mig-3g40gb-9-4", first)
    await backend.unprepare("gpu-0-mig-4g40gb-5-0", second)
    await backend.prepare("gpu-0-mig-7g80gb-0-0", ClaimRef("ns", "c", "uid-c"))


async def discovered(profile: str, dynamic: str = "true") -> dict[str, Device]:
    return {d.name: d for b in backends(profile, dynamic) for d in await b.discover()}


async def test_other_vendors_and_static_mig_stay_as_they_are() -> None:
    amd = await discovered("amd-mi300x-8x")
    assert not any(d.counter_sets or d.consumes_counters for d in amd.values())
    static = await discovered("nvidia-a100-8x", "false")
    dynamic = await discovered("nvidia-a100-8x")
    assert {n for n in static if "-mig-" in n} <= set(dynamic)  # gpu-6 and gpu-7 keep the admin's layout
    assert dynamic["gpu-6-mig-3g40gb-9-0"] == static["gpu-6-mig-3g40gb-9-0"]


async def test_the_h100_profile_partitions_every_gpu() -> None:
    """The shipped H100 profile with ``dynamic-mig=true``: 8 partitionable H100 80GB, each the
    whole GPU with its counter set and NVIDIA's 25 placements (`backends.fake.migtables`)."""
    devices = await discovered("nvidia-h100-8x")
    assert len(devices) == 8 * 26
    gpu = devices["gpu-3"]
    assert gpu.counter_sets and gpu.consumes_counters
    # The 7g.80gb's engines: 7 decoders and 7 JPEG engines, 1 OFA (as the NVIDIA backend reads them).
    counters = gpu.counter_sets[0].counters
    engines = [counters[k] for k in ("decoders", "jpeg-engines", "ofa-engines")]
    assert engines == [Quantity.parse(7), Quantity.parse(7), Quantity.parse(1)]
    assert devices["gpu-3-mig-3g40gb-9-4"].attributes["parentUUID"] == gpu.uuid
    assert {d.attributes["profile"] for n, d in devices.items() if n.startswith("gpu-3-")} == {
        "1g.10gb",
        "1g.10gb+me",
        "1g.20gb",
        "2g.20gb",
        "3g.40gb",
        "4g.40gb",
        "7g.80gb",
    }
    [backend] = backends("nvidia-h100-8x")
    await backend.prepare("gpu-3-mig-2g20gb-14-0", ClaimRef("ns", "a", "uid-a"))
    with pytest.raises(BackendError, match=r"7g\.80gb at placement 0"):
        await backend.prepare("gpu-3-mig-7g80gb-0-0", ClaimRef("ns", "b", "uid-b"))


async def test_the_placements_are_discovered_in_packing_order() -> None:
    [backend] = backends("nvidia-h100-8x")
    names = [d.name for d in await backend.discover() if d.name.startswith("gpu-0-")]
    layout = layout_for("NVIDIA H100 80GB HBM3")
    assert layout is not None
    assert names == [mig_device_name(0, p.name, p.profile_id, at.start) for p, at in packing_order(layout)]


def test_consumable_shares_with_dynamic_mig_says_what_is_not_shared(caplog: pytest.LogCaptureFixture) -> None:
    def make(**settings: str) -> None:
        create_backend(BackendOptions("node-1", None, {"profile": "mixed", "control": "off", **settings}))

    with caplog.at_level(logging.WARNING, "agent.fake"):
        make(**{"dynamic-mig": "true", "consumable-shares": "4"})
        make(**{"consumable-shares": "4"})
        make(**{"dynamic-mig": "true"})
    said = [
        r.getMessage() for r in caplog.records if "consumable-shares with dynamic-mig=true" in r.getMessage()
    ]
    assert len(said) == 1 and "exclusive use" in said[0]
