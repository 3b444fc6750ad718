"""Fleet scale (issue 26): what each agent asks of the API server, and when.

The emulator records every request with its time and client (`agent.emulator.requestlog`); each
agent has its own bearer token. Whole ``dra-agent run`` processes where the count is what matters
(start, 410), in-process publishers where a race or a moment must be forced (own events, jitter).
"""

from __future__ import annotations

import logging
import os
import random
import signal
import statistics
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
import yaml

from agent.cli import main
from agent.config import build_config
from agent.core.clock import SystemClock
from agent.core.inventory import Inventory
from agent.emulator import KubeApiEmulator
from agent.emulator.requestlog import LoggedRequest
from agent.health.taints import TaintPolicy
from agent.kube import jitter
from agent.kube.client import KubeClient, WatchEvent
from agent.kube.publisher import SlicePublisher
from agent.observe.metrics import Metrics
from tests.kube.harness import DRIVER, make_devices

pytestmark = pytest.mark.anyio
DISCOVERY = {"get version", "get discovery"}


async def eventually(predicate: Callable[[], bool], within: float = 30.0) -> None:
    with anyio.fail_after(within):
        while not predicate():  # noqa: ASYNC110 (the emulator's log has no event to wait on)
            await anyio.sleep(0.02)


# ----- whole agent processes ------------------------------------------------------------------


@asynccontextmanager
async def agent_process(emu: KubeApiEmulator, root: Path, node: str, *extra: str) -> AsyncIterator[None]:
    """``dra-agent run`` (fake mixed: two drivers) on `node`, with bearer token `node`."""
    emu.add_node(node)
    kubeconfig = emu.write_kubeconfig(root / "kubeconfig")
    config = yaml.safe_load(kubeconfig.read_text())
    config["users"][0]["user"] = {"token": node}
    kubeconfig.write_text(yaml.safe_dump(config))
    args = [
        sys.executable, "-m", "agent.cli", "run", "--kube", "kubeconfig", "--kubeconfig", str(kubeconfig),
        "--node-name", node, "--backend", f"fake:profile=mixed,control={root / 'fake.sock'}",
        "--registry-dir", str(root / "registry"), "--plugins-dir", str(root / "plugins"),
        "--cdi-root", str(root / "cdi"), "--state-dir", str(root / "state"),
        "--metrics-address", "127.0.0.1:0", "--log-level", "warning", *extra,
    ]  # fmt: skip
    with (root / "agent.log").open("wb") as log:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(args, stdout=log, stderr=log, env=env)  # noqa: ASYNC220 (returns at once)
        try:
            yield
        finally:
            proc.send_signal(signal.SIGTERM)
            await anyio.to_thread.run_sync(proc.wait)


def requests_of(emu: KubeApiEmulator, client: str, since: float = 0.0) -> Counter[str]:
    return Counter(e.label for e in emu.request_log.since(since) if e.client == client)


def both_pools(emu: KubeApiEmulator, node: str) -> bool:
    slices = emu.list("resourceslices", field_selector=f"spec.nodeName={node}")
    return len({s["spec"]["driver"] for s in slices}) == 2


async def test_one_list_discovery_and_probe_per_process_at_start(tmp_path: Path) -> None:
    """Two drivers, one process: one LIST (the taint seed, the watch and the first pass share
    it, as the resourceslice controller's informer store in
    ``staging/src/k8s.io/dynamic-resource-allocation/resourceslice/resourceslicecontroller.go``),
    one WATCH, discovery once and one dry-run probe for both drivers: <= 6 counted requests."""
    async with KubeApiEmulator(version="1.36") as emu, agent_process(emu, tmp_path, "node-a"):
        await eventually(lambda: both_pools(emu, "node-a"))
        await eventually(lambda: requests_of(emu, "node-a")["watch resourceslices"] >= 1)
        counts = requests_of(emu, "node-a")
        assert counts["list resourceslices"] == 1
        assert counts["watch resourceslices"] == 1
        assert counts["get version"] == 1 and counts["get discovery"] == 4  # once per process
        assert counts["create resourceslices (dry run)"] == 1  # the probe, for both drivers
        assert counts["get nodes"] == 1
        assert counts["create resourceslices"] == 2
        assert sum(n for label, n in counts.items() if label not in DISCOVERY) <= 6


async def test_one_list_per_410(tmp_path: Path) -> None:
    """A watch whose resourceVersion is compacted away gets 410 Gone: the process lists once for
    both drivers, then watches again (``staging/src/k8s.io/client-go/tools/cache/reflector.go``:
    an expired watch relists; a watch that merely timed out resumes without a LIST)."""
    async with KubeApiEmulator(version="1.36") as emu, agent_process(emu, tmp_path, "node-b"):
        await eventually(lambda: both_pools(emu, "node-b"))
        await eventually(lambda: requests_of(emu, "node-b")["watch resourceslices"] >= 1)
        mark = emu.request_log.now()
        emu.add_node("someone-else")  # history moves on...
        emu.compact()  # ...and is forgotten: the open watch ends with 410
        await eventually(lambda: requests_of(emu, "node-b", mark)["watch resourceslices"] >= 1)
        counts = requests_of(emu, "node-b", mark)
        assert counts["list resourceslices"] == 1  # one for both drivers
        assert counts["create resourceslices"] + counts["update resourceslices"] == 0


