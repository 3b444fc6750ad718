"""GPU sharing, vendor-neutral: opaque device configuration, shares of one device, consumable capacity.

Configuration. The scheduler copies a DeviceClass's ``spec.config`` into the claim's
``status.allocation.devices.config`` (source ``FromClass``, scoped to the requests that use the
class) followed by the claim's own ``spec.devices.config`` (source ``FromClaim``); see
``K/staging/src/k8s.io/dynamic-resource-allocation/structured/internal/*/allocator.go``. A driver
reads that list, never the class itself (the class may have changed since allocation). Of the
entries of our driver that apply to a device's request, the last wins: claim over class, later
over earlier, as NVIDIA's driver and the Go helper order them. The core carries the chosen entry
as an `OpaqueConfig`; the backend parses its vendor format.

Shares. With consumable capacity (Kubernetes ``DRAConsumableCapacity``), several claims get one
device, each with its own ``shareID`` and ``consumedCapacity``. A `SharingBackend` prepares one
`DeviceShare` at a time and is told which other shares of the device are prepared (its peers,
from the checkpoint), so the first share sets the device up, the last one tears it down, and a
share whose configuration conflicts with a peer's fails naming that peer's claim.

Consumable shares (backend setting ``consumable-shares``): `ConsumableShares.apply` makes a
device shareable in the ResourceSlice (``allowMultipleAllocations`` and a ``requestPolicy``).
With ``memory``, a CUDA device that MPS can limit (``cudaComputeCapability`` 7.0 or newer) also
gets a ``compute`` capacity: 100 percent of its SMs, requested in whole percents (see
`COMPUTE_POLICY` for the policy and why). `compute_share` and `memory_share` read a share's
consumption back, checked, for the backend that enforces it (NVIDIA: MPS).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

from agent.core.backend import ClaimRef, ContainerEdits
from agent.core.errors import AgentError, ConfigError
from agent.core.model import MAX_ATTRIBUTES_AND_CAPACITIES, Device, RequestPolicy
from agent.core.quantity import Quantity

SOURCE_CLASS = "FromClass"
SOURCE_CLAIM = "FromClaim"
MEMORY = "memory"
SHARES = "shares"
MEMORY_STEP = Quantity.binary(1024**3)
"""Memory shares are whole GiB: small enough for inference, large enough to keep the grid short."""
ZERO = Quantity.parse(0)
COMPUTE = "compute"
COMPUTE_WHOLE = 100
"""A device's ``compute`` capacity: percent of its SMs (MPS's active-thread percentage)."""
COMPUTE_POLICY = RequestPolicy(
    default=ZERO,
    min=ZERO,
    max=Quantity.parse(COMPUTE_WHOLE),
    step=Quantity.parse(1),
)
"""Whole percents from 0 to 100; a claim that asks nothing reserves none and is not capped.

Zero by default so that what users already run keeps working: claims that share a GPU by memory
alone (``capacity.requests: {memory: 20Gi}``) still pack onto one GPU after an upgrade. Such a
claim's processes are not capped (best effort beside capped neighbours); a claim that needs SMs
kept for it requests them (``compute: "30"``), and MPS caps it there. The API server's rules hold
(``validation.go`` ``validateRequestPolicy``): min <= default <= max <= capacity, default and max on
the step grid from min, min + step <= capacity."""
COMPUTE_ATTRIBUTE = "cudaComputeCapability"
COMPUTE_MIN_CAPABILITY = (7, 0)
"""Volta: the first GPUs whose MPS limits a client's threads, so a compute share is enforceable."""
PINNED_UNIT = Quantity.binary(1024 * 1024)
"""MPS limits are whole MiB: a memory share under 1Mi cannot be expressed."""


class DeviceConfigError(AgentError):
    """A claim's opaque configuration is invalid (names the claim, field, value and what is accepted)."""

    def __init__(self, claim: str, where: str, field: str, value: object, accepted: str) -> None:
        self.claim = claim
        self.field = field
        super().__init__(
            f"claim {claim}: {where}: invalid {field} {value!r}: expected {accepted}; "
            "fix the claim's (or its DeviceClass's) config and create the claim again"
        )


class ShareConflictError(AgentError):
    """Two shares of one device ask for configurations that cannot hold at once."""


