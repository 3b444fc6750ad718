"""In-memory fakes for the claim state machine: a ClaimSource, a Backend and an event recorder."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from agent.core.backend import ClaimRef, ContainerEdits, DeviceNode, DeviceTelemetry, HealthSink
from agent.core.errors import BackendError, DeviceNotFoundError, KubeApiError
from agent.core.model import Device

DRIVER = "gpu.example.com"
NODE = "node-a"


def make_claim(
    uid: str,
    *,
    namespace: str = "default",
    name: str | None = None,
    results: Sequence[Mapping[str, Any]] | None = None,
    devices: Sequence[str] = ("gpu-0",),
    driver: str = DRIVER,
    pool: str = NODE,
    allocated: bool = True,
) -> dict[str, Any]:
    """A resource.k8s.io/v1 ResourceClaim dict; `devices` become results of request ``gpu``."""
    claim: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": namespace, "name": name or f"claim-{uid}", "uid": uid},
        "spec": {"devices": {"requests": [{"name": "gpu"}]}},
        "status": {},
    }
    if allocated:
        if results is None:
            results = [{"request": "gpu", "driver": driver, "pool": pool, "device": d} for d in devices]
        claim["status"]["allocation"] = {"devices": {"results": list(results)}}
    return claim


def ref_of(claim: Mapping[str, Any]) -> ClaimRef:
    """The kubelet's reference to a claim dict."""
    meta = claim["metadata"]
    return ClaimRef(meta["namespace"], meta["name"], meta["uid"])


class FakeClaimSource:
    """Claims by (namespace, name); `down` makes every GET fail as if the API server were unreachable."""

    def __init__(self, claims: Sequence[Mapping[str, Any]] = (), *, delay: float = 0.0) -> None:
        self.claims: dict[tuple[str, str], Mapping[str, Any]] = {}
        self.down = False
        self.delay = delay
        self.gets = 0
        for claim in claims:
            self.add(claim)

    def add(self, claim: Mapping[str, Any]) -> None:
        """Create or replace a claim."""
        meta = claim["metadata"]
        self.claims[(meta["namespace"], meta["name"])] = claim

    def delete(self, namespace: str, name: str) -> None:
        """Delete a claim."""
        self.claims.pop((namespace, name), None)

    async def get_resource_claim(self, namespace: str, name: str) -> Mapping[str, Any]:
        """As `agent.kube.client.KubeClient.get_resource_claim`."""
        self.gets += 1
        if self.delay:
            await anyio.sleep(self.delay)
        if self.down:
            raise KubeApiError("cannot reach the API server: connection refused", status=0)
        try:
            return self.claims[(namespace, name)]
        except KeyError:
            raise KubeApiError(
                f'resourceclaims.resource.k8s.io "{name}" not found', status=404, reason="NotFound"
            ) from None


def default_edits(device: str) -> ContainerEdits:
    """Edits the fake backends return for a device."""
    index = device.rsplit("-", 1)[-1]
    return ContainerEdits(
        device_nodes=(
            DeviceNode(
                path=f"/dev/fake{index}", type="c", major=195, minor=int(index) if index.isdigit() else 0
            ),
        ),
        env={"FAKE_VISIBLE_DEVICES": device},
        list_env=frozenset({"FAKE_VISIBLE_DEVICES"}),
    )


