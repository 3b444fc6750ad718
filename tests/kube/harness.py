"""Shared helpers of the emulator-backed Kubernetes tests (and the publish benchmark)."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio

from agent.core.clock import Clock, SystemClock
from agent.core.inventory import Inventory
from agent.core.model import Device
from agent.core.quantity import Quantity
from agent.emulator import KubeApiEmulator
from agent.health.taints import TaintPolicy
from agent.kube.client import KubeClient
from agent.kube.events import EventRecorder
from agent.kube.publisher import SlicePublisher, TaintMapper
from agent.observe.metrics import Metrics
from tests.support.clock import FakeClock

NODE = "node-1"
DRIVER = "gpu.example.com"


def make_devices(count: int, driver: str = DRIVER) -> list[Device]:
    """`count` plausible GPUs."""
    return [
        Device(
            f"gpu-{i}",
            driver,
            {
                "index": i,
                "productName": "Example GPU",
                "resource.kubernetes.io/pciBusID": f"0000:{i % 256:02x}:00.0",
            },
            {"memory": Quantity.binary(80 * 2**30)},
        )
        for i in range(count)
    ]


@dataclass
class Harness:
    emu: Any
    kube: KubeClient
    inventory: Inventory
    publisher: SlicePublisher
    metrics: Metrics
    clock: Clock

    def slices(self, driver: str = DRIVER) -> list[dict[str, Any]]:
        """Our slices as the emulator stores them (v1 shape)."""
        items = self.emu.list("resourceslices", field_selector=f"spec.nodeName={NODE},spec.driver={driver}")
        return list(items)

    def devices(self) -> dict[str, dict[str, Any]]:
        """Published devices by name, across our slices."""
        return {d["name"]: d for s in self.slices() for d in s["spec"].get("devices") or []}

    def taints(self, device: str) -> list[dict[str, Any]]:
        return list(self.devices().get(device, {}).get("taints") or [])

    def writes(self, resource: str = "resourceslices") -> int:
        return sum(n for (verb, res), n in self.emu.writes.items() if res == resource)

    def event_reasons(self) -> list[str]:
        return [e.get("reason", "") for e in self.emu.list("events")]

    def metric(self, name: str, labels: dict[str, str]) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0

    async def settle(self, predicate: Callable[[], bool], within: float = 5.0) -> None:
        await eventually(predicate, within=within, clock=self.clock)

    async def resyncs_write_nothing(self, passes: int = 3) -> None:
        """Wait for `passes` more reconcile passes and check that none rewrote our slices."""
        versions = {s["metadata"]["name"]: s["metadata"]["resourceVersion"] for s in self.slices()}
        done = self.publisher.passes + passes
        await self.settle(lambda: self.publisher.passes >= done)
        assert {s["metadata"]["name"]: s["metadata"]["resourceVersion"] for s in self.slices()} == versions


async def eventually(
    predicate: Callable[[], bool], *, within: float = 5.0, clock: Clock | None = None
) -> None:
    """Wait until `predicate()` holds; a FakeClock is advanced a little on every poll."""
    with anyio.fail_after(within):
        while not predicate():
            if isinstance(clock, FakeClock):
                clock.advance(0.05)
            await anyio.sleep(0.005)


@asynccontextmanager
async def harness(
    *,
    version: str = "1.34",
    gates: dict[str, bool] | None = None,
    devices: Sequence[Device] | None = None,
    add_node: bool = True,
    clock: Clock | None = None,
    policy: TaintMapper | None = None,
    start: bool = True,
    **publisher_options: Any,
) -> AsyncIterator[Harness]:
    """An emulator, a discovered KubeClient and a running SlicePublisher for `DRIVER` on `NODE`."""
    clock = clock or SystemClock()
    options: dict[str, Any] = {
        "debounce_seconds": 0.01,
        "min_write_interval": 0.05,
        "backoff_initial": 0.02,
        "backoff_max": 0.2,
        "rng": random.Random(1),
    }
    options.update(publisher_options)
    async with KubeApiEmulator(
        version=version, feature_gates=gates if gates is not None else {"DRADeviceTaints": True}
    ) as emu:
        if add_node:
            emu.add_node(NODE)
        kube = KubeClient.from_configuration(emu.configuration(), request_timeout=2.0)
        try:
            await kube.discover()
            inventory = Inventory(DRIVER)
            inventory.set_devices(list(devices) if devices is not None else make_devices(4))
            metrics = Metrics()
            events = EventRecorder(kube, NODE, "", clock, metrics=metrics)
            publisher = SlicePublisher(
                kube,
                inventory,
                NODE,
                policy=policy or TaintPolicy.default(),
                clock=clock,
                metrics=metrics,
                events=events,
                **options,
            )
            h = Harness(emu, kube, inventory, publisher, metrics, clock)
            async with anyio.create_task_group() as tg:
                if start:
                    tg.start_soon(publisher.run)
                yield h
                tg.cancel_scope.cancel()
        finally:
            await kube.close()