@dataclass(frozen=True)
class OpaqueConfig:
    """One ``status.allocation.devices.config`` entry of our driver."""

    driver: str
    parameters: Mapping[str, Any]
    source: str = SOURCE_CLAIM
    requests: tuple[str, ...] = ()
    """Request names it applies to; empty: all requests of the claim."""
    index: int = 0
    """Its position in ``status.allocation.devices.config`` (for messages)."""

    @property
    def where(self) -> str:
        """Where the user finds it: ``status.allocation.devices.config[1] (from the DeviceClass)``."""
        origin = "the DeviceClass" if self.source == SOURCE_CLASS else "the claim"
        return f"status.allocation.devices.config[{self.index}] (from {origin})"

    def applies_to(self, request: str) -> bool:
        """True for a config of all requests, of `request`, or of its parent (``gpu`` for ``gpu/a``)."""
        return not self.requests or request in self.requests or request.split("/", 1)[0] in self.requests

    def to_json(self) -> dict[str, Any]:
        """The checkpoint form."""
        return {
            "driver": self.driver,
            "source": self.source,
            "requests": list(self.requests),
            "index": self.index,
            "parameters": dict(self.parameters),
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> OpaqueConfig:
        """The inverse of `to_json`; raises KeyError, TypeError or ValueError."""
        parameters = raw["parameters"]
        if not isinstance(parameters, Mapping):
            raise TypeError("config parameters must be an object")
        return cls(
            driver=str(raw["driver"]),
            parameters=parameters,
            source=str(raw.get("source", SOURCE_CLAIM)),
            requests=tuple(str(r) for r in raw.get("requests", [])),
            index=int(raw.get("index", 0)),
        )


def select_config(configs: Sequence[OpaqueConfig], requests: Sequence[str]) -> OpaqueConfig | None:
    """The config of a device serving `requests`: the last entry that applies to one of them."""
    for config in reversed(configs):
        if not requests or any(config.applies_to(r) for r in requests):
            return config
    return None


@dataclass(frozen=True)
class DeviceShare:
    """One claim's use of one device: what a `SharingBackend` prepares."""

    device: str
    claim: ClaimRef
    share_id: str | None = None
    consumed: Mapping[str, Quantity] = field(default_factory=dict)
    """``consumedCapacity`` of the allocation result (empty for an exclusive device)."""
    config: OpaqueConfig | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "consumed", MappingProxyType(dict(self.consumed)))

    @property
    def claim_key(self) -> str:
        """``namespace/name`` of the claim, for messages."""
        return f"{self.claim.namespace}/{self.claim.name}"


@runtime_checkable
class SharingBackend(Protocol):
    """Optional for a `Backend`: prepares shares with their configuration (time-slicing, MPS...).

    The core calls these instead of `Backend.prepare`/`unprepare` when the backend has them.
    `peers` are the other prepared shares of the same device (from the checkpoint): none at a
    prepare means "first user, set the device up"; none at an unprepare means "last user, tear
    it down". Raise `DeviceConfigError` for a bad configuration and `ShareConflictError` when
    `share` cannot coexist with a peer; nothing may stay half-applied when either is raised.
    """

    async def prepare_share(self, share: DeviceShare, peers: Sequence[DeviceShare]) -> ContainerEdits:
        """Make the device ready for this share (idempotent); the edits are this claim's."""
        ...

    async def unprepare_share(self, share: DeviceShare, peers: Sequence[DeviceShare]) -> None:
        """Undo `prepare_share` for this share; tear the device's set-up down when `peers` is empty."""
        ...

    async def resume_shares(self, shares: Sequence[DeviceShare]) -> None:
        """After a restart: keep (re-adopt) the set-up of devices with shares, undo it on the others."""
        ...


def _allocation_where(share: DeviceShare) -> str:
    return f"status.allocation.devices.results (device {share.device!r}, shareID {share.share_id})"


def compute_share(share: DeviceShare) -> int | None:
    """The share's consumed ``compute`` (whole percent, 1-100), None when it consumed none (or 0:
    nothing reserved, no cap).

    Raises `DeviceConfigError` for another value: the API server lets any quantity through in
    ``consumedCapacity`` (dra-1.36-verified-shapes.md), and an allocation may predate the policy.
    """
    consumed = share.consumed.get(COMPUTE)
    if consumed is None or consumed.value == 0:
        return None
    value = consumed.value
    if value.denominator != 1 or not 1 <= value <= COMPUTE_WHOLE:
        raise DeviceConfigError(
            share.claim_key,
            _allocation_where(share),
            f"consumedCapacity.{COMPUTE}",
            consumed.canonical(),
            f"a whole percentage of the device's SMs from 0 to {COMPUTE_WHOLE}",
        )
    return int(value)


def memory_share(share: DeviceShare) -> Quantity | None:
    """The share's consumed ``memory``; None when it consumed none (or 0: nothing reserved, no limit).

    Raises `DeviceConfigError` for a share between 0 and 1Mi (a limit MPS cannot express).
    """
    consumed = share.consumed.get(MEMORY)
    if consumed is None or consumed.value == 0:
        return None
    if consumed.value < PINNED_UNIT.value:
        raise DeviceConfigError(
            share.claim_key,
            _allocation_where(share),
            f"consumedCapacity.{MEMORY}",
            consumed.canonical(),
            "0 or at least 1Mi (limits are whole MiB)",
        )
    return consumed


