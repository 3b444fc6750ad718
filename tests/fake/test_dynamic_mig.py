"""The fake backend's ``dynamic-mig=true``: partitionable NVIDIA GPUs, placements refused when taken."""

from __future__ import annotations

import pytest

from agent.core.backend import BackendOptions, ClaimRef
from agent.core.errors import BackendError, ConfigError
from agent.core.model import Device
from backends.fake import FakeBackend, create_backend


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
