"""The seam between the vendor-neutral core and the vendor backends.

Every backend (fake, NVIDIA, AMD) implements `Backend`. Backends know nothing of Kubernetes:
they discover `Device` values, report `HealthEvent`s, prepare a device for a claim by returning
`ContainerEdits` (which the core turns into CDI), and read `DeviceTelemetry`. Blocking vendor
calls run through `anyio.to_thread`, never on the event loop.

Backends are installed as entry points in the ``dra_agent.backends`` group; each entry point is
a `BackendFactory` that returns one backend per driver name it serves.
"""

from __future__ import annotations

import enum
import importlib
import time
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

from agent.core.errors import BackendNotFoundError
from agent.core.model import Device, Severity

ENTRY_POINT_GROUP = "dra_agent.backends"
# This package's own entry points of that group (pyproject.toml; a test keeps the two equal): they
# load by module name, without scanning the metadata of every installed distribution at each start
# (3-6 ms here, more with more packages installed). A name of ours wins over a third-party entry
# point of the same name.
BUILTIN_BACKENDS = {
    "fake": "backends.fake:create_backend",
    "nvidia": "backends.nvidia:create_backend",
    "amd": "backends.amd:create_backend",
}


@dataclass(frozen=True)
class ClaimRef:
    """The identity of a ResourceClaim, as the kubelet sends it."""

    namespace: str
    name: str
    uid: str


class ConditionKind(enum.Enum):
    """How a health condition ends."""

    EVENT = "event"
    """A one-off occurrence (an XID, an ECC error): it recovers after the hold time without recurrence."""
    STATE = "state"
    """A lasting state (GPU lost, unmonitored): it lasts until the backend clears it."""


@dataclass(frozen=True)
class HealthEvent:
    """A change in the health of one device, reported by a backend.

    `cleared=True` ends a STATE condition (or an EVENT condition early, when the vendor
    reports recovery). `at` is a Unix timestamp; None means "now" at the receiver.
    """

    device: str
    condition: str
    severity: Severity
    value: str = ""
    message: str = ""
    kind: ConditionKind = ConditionKind.EVENT
    cleared: bool = False
    at: float | None = None


HealthSink = Callable[[HealthEvent], Awaitable[None]]


def report_alive(sink: HealthSink) -> None:
    """Tell whoever gave `sink` that the health monitor works (its last vendor call returned).

    Monitors call it on every turn of their loop, events or not, so that a silent monitor can be
    told from a quiet one. A sink with an ``alive()`` method gets it called; a plain callable
    ignores it (the `Backend` protocol is unchanged for backends that never call it).
    """
    alive = getattr(sink, "alive", None)
    if callable(alive):
        alive()


GPU_LOST = "gpu-lost"
"""The STATE condition of a device that does not answer or is no longer found (every backend).

The core raises it too, for a published device that rediscovery no longer finds
(`agent.health.vanished`)."""

DEFAULT_HEALTH_INTERVAL = 5.0
"""Seconds between two health passes of a backend that polls (`PollsHealth`), unless configured."""


def report_pass(sink: HealthSink, devices: Collection[str], *, failed_checks: Collection[str] = ()) -> None:
    """Tell whoever gave `sink` that one complete health pass has looked at `devices`.

    Backends that poll (`PollsHealth`) call it at the end of every pass, after the pass's
    `HealthEvent`s went to the sink. A device is "looked at" when every check that applies to
    it ran or was skipped as unsupported; a device the pass could not reach (the vendor call
    hung or failed for another reason than the GPU being gone) is left out, so conditions held
    from before a restart are not lifted on its account. `failed_checks` names the checks
    that failed in this pass (counted, logged by the core; never a condition on the GPU).
    A plain callable sink ignores it.
    """
    done = getattr(sink, "pass_completed", None)
    if callable(done):
        done(devices, failed_checks)


@dataclass(frozen=True)
class DeviceNode:
    """A device node the container gets; type/major/minor are read from the host when known."""

    path: str
    host_path: str = ""
    type: str = ""
    major: int | None = None
    minor: int | None = None
    permissions: str = ""


@dataclass(frozen=True)
class Mount:
    """A bind mount from the host into the container."""

    host_path: str
    container_path: str
    options: tuple[str, ...] = ("ro", "nosuid", "nodev", "bind")


@dataclass(frozen=True)
class Hook:
    """An OCI hook the runtime runs for the container (CDI ``hooks``); `path` is a host path."""

    hook_name: str
    path: str
    args: tuple[str, ...] = ()
    env: tuple[str, ...] = ()