def merge_edits(first: ContainerEdits, second: ContainerEdits) -> ContainerEdits:
    """A device's edits plus its share's (MPS pipe, limits): lists joined, `first` wins on a variable."""
    return ContainerEdits(
        device_nodes=first.device_nodes + second.device_nodes,
        env={**second.env, **first.env},
        mounts=first.mounts + second.mounts,
        cdi_device_ids=first.cdi_device_ids + second.cdi_device_ids,
        list_env=first.list_env | second.list_env,
        hooks=first.hooks + second.hooks,
    )


def share_conflict(share: DeviceShare, peer: DeviceShare, mine: str, theirs: str) -> ShareConflictError:
    """The error for two shares of one device with configurations that exclude each other."""
    return ShareConflictError(
        f"claim {share.claim_key}: device {share.device!r} is shared with claim {peer.claim_key} "
        f"({peer.claim.uid}), which uses {theirs}; this claim asks for {mine}. Shares of one device "
        "must use the same sharing configuration: align the claims' configs (or their DeviceClass's)"
    )


class SharesMode(enum.Enum):
    """The values of the ``consumable-shares`` backend setting."""

    DISABLED = "disabled"
    MEMORY = "memory"
    UNLIMITED = "unlimited"
    COUNT = "count"


@dataclass(frozen=True)
class ConsumableShares:
    """How devices are published for sharing (backend setting ``consumable-shares``).

    ``disabled`` (default): exclusive devices. ``memory``: shareable; the ``memory`` capacity has
    a request policy of whole GiB (default 1Gi, from 1Gi up to the capacity rounded down to a
    GiB), so the scheduler hands out memory shares, and a CUDA device MPS can limit gets a
    ``compute`` capacity of 100 (`COMPUTE_POLICY`: whole percents, default 0: not reserved, not capped).
    ``unlimited``: shareable; every capacity defaults to 0, so any number of claims fit. ``<N>``:
    shareable by at most N claims, through a ``shares`` capacity of N with a policy of 1
    (capacities other than ``memory``/``shares``/``compute`` default to 0 in every mode, so an
    omitted request never takes the whole device; ``compute`` does on purpose, see
    `COMPUTE_POLICY`).
    """

    mode: SharesMode = SharesMode.DISABLED
    count: int = 0

    SETTING = "consumable-shares"
    MAX_COUNT = 1024

    @classmethod
    def parse(cls, text: str, option: str) -> ConsumableShares:
        """From the setting's text; `option` names it in the `ConfigError`."""
        value = text.strip().lower()
        for mode in (SharesMode.DISABLED, SharesMode.MEMORY, SharesMode.UNLIMITED):
            if value == mode.value:
                return cls(mode)
        if value.isdigit() and 1 <= int(value) <= cls.MAX_COUNT:
            return cls(SharesMode.COUNT, int(value))
        raise ConfigError(
            option, text, f"disabled, memory, unlimited or a number of shares from 1 to {cls.MAX_COUNT}"
        )

    @property
    def enabled(self) -> bool:
        """True when devices are published shareable."""
        return self.mode is not SharesMode.DISABLED

    def apply(self, device: Device) -> Device:
        """`device` as published under this setting (unchanged when disabled or impossible)."""
        if not self.enabled or device.consumes_counters:
            return device  # a partition placement (counters) stays exclusive: its sharing is the MIG layout
        capacity = dict(device.capacity)
        policies: dict[str, RequestPolicy] = {name: RequestPolicy(default=ZERO) for name in capacity}
        if self.mode is SharesMode.MEMORY:
            memory = capacity.get(MEMORY)
            if memory is None or memory.value < 2 * MEMORY_STEP.value:
                return device  # nothing to share out: keep it exclusive
            steps = int((memory.value - MEMORY_STEP.value) // MEMORY_STEP.value)
            top = Quantity(MEMORY_STEP.value * (steps + 1), "BinarySI")
            policies[MEMORY] = RequestPolicy(default=MEMORY_STEP, min=MEMORY_STEP, max=top, step=MEMORY_STEP)
            if _compute_limitable(device) and COMPUTE not in capacity:
                capacity[COMPUTE] = Quantity.parse(COMPUTE_WHOLE)
                policies[COMPUTE] = COMPUTE_POLICY
        elif self.mode is SharesMode.COUNT:
            count = Quantity(Fraction(self.count), "DecimalSI")
            one = Quantity.parse(1)
            capacity[SHARES] = count
            policies[SHARES] = RequestPolicy(default=one, min=one, max=count, step=one)
        return replace(device, capacity=capacity, allow_multiple_allocations=True, request_policies=policies)


def _compute_limitable(device: Device) -> bool:
    """A CUDA device whose MPS limits threads (Volta or newer), with room for one more capacity."""
    parts = str(device.attributes.get(COMPUTE_ATTRIBUTE, "")).split(".")
    if len(parts) < 2 or not all(p.isdigit() for p in parts[:2]):
        return False
    if len(device.attributes) + len(device.capacity) >= MAX_ATTRIBUTES_AND_CAPACITIES:
        return False  # the API server's limit per device: keep it publishable, without compute
    return (int(parts[0]), int(parts[1])) >= COMPUTE_MIN_CAPABILITY