async def test_one_list_after_an_api_server_restart(tmp_path: Path) -> None:
    """The API server restarts: connections cut, then 503 while it starts, then back with its
    watch history gone. One LIST for the process after it is back (not one per driver after a
    410 each)."""
    async with KubeApiEmulator(version="1.36") as emu, agent_process(emu, tmp_path, "node-c"):
        await eventually(lambda: both_pools(emu, "node-c"))
        await eventually(lambda: requests_of(emu, "node-c")["watch resourceslices"] >= 1)
        cut = emu.request_log.now()
        emu.faults.outage(True)
        emu.faults.fail_all(503, verbs=["list", "watch", "get", "create", "update", "delete"])
        emu.faults.outage(False)  # answering again, 503 while "starting"

        def tried_again() -> bool:  # the agent is back at its slices (refused while "starting")
            return any(
                e.resource == "resourceslices" and e.client == "node-c" for e in emu.request_log.since(cut)
            )

        await eventually(tried_again)
        emu.add_node("someone-else")
        emu.compact()  # a restarted API server has no history of the old resourceVersions
        emu.faults.clear()
        back = emu.request_log.now()
        await eventually(lambda: requests_of(emu, "node-c", back)["watch resourceslices"] >= 1)
        counts = requests_of(emu, "node-c", back)
        assert counts["list resourceslices"] == 1  # before watching again: no 410 first
        assert counts["create resourceslices"] + counts["update resourceslices"] == 0


# ----- in-process publishers ------------------------------------------------------------------


class SlowAnswers(KubeClient):
    """Our create's answer arrives after the watch has delivered the slice (the race of issue 26);
    the watch events the agent received are kept in `seen`."""

    delay = 0.3

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[str, str]] = []

    async def create_resource_slice(self, body: Any) -> dict[str, Any]:
        stored = await super().create_resource_slice(body)
        await anyio.sleep(self.delay)
        return stored

    async def watch_resource_slices(self, **kwargs: Any) -> AsyncIterator[WatchEvent]:
        async for event in super().watch_resource_slices(**kwargs):
            self.seen.append((event.type, event.resource_version))
            yield event


def client(emu: KubeApiEmulator, token: str, cls: type[KubeClient] = KubeClient) -> KubeClient:
    cfg = emu.configuration()
    cfg.api_key = {"BearerToken": token}
    cfg.api_key_prefix = {"BearerToken": "Bearer"}
    return cls(cfg, request_timeout=2.0)


@dataclass
class Fleet:
    publishers: list[SlicePublisher]
    kubes: list[KubeClient]
    metrics: list[Metrics]


@asynccontextmanager
async def publishers(
    emu: KubeApiEmulator, count: int, cls: type[KubeClient] = KubeClient, **options: Any
) -> AsyncIterator[Fleet]:
    """`count` publishers of `DRIVER`, one per node (``node-<i>``, token the same), seeded rngs."""
    kubes = [client(emu, f"node-{i}", cls) for i in range(count)]
    metrics = [Metrics() for _ in kubes]
    made = []
    for i, kube in enumerate(kubes):
        emu.add_node(f"node-{i}")
        await kube.discover()
        inventory = Inventory(DRIVER)
        inventory.set_devices(make_devices(2))
        made.append(
            SlicePublisher(
                kube,
                inventory,
                f"node-{i}",
                policy=TaintPolicy.default(),
                clock=SystemClock(),
                metrics=metrics[i],
                debounce_seconds=0.01,
                rng=random.Random(i),
                **options,
            )
        )
    try:
        async with anyio.create_task_group() as tg:
            for publisher in made:
                tg.start_soon(publisher.run)
            yield Fleet(made, kubes, metrics)
            tg.cancel_scope.cancel()
    finally:
        for kube in kubes:
            await kube.close()


async def test_own_added_event_is_not_reconciled_again(caplog: pytest.LogCaptureFixture) -> None:
    """Our ADDED event arrives before our create's answer: it is still ours (its resourceVersion is
    the answer's), so it wakes no pass; the DRA controller's mutation cache
    (``cache.NewIntegerResourceVersionMutationCache`` in
    ``staging/src/k8s.io/dynamic-resource-allocation/resourceslice/resourceslicecontroller.go``)
    plays that part upstream."""
    caplog.set_level(logging.DEBUG, logger="agent.kube.publisher")
    async with KubeApiEmulator(version="1.36") as emu, publishers(emu, 1, SlowAnswers) as fleet:
        (publisher,), (kube,), (metrics,) = fleet.publishers, fleet.kubes, fleet.metrics
        assert isinstance(kube, SlowAnswers)
        created = {"resource": "resourceslices", "verb": "create", "result": "success"}

        def answered() -> bool:
            return (metrics.registry.get_sample_value("dra_agent_api_writes_total", created) or 0) >= 1

        await eventually(answered)
        version = emu.list("resourceslices")[0]["metadata"]["resourceVersion"]
        assert ("ADDED", version) in kube.seen  # the event came while the answer was held back
        assert not [r for r in caplog.records if "changed by someone else" in r.getMessage()]
        assert publisher.passes == 1


