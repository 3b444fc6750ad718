"""AMD's first ECC reading is a baseline, but not across an agent restart in the same boot (issue 12 point 2).

Errors that happen while the agent is down (between the old process's last reading and the new
one's first) are reported as new; after a reboot (another ``boot_id``) the first reading is the
baseline again, as before.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from agent.core.backend import BackendOptions, HealthEvent
from backends.amd.backend import AmdBackend
from backends.amd.eccstate import ECC_STATE_FILE, boot_id
from tests.amd.test_health import Sink
from tests.fakes.amd_standin import StandIn, load, mi300x
from tests.support.clock import FakeClock

SETTINGS = {"sysfs-root": os.devnull, "poll-interval": "10", "event-timeout-ms": "5"}


async def eventually(check: Callable[[], bool]) -> None:
    with anyio.fail_after(5):
        while not check():  # noqa: ASYNC110
            await anyio.sleep(0.005)


async def run_once(fake: StandIn, state: Path, clock: FakeClock) -> list[HealthEvent]:
    """One agent process's AMD backend: start, poll twice (the second saves the counts), stop."""
    sink = Sink()
    backend = AmdBackend(BackendOptions("node-1", None, SETTINGS, state_dir=state), clock=clock)
    await backend.start()
    await backend.discover()
    async with anyio.create_task_group() as tg:
        tg.start_soon(backend.monitor_health, sink)
        await eventually(lambda: len(sink.passes) >= 1)  # the first pass's counts are in memory
        clock.advance(10)
        await eventually((state / "gpu.amd.com" / ECC_STATE_FILE).exists)
        await eventually(lambda: len(sink.passes) >= 2)
        tg.cancel_scope.cancel()
    await backend.stop()
    return sink.of("ecc-uncorrectable")


async def test_errors_while_the_agent_was_down_are_reported_after_the_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_clock: FakeClock
) -> None:
    gpus = mi300x("spx_nps1", count=1)
    gpus[0].ecc_uncorrectable = {"UMC": 3}  # from before the agent ever started: a baseline
    fake = load().configure(gpus)
    assert await run_once(fake, tmp_path, fake_clock) == []

    gpus[0].ecc_uncorrectable = {"UMC": 5}  # while the agent restarts
    (event,) = await run_once(fake, tmp_path, fake_clock)
    assert (event.value, event.message) == ("umc", "2 new uncorrectable errors in umc (5 since boot)")


async def test_after_a_reboot_the_first_reading_is_the_baseline_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_clock: FakeClock
) -> None:
    gpus = mi300x("spx_nps1", count=1)
    gpus[0].ecc_uncorrectable = {"UMC": 7}
    fake = load().configure(gpus)
    saved = tmp_path / "gpu.amd.com" / ECC_STATE_FILE
    saved.parent.mkdir()
    gpu_key = "0000:05:00.0"
    saved.write_text(json.dumps({"boot_id": "another-boot", "gpus": {gpu_key: {"umc": 1}}}))
    assert boot_id() != "another-boot"
    assert await run_once(fake, tmp_path, fake_clock) == []
    assert json.loads(saved.read_text())["boot_id"] == boot_id()
