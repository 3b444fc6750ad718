"""The ``dra_agent_device_allocation_info`` series: which container (or pod) holds which device.

One series per prepared device and consumer, value 1, labelled like the telemetry gauges (``UUID``,
``pci_bus_id``) plus ``namespace``, ``pod``, ``container`` and ``claim``, so that
``<telemetry> * on(UUID) group_left(namespace, pod, container, claim) dra_agent_device_allocation_info``
gives per-pod figures (dcgm-exporter's series join the same way). The series of a driver are
replaced as a whole: the count is bounded by the devices and their current consumers, never by
history.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import astuple, dataclass

from agent.observe.metrics import Metrics


@dataclass(frozen=True)
class Allocation:
    """One prepared device and one consumer of it (``container`` empty when only the pod is known)."""

    driver: str
    pool: str
    device: str
    uuid: str
    pci_bus_id: str
    namespace: str
    pod: str
    container: str
    claim: str


class AllocationSeries:
    """Keeps ``dra_agent_device_allocation_info`` equal to the allocations it is given, per driver."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._series: dict[str, set[Allocation]] = {}

    def replace(self, driver: str, allocations: Iterable[Allocation]) -> None:
        """Make the driver's series exactly `allocations` (others removed, new ones set to 1)."""
        wanted = set(allocations)
        gauge = self.metrics.allocation_info
        for gone in self._series.get(driver, set()) - wanted:
            gauge.remove(*astuple(gone))
        for allocation in wanted:
            gauge.labels(*astuple(allocation)).set(1)
        self._series[driver] = wanted

    def current(self, driver: str) -> frozenset[Allocation]:
        """The driver's series now."""
        return frozenset(self._series.get(driver, set()))
