"""A tiny in-test backend that serves only telemetry."""

from __future__ import annotations

from collections.abc import Sequence

from agent.core.backend import ClaimRef, ContainerEdits, DeviceTelemetry, HealthSink
from agent.core.model import Device

DRIVER = "gpu.example.com"


def make_devices(count: int, driver: str = DRIVER) -> list[Device]:
    """`count` devices with metric identity fields."""
    return [
        Device(
            name=f"gpu-{i}",
            driver=driver,
            uuid=f"GPU-{i:08x}",
            pci_bus_id=f"0000:{i + 1:02x}:00.0",
            product="Example GPU 80GB",
        )
        for i in range(count)
    ]


class TelemetryBackend:
    """Returns `readings` from `telemetry()`, or raises `error` when set."""

    def __init__(self, readings: Sequence[DeviceTelemetry] = (), driver: str = DRIVER) -> None:
        self.readings: Sequence[DeviceTelemetry] = readings
        self.error: Exception | None = None
        self.reads = 0
        self._driver = driver

    @property
    def driver_name(self) -> str:
        return self._driver

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def discover(self) -> Sequence[Device]:
        return ()

    async def monitor_health(self, sink: HealthSink) -> None:
        return None

    async def prepare(self, device: str, claim: ClaimRef) -> ContainerEdits:
        return ContainerEdits()

    async def unprepare(self, device: str, claim: ClaimRef) -> None:
        return None

    async def telemetry(self) -> Sequence[DeviceTelemetry]:
        self.reads += 1
        if self.error is not None:
            raise self.error
        return self.readings
