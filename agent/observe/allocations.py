"""The ``dra_agent_device_allocation_info`` series: which container (or pod) holds which device.

One series per prepared device and consumer, value 1, labelled like the telemetry gauges (``UUID``,
``pci_bus_id``) plus ``namespace``, ``pod``, ``container`` and ``claim``, so that
``<telemetry> * on(UUID) group_right dra_agent_device_allocation_info`` gives per-pod figures.
A MIG device also carries its physical GPU's UUID (``parent_UUID``) and GPU instance ID
(``GPU_I_ID``): dcgm-exporter labels a MIG instance's series with those, so its joins go
``on(UUID, GPU_I_ID)`` once ``parent_UUID`` is copied into ``UUID`` (README, "Per-pod GPU
metrics"). The series of a claim are replaced as a whole: the count is bounded by the devices and
their current consumers, never by history.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

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
    parent_uuid: str = ""
    gpu_instance_id: str = ""

    def label_values(self) -> tuple[str, ...]:
        """The series' label values, in the order of `agent.observe.metrics.ALLOCATION_LABELS`."""
        return (
            self.driver,
            self.pool,
            self.device,
            self.uuid,
            self.pci_bus_id,
            self.parent_uuid,
            self.gpu_instance_id,
            self.namespace,
            self.pod,
            self.container,
            self.claim,
        )


class AllocationSeries:
    """Keeps ``dra_agent_device_allocation_info`` equal to the allocations it is given, per claim.

    Only the series that differ are touched: setting each of a few hundred series again at every
    prepare cost it milliseconds.
    """

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._series: dict[tuple[str, str], frozenset[tuple[str, ...]]] = {}
        """(driver, claim UID) -> the label values of its series."""

    def set_claim(self, driver: str, uid: str, allocations: Iterable[Allocation]) -> None:
        """Make the series of one claim of `driver` exactly `allocations` (none: the claim is gone)."""
        key = (driver, uid)
        wanted = frozenset(a.label_values() for a in allocations)
        current = self._series.get(key, frozenset())
        if wanted == current:
            return
        gauge = self.metrics.allocation_info
        for gone in current - wanted:
            gauge.remove(*gone)
        for new in wanted - current:
            gauge.labels(*new).set(1)
        if wanted:
            self._series[key] = wanted
        else:
            del self._series[key]