def first_after(entries: Iterable[LoggedRequest], label: str, after: float) -> dict[str, float]:
    firsts: dict[str, float] = {}
    for entry in entries:
        if entry.label == label and entry.at > after and entry.client not in firsts:
            firsts[entry.client] = entry.at - after
    return firsts


async def test_resync_spreads_a_fleet_started_together() -> None:
    """Eight agents started in the same instant resync at different moments: each wait is drawn
    over [0.5, 1.5) of the interval (``wait.JitterUntil``/``Jitter`` in
    ``staging/src/k8s.io/apimachinery/pkg/util/wait/backoff.go``), not all at 1.0."""
    async with KubeApiEmulator(version="1.36") as emu:
        async with publishers(emu, 8, resync_seconds=1.0):
            start = emu.request_log.now()  # discovery done, the publishers start now
            await eventually(lambda: len(first_after(emu.request_log.entries, "get version", start)) == 8)
        resyncs = sorted(first_after(emu.request_log.entries, "get version", start).values())
    assert resyncs[-1] - resyncs[0] > 0.4, resyncs  # in step, they would all fall within a few ms
    assert statistics.pstdev(resyncs) > 0.1


def test_watch_timeout_is_drawn_between_one_and_two_times_its_base() -> None:
    """``timeoutSeconds = minWatchTimeout * (rand.Float64() + 1.0)`` in
    ``staging/src/k8s.io/client-go/tools/cache/reflector.go``."""
    rng = random.Random(7)
    drawn = [jitter.watch_timeout(300, rng) for _ in range(200)]
    assert min(drawn) >= 300 and max(drawn) <= 600
    assert max(drawn) - min(drawn) > 200  # spread over the range, not fixed


def test_backoff_has_full_jitter_from_the_first_retry() -> None:
    """Every retry, the first included, is drawn from [0, min(cap, initial * 2^(n-1))): full
    jitter (``wait.Backoff.Step`` in ``staging/src/k8s.io/apimachinery/pkg/util/wait/backoff.go``
    jitters every step; full rather than [d, 2d) so a fleet's reconnects fill the whole window)."""
    rng = random.Random(3)
    first = [jitter.backoff(1, 0.8, 30.0, rng) for _ in range(200)]
    assert min(first) < 0.1 and max(first) > 0.7 and max(first) < 0.8
    assert max(jitter.backoff(20, 0.8, 30.0, rng) for _ in range(200)) <= 30.0


async def test_reconnects_after_a_broken_watch_are_spread_over_the_backoff_window() -> None:
    """All watches fail at once: the first retries (each reads /version before watching again) are
    spread over the first backoff window, not bunched at its end."""
    async with KubeApiEmulator(version="1.36") as emu:
        async with publishers(emu, 8, backoff_initial=1.0, backoff_max=5.0) as fleet:
            await eventually(lambda: all(p.passes >= 1 for p in fleet.publishers))
            await eventually(
                lambda: len({e.client for e in emu.request_log.entries if e.verb == "watch"}) == 8
            )
            emu.faults.fail_next(8, 500, verbs=["watch"])
            cut = emu.request_log.now()
            emu.faults.drop_watches()
            await eventually(lambda: len(first_after(emu.request_log.entries, "get version", cut)) == 8)
        retries = sorted(first_after(emu.request_log.entries, "get version", cut).values())
    assert retries[-1] < 1.5, retries  # within the first window (1 s)
    assert retries[0] < 0.45, retries  # full jitter: [0.5, 1) of the window would hold every retry
    assert retries[-1] - retries[0] > 0.3, retries  # spread, not in step


# ----- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--resync", "--watch-timeout"])
@pytest.mark.parametrize("value", ["0", "-5", "inf", "nan"])
def test_resync_and_watch_timeout_must_be_finite_and_positive(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A period of 0, negative or inf: one line naming the flag, exit 2 (as the other settings)."""
    assert main(["run", f"{flag}={value}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert flag in err and f"'{value}'" in err and "finite number of seconds" in err


def test_watch_timeout_is_a_setting() -> None:
    config = build_config({}, env={"DRA_AGENT_WATCH_TIMEOUT_SECONDS": "120"})
    assert config.watch_timeout_seconds == 120.0 and build_config({}, env={}).watch_timeout_seconds == 300.0
