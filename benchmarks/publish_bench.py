"""Publishing benchmark: fault-to-taint latency, writes during a health-event storm, time to
publish 1,000 devices and writes on a no-change resync, against the in-process API emulator.

Run: ``python -m benchmarks.publish_bench`` (``--quick`` for a shorter run).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import anyio

from agent.core.backend import HealthEvent
from agent.core.clock import SystemClock
from agent.core.inventory import Inventory
from agent.core.model import Device, Severity
from agent.core.quantity import Quantity
from agent.emulator import KubeApiEmulator
from agent.health.taints import TaintPolicy
from agent.health.tracker import HealthTracker
from agent.kube.client import KubeClient
from agent.kube.publisher import SlicePublisher

NODE = "bench-node"
DRIVER = "gpu.example.com"


def devices(count: int) -> list[Device]:
    return [
        Device(
            f"gpu-{i}",
            DRIVER,
            {"index": i, "productName": "Example GPU", "uuid": f"GPU-{i:08d}"},
            {"memory": Quantity.binary(80 * 2**30)},
        )
        for i in range(count)
    ]


def published_taints(emu: Any, device: str) -> list[dict[str, Any]]:
    for s in emu.list("resourceslices", field_selector=f"spec.nodeName={NODE}"):
        for d in s["spec"].get("devices") or []:
            if d["name"] == device:
                return list(d.get("taints") or [])
    return []


def writes(emu: Any) -> int:
    return sum(n for (_, resource), n in emu.writes.items() if resource == "resourceslices")


async def wait_for(predicate: Callable[[], bool], limit: float = 10.0) -> None:
    with anyio.fail_after(limit):
        while not predicate():  # noqa: ASYNC110 - polls the emulator's store, which has no event
            await anyio.sleep(0.001)


async def setup(emu: Any, count: int) -> tuple[KubeClient, Inventory, SlicePublisher]:
    emu.add_node(NODE)
    kube = KubeClient.from_configuration(emu.configuration())
    await kube.discover()
    inventory = Inventory(DRIVER)
    inventory.set_devices(devices(count))
    publisher = SlicePublisher(kube, inventory, NODE, policy=TaintPolicy.default(), clock=SystemClock())
    return kube, inventory, publisher


async def latency_and_storm(trials: int, storm_seconds: float) -> dict[str, str]:
    out: dict[str, str] = {}
    async with KubeApiEmulator(version="1.34", feature_gates={"DRADeviceTaints": True}) as emu:
        kube, inventory, publisher = await setup(emu, 8)
        tracker = HealthTracker(inventory, SystemClock(), hold_seconds=0.0, flap_window_seconds=0.0)
        async with anyio.create_task_group() as tg:
            tg.start_soon(publisher.run)
            await wait_for(lambda: len(emu.list("resourceslices")) == 1)
            samples: list[float] = []
            for trial in range(trials):
                device = f"gpu-{trial % 8}"
                await anyio.sleep(0.6)  # faults arrive apart, not inside a write burst
                started = time.perf_counter()
                await tracker.handle(HealthEvent(device, "xid", Severity.CRITICAL, value="79"))
                await wait_for(lambda d=device: bool(published_taints(emu, d)))  # type: ignore[misc]
                samples.append(time.perf_counter() - started)
                tracker.expire()  # hold time 0: the taint lifts at once
                await wait_for(lambda d=device: not published_taints(emu, d))  # type: ignore[misc]
            samples.sort()
            out["fault -> taint visible p50"] = f"{statistics.median(samples) * 1000:.1f} ms"
            out["fault -> taint visible p99"] = (
                f"{samples[min(len(samples) - 1, int(len(samples) * 0.99))] * 1000:.1f} ms"
            )
            out["  (trials)"] = str(len(samples))

            await anyio.sleep(0.6)
            emu.reset_writes()
            # Hold time 0 and many distinct XIDs: the taint set changes every few ms (the worst case).
            # Flap damping off: here it would only hold the taints and hide the churn we measure.
            storm_tracker = HealthTracker(inventory, SystemClock(), hold_seconds=0.0, flap_window_seconds=0.0)
            tg.start_soon(storm_tracker.run)
            started = time.perf_counter()
            sent = 0
            while (now := time.perf_counter() - started) < storm_seconds:
                due = int(now * 1000)  # 1,000 events/s, sent in small batches
                while sent < due:
                    await storm_tracker.handle(
                        HealthEvent(
                            f"gpu-{sent % 8}", "xid", Severity.CRITICAL, value=str(40 + (sent // 8) % 30)
                        )
                    )
                    sent += 1
                await anyio.sleep(0.005)
            elapsed = time.perf_counter() - started
            storm_writes = writes(emu)
            policy, support = TaintPolicy.default(), kube.info.taint_support

            def final_state_published() -> bool:
                wanted = policy.taint_map(inventory.devices(), support)
                return all(
                    len(published_taints(emu, d.name)) == len(wanted.get(d.name, ()))
                    for d in inventory.devices()
                )

            await anyio.sleep(1.0)  # the storm's conditions expire
            await wait_for(final_state_published)
            out["storm events/s"] = f"{sent / elapsed:.0f}"
            out["storm writes/s (1 pool)"] = f"{storm_writes / elapsed:.2f}"
            out["storm final state published"] = "yes"
            tg.cancel_scope.cancel()
        await kube.close()
    return out


async def big_pool() -> dict[str, str]:
    out: dict[str, str] = {}
    async with KubeApiEmulator(version="1.34", feature_gates={"DRADeviceTaints": True}) as emu:
        kube, _, publisher = await setup(emu, 1000)
        started = time.perf_counter()
        result = await publisher.reconcile()
        out["publish 1,000 devices"] = (
            f"{(time.perf_counter() - started) * 1000:.0f} ms ({result.created} slices)"
        )
        emu.reset_writes()
        started = time.perf_counter()
        again = await publisher.reconcile()
        out["no-change resync writes"] = f"{writes(emu)} (pass result {again.writes})"
        out["no-change resync time"] = f"{(time.perf_counter() - started) * 1000:.0f} ms"
        await kube.close()
    return out


async def main(quick: bool) -> None:
    rows = await latency_and_storm(trials=20 if quick else 50, storm_seconds=3.0 if quick else 10.0)
    rows.update(await big_pool())
    width = max(len(k) for k in rows)
    print(f"{'measure'.ljust(width)}  value")
    for key, value in rows.items():
        print(f"{key.ljust(width)}  {value}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer trials and a 3 s storm")
    anyio.run(main, parser.parse_args().quick)