@dataclass
class FakeBackend:
    """A Backend whose prepared devices live in memory; failures are switched on per device."""

    devices: set[str] = field(default_factory=lambda: {f"gpu-{i}" for i in range(8)})
    driver: str = DRIVER
    fail_prepare: set[str] = field(default_factory=set)
    fail_unprepare: set[str] = field(default_factory=set)
    extra_cdi_ids: tuple[str, ...] = ()
    delay: float = 0.0
    prepared: dict[str, set[str]] = field(default_factory=dict)
    """Claim UID -> devices prepared for it."""
    prepare_calls: int = 0
    unprepare_calls: int = 0
    in_flight: int = 0
    max_in_flight: int = 0

    @property
    def driver_name(self) -> str:
        return self.driver

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def discover(self) -> Sequence[Device]:
        return []

    async def monitor_health(self, sink: HealthSink) -> None:
        await anyio.sleep_forever()

    async def telemetry(self) -> Sequence[DeviceTelemetry]:
        return []

    async def prepare(self, device: str, claim: ClaimRef) -> ContainerEdits:
        self.prepare_calls += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.delay:
                await anyio.sleep(self.delay)
            if device not in self.devices:
                raise DeviceNotFoundError(self.driver, device)
            if device in self.fail_prepare:
                raise BackendError(f"fake backend: cannot prepare {device}: device busy; retry later")
            self.prepared.setdefault(claim.uid, set()).add(device)
            return self.edits(device)
        finally:
            self.in_flight -= 1

    def edits(self, device: str) -> ContainerEdits:
        """The edits a prepare of `device` gives."""
        edits = default_edits(device)
        return ContainerEdits(
            device_nodes=edits.device_nodes,
            env=edits.env,
            list_env=edits.list_env,
            cdi_device_ids=self.extra_cdi_ids,
        )

    async def unprepare(self, device: str, claim: ClaimRef) -> None:
        self.unprepare_calls += 1
        self.release(device, claim)

    def release(self, device: str, claim: ClaimRef) -> None:
        """What an unprepare of `device` does."""
        if device in self.fail_unprepare:
            raise BackendError(f"fake backend: cannot unprepare {device}: device busy; retry later")
        held = self.prepared.get(claim.uid, set())
        held.discard(device)
        if not held:
            self.prepared.pop(claim.uid, None)


class FileBackend(FakeBackend):
    """A FakeBackend whose prepared devices persist in a JSON file (for crash tests across processes)."""

    def __init__(self, path: Path, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.path = path
        if path.exists():
            self.prepared = {uid: set(devs) for uid, devs in json.loads(path.read_text()).items()}

    def _save(self) -> None:
        self.path.write_text(json.dumps({uid: sorted(d) for uid, d in self.prepared.items()}))

    async def prepare(self, device: str, claim: ClaimRef) -> ContainerEdits:
        edits = await super().prepare(device, claim)
        self._save()
        return edits

    async def unprepare(self, device: str, claim: ClaimRef) -> None:
        await super().unprepare(device, claim)
        self._save()


class PlanningBackend(FakeBackend):
    """A FakeBackend that also plans (`agent.core.backend.PlansPrepare`): its prepare's work runs
    in the core's checkpoint hop. `fail_plan` fails the check; `fail_prepare`/`fail_unprepare` the work."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fail_plan: set[str] = set()
        self.planned: list[tuple[str, str]] = []
        """(operation, device) of every plan run."""

    def plan_prepare(self, device: str, claim: ClaimRef) -> Callable[[], ContainerEdits] | None:
        if device not in self.devices:
            raise DeviceNotFoundError(self.driver, device)
        if device in self.fail_plan:
            raise BackendError(f"fake backend: {device} refused at planning")
        if self.delay:
            return None  # waiting: the async path

        def work() -> ContainerEdits:
            self.planned.append(("prepare", device))
            if device in self.fail_prepare:
                raise BackendError(f"fake backend: cannot prepare {device}: device busy; retry later")
            self.prepared.setdefault(claim.uid, set()).add(device)
            self._save()
            return self.edits(device)

        return work

    def plan_unprepare(self, device: str, claim: ClaimRef) -> Callable[[], None] | None:
        def work() -> None:
            self.planned.append(("unprepare", device))
            self.release(device, claim)
            self._save()

        return work

    def _save(self) -> None:
        """Nothing to persist (`PlanningFileBackend` writes its file)."""


class PlanningFileBackend(PlanningBackend, FileBackend):
    """A PlanningBackend whose prepared devices persist in a JSON file (crash tests of the one-hop path)."""

    def __init__(self, path: Path, **kwargs: Any) -> None:
        FileBackend.__init__(self, path, **kwargs)
        self.fail_plan = set()
        self.planned = []

    def _save(self) -> None:
        FileBackend._save(self)


@dataclass
class FakeEvents:
    """Records (reason, message, type) tuples."""

    recorded: list[tuple[str, str, str]] = field(default_factory=list)

    async def record(self, reason: str, message: str, type: str) -> None:
        self.recorded.append((reason, message, type))