@dataclass(frozen=True)
class ContainerEdits:
    """What a container needs to use one prepared device.

    `cdi_device_ids` are extra, fully qualified CDI IDs the runtime resolves from specs the
    agent does not write (for example the NVIDIA Container Toolkit's ``nvidia.com/gpu=<uuid>``).
    `env` values of several devices of one claim are merged by the core; variables listed in
    `list_env` are joined with commas (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=uuid1=1024M,uuid2=1024M``).
    That join covers one claim only: a container with two claims of one driver gets both claims'
    CDI specs, and CDI keeps the last claim's value of a variable. So no variable may tell a
    container which devices it has: device nodes and mounts do; a variable has the same value in
    every claim (``NVIDIA_VISIBLE_DEVICES=void``) or a name of its own per device.
    """

    device_nodes: tuple[DeviceNode, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    mounts: tuple[Mount, ...] = ()
    cdi_device_ids: tuple[str, ...] = ()
    list_env: frozenset[str] = frozenset()
    hooks: tuple[Hook, ...] = ()


@dataclass(frozen=True)
class DeviceTelemetry:
    """One reading of a device's counters; None where the device cannot report it."""

    device: str
    utilization_ratio: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    temperature_celsius: float | None = None
    power_watts: float | None = None
    ecc_corrected_total: int | None = None
    ecc_uncorrected_total: int | None = None
    last_error_code: int | None = None
    """The vendor's last fatal error code (the last XID on NVIDIA); 0 when none since the agent
    started (the series then exists from the start), None where the backend has no such code."""
    read_at: float = field(default_factory=time.time)


@runtime_checkable
class Backend(Protocol):
    """One vendor backend serving one DRA driver name."""

    @property
    def driver_name(self) -> str:
        """The DRA driver name (``gpu.nvidia.com``), used for slices, sockets and CDI."""
        ...

    async def start(self) -> None:
        """Open the vendor library; raise `BackendError` with a fix when it cannot."""
        ...

    async def stop(self) -> None:
        """Release the vendor library; must not raise."""
        ...

    async def discover(self) -> Sequence[Device]:
        """The devices to publish now (may be called again to see changes)."""
        ...

    async def monitor_health(self, sink: HealthSink) -> None:
        """Report health changes to `sink` until cancelled; return promptly on cancellation.

        Watch what the latest `discover` found (re-scope when it changes), clear the STATE
        conditions the backend set once they end, and call `report_alive(sink)` on every turn.
        """
        ...

    async def prepare(self, device: str, claim: ClaimRef) -> ContainerEdits:
        """Make `device` ready for `claim`; raise `DeviceNotFoundError` for an unknown device.

        Must be idempotent: preparing an already prepared device returns the same edits.
        """
        ...

    async def unprepare(self, device: str, claim: ClaimRef) -> None:
        """Undo `prepare`; unpreparing what was never prepared succeeds."""
        ...

    async def telemetry(self) -> Sequence[DeviceTelemetry]:
        """Read the devices' counters (cheap; runs on the metrics poller's interval)."""
        ...


PreparePlan = Callable[[], ContainerEdits]
"""The blocking rest of a device's prepare (files, no vendor call, no waiting): its edits."""
UnpreparePlan = Callable[[], None]
"""The blocking rest of a device's unprepare."""


def nothing_to_undo() -> None:
    """The `UnpreparePlan` of a device whose prepare changed nothing outside the backend's memory."""


@runtime_checkable
class PlansPrepare(Protocol):
    """Optional for a `Backend`: a prepare and unprepare split into a check on the event loop and
    blocking work, which the core runs in the worker-thread hop that writes its checkpoint.

    A prepare is then one thread hop where it is three: the core's PrepareStarted record, the
    backend's own hop for its files, the CDI spec with PrepareCompleted (each hop costs 0.07 ms
    on an idle machine, ~0.2 ms on a busy node's 2 cores). The core asks for plans only for an
    exclusive device (no share, no configuration, no consumed capacity, no other claim on it),
    and uses `Backend.prepare`/`unprepare` (or the `SharingBackend` calls) when any is None.
    """

    def plan_prepare(self, device: str, claim: ClaimRef) -> PreparePlan | None:
        """Check `device` for `claim` without side effects (raise what `prepare` raises: unknown
        device, injected failure), and return the blocking work that prepares it, run once the
        core's PrepareStarted record is written, or None when `prepare` must do it (it waits,
        calls the vendor, or sets hardware up). The plan raises what `prepare` would."""
        ...

    def plan_unprepare(self, device: str, claim: ClaimRef) -> UnpreparePlan | None:
        """The blocking work that unprepares `device` for `claim`, run before the core drops the
        claim's entry, or None when `unprepare` must do it. Idempotent, like `unprepare`."""
        ...


PreparedStatus = Mapping[str, str | int]
"""What a backend tells of a device it prepared for a claim (`DescribesPrepared`)."""
STATUS_UUID = "uuid"
"""The prepared device's own UUID (a MIG device created at prepare has one only from then on)."""
STATUS_PARENT_UUID = "parentUUID"
"""The UUID of the physical GPU a MIG device or partition is part of (the slices' ``parentUUID``)."""
STATUS_GPU_INSTANCE_ID = "gpuInstanceID"
"""A MIG device's GPU instance ID (dcgm-exporter's ``GPU_I_ID``)."""


@runtime_checkable
class DescribesPrepared(Protocol):
    """Optional for a `Backend`: what identifies a device it prepared for a claim, beyond the
    published `Device`: a MIG device created at prepare (its UUID, GPU and compute instance IDs,
    profile), a partition's parent GPU.

    The core writes the mapping into the entry of the claim's ``status.devices[].data`` (over the
    `Device`'s ``uuid``, ``pciBusID``, ``productName`` and ``parent``), and labels the per-pod
    series with `STATUS_PARENT_UUID` and `STATUS_GPU_INSTANCE_ID`. It is asked after the prepare
    answered (never in it), at most once per prepared device and claim, and again after a restart:
    answer from what survives one. An empty mapping when there is nothing beyond the `Device`.
    """

    async def prepared_status(self, device: str, claim: ClaimRef) -> PreparedStatus:
        """The identity of `device` as prepared for `claim`; raise `BackendError` when unknown."""
        ...


async def prepared_status(backend: Backend, device: str, claim: ClaimRef) -> PreparedStatus:
    """`DescribesPrepared.prepared_status` of `backend`, or nothing when it does not describe."""
    if isinstance(backend, DescribesPrepared):
        return await backend.prepared_status(device, claim)
    return {}


@runtime_checkable
class ReportsConditions(Protocol):
    """Optional for a `Backend`: it names the health conditions it can report.

    The core creates those ``dra_agent_health_events_total`` series at 0 at start, so the first
    event of each shows in ``increase()``; a backend without it gets a series at each first event.
    """

    @property
    def health_conditions(self) -> Sequence[str]:
        """The ``condition`` names the backend's `HealthEvent`s can carry."""
        ...


@runtime_checkable
class PollsHealth(Protocol):
    """Optional for a `Backend`: its `monitor_health` also runs health passes on an interval
    (`BackendOptions.health_interval`), independent of vendor events, and calls `report_pass`
    after each.

    The core then holds conditions restored after a restart until the first pass that looked at
    their device, exports the pass's age (``dra_agent_health_pass_last_completed_timestamp_seconds``)
    and counts failed checks by name.
    """

    @property
    def health_checks(self) -> Sequence[str]:
        """The names of the pass's checks (``answers``, ``ecc-uncorrectable``, ...)."""
        ...


@runtime_checkable
class ReportsTrends(Protocol):
    """Optional for a `Backend`: which of its conditions are trends that precede failures
    (a rising correctable-ECC or PCIe-replay rate, ...): informational by default, and shown as
    ``dra_agent_device_degraded`` while active."""

    @property
    def trend_conditions(self) -> Sequence[str]:
        """The trend ``condition`` names (a subset of `ReportsConditions.health_conditions`)."""
        ...


def declared_checks(backend: Backend) -> tuple[str, ...]:
    """The health-pass checks of `backend` (`PollsHealth`); none when it does not poll."""
    return tuple(backend.health_checks) if isinstance(backend, PollsHealth) else ()


def declared_trends(backend: Backend) -> frozenset[str]:
    """The trend conditions of `backend` (`ReportsTrends`)."""
    return frozenset(backend.trend_conditions) if isinstance(backend, ReportsTrends) else frozenset()


def declared_conditions(backend: Backend) -> tuple[str, ...]:
    """The health conditions `backend` declares (`ReportsConditions`); none when it declares none."""
    return tuple(backend.health_conditions) if isinstance(backend, ReportsConditions) else ()


@dataclass(frozen=True)
class BackendOptions:
    """What a backend factory gets: the node, an optional driver name and its own settings.

    `state_dir` is the agent's state directory, a host path (the chart mounts it at the same
    path): a backend may keep files there that containers bind-mount. None: no such files.
    """

    node_name: str
    driver_name: str | None = None
    settings: Mapping[str, str] = field(default_factory=dict)
    state_dir: Path | None = None
    """Where the backend may keep what must survive an agent restart (None: nowhere)."""
    health_interval: float = DEFAULT_HEALTH_INTERVAL
    """Seconds between two health passes (``--health-interval``), for backends that poll."""


class BackendFactory(Protocol):
    """The entry point of a backend package."""

    def __call__(self, options: BackendOptions) -> Sequence[Backend]: ...


def available_backends() -> list[str]:
    """Names of the installed backends."""
    from importlib.metadata import entry_points

    return sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)} | set(BUILTIN_BACKENDS))


def load_backend_factory(name: str) -> BackendFactory:
    """Find the factory of backend `name`, or raise `BackendNotFoundError` listing the choices.

    Our own backends load by module name; any other name is looked up among the installed
    distributions' entry points (a scan of every distribution's metadata).
    """
    target = BUILTIN_BACKENDS.get(name)
    if target is not None:
        module, _, attribute = target.partition(":")
        factory: BackendFactory = getattr(importlib.import_module(module), attribute)
        return factory
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP, name=name):
        factory = ep.load()
        return factory
    raise BackendNotFoundError(
        f"unknown backend {name!r}: installed backends are {', '.join(available_backends()) or 'none'} "
        "(install the package with 'pip install dra-agent[nvidia]' or '[amd]' for a vendor backend)"
    )
