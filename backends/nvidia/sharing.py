"""Time-slicing and MPS for shares of NVIDIA devices (the `SharingBackend` part of a backend).

`NvSharingManager` decides per share, from its configuration (`backends.nvidia.sharingconfig`)
and its peers (the device's other prepared shares, from the checkpoint):

- a share conflicts with a peer whose device-wide set-up differs (TimeSlicing vs MPS, two
  intervals, two MPS defaults): a per-claim error naming the peer's claim, nothing applied;
- the first TimeSlicing share sets the interval (compute mode DEFAULT, then
  ``nvidia-smi compute-policy --set-timeslice``, as NVIDIA's driver does); the last restores the
  default interval;
- the first MPS share starts the device's control daemon (`backends.nvidia.mps`), the last stops
  it; each MPS share gets the pipe directory, and with ``consumable-shares=memory`` its
  ``consumedCapacity`` is enforced by MPS itself: ``memory`` becomes the client's
  ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` and ``compute`` its ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``.

Which wins, per variable: where the claim's GpuConfig sets a daemon default itself
(``mpsConfig.defaultActiveThreadPercentage``; ``defaultPinnedDeviceMemoryLimit`` or a
``defaultPerDevicePinnedMemoryLimit`` entry for the device), that default applies to every client
of the device and the share's consumed value is not set (all shares of a device carry the same
defaults, see `_compatible`); where it does not, the share's consumed value is the client's
variable. A compute share below 100 needs MPS (nothing else can cap it): without it the claim
fails, as does a consumed compute that is not a whole percentage from 1 to 100. These checks run
before anything is applied, and as part of reading a share (`_parse_or_none`), so the rollback of
a refused share undoes nothing either.

A claim without configuration uses the device as is (no set-up); it conflicts with MPS shares
only (its processes would not go through the daemon). The checkpoint records each share's
configuration before any of this happens, so after a crash the core rolls back what a share
began (`unprepare`) and `resume` re-applies or undoes the set-up of every device.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import anyio
import anyio.to_thread

from agent.core.backend import ContainerEdits
from agent.core.errors import BackendError, DeviceNotFoundError
from agent.core.logs import log_fields
from agent.core.model import AttributeValue
from agent.core.quantity import Quantity
from agent.core.sharing import (
    COMPUTE,
    COMPUTE_WHOLE,
    DeviceConfigError,
    DeviceShare,
    compute_share,
    memory_share,
    share_conflict,
)
from backends.nvidia.driverfiles import ProgramLocator, on_path
from backends.nvidia.mps import MpsDaemons, stop_unneeded
from backends.nvidia.sharingconfig import (
    EXCLUSIVE_USE,
    GPU_CONFIG,
    INTERVALS,
    MIG_CONFIG,
    MPS,
    TIME_SLICING,
    NvSharing,
    parse_nvidia_config,
)

log = logging.getLogger("agent.nvidia.sharing")

DEFAULT_MODE = "DEFAULT"
MPS_MODE = "EXCLUSIVE_PROCESS"
MPS_MIN_COMPUTE_CAPABILITY = (7, 0)
"""Volta: the first architecture whose MPS takes thread and memory limits."""


@dataclass(frozen=True)
class DeviceFacts:
    """What sharing needs to know of a device."""

    uuid: str
    mig: bool = False
    compute_capability: tuple[int, int] | None = None


def facts_of(attributes: Mapping[str, AttributeValue], uuid: str) -> DeviceFacts:
    """From a device's attributes (``type``, ``cudaComputeCapability``) and UUID."""
    capability = str(attributes.get("cudaComputeCapability", "")).split(".")
    parsed = (
        (int(capability[0]), int(capability[1]))
        if len(capability) >= 2 and all(p.isdigit() for p in capability[:2])
        else None
    )
    return DeviceFacts(uuid=uuid, mig=attributes.get("type") == "mig", compute_capability=parsed)


class GpuPolicy(Protocol):
    """Sets a GPU's time-slice interval (``INTERVALS`` value; 0 is the default) and compute mode."""

    async def set_interval(self, uuid: str, interval: int) -> None: ...

    async def set_compute_mode(self, uuid: str, mode: str) -> None:
        """``DEFAULT`` or ``EXCLUSIVE_PROCESS`` (MPS: only the daemon opens contexts on the GPU)."""
        ...


class SmiGpuPolicy:
    """Through the ``nvidia-smi`` the driver ships (NVML has no call for the interval)."""

    def __init__(self, locate: ProgramLocator | None = None) -> None:
        self._locate = locate or on_path("nvidia-smi")

    async def _run(self, *args: str) -> None:
        program = await anyio.to_thread.run_sync(self._locate)
        try:
            result = await anyio.run_process(
                [program.path, *args], env=program.environ(os.environ), check=False
            )
        except OSError as error:
            raise BackendError(
                f"cannot run {program.path}: {error}; time-slicing and MPS need the driver's nvidia-smi "
                "(see the nvidia backend's driver-root and host-root settings)"
            ) from error
        if result.returncode != 0:
            raise BackendError(
                f"{program.path} {' '.join(args)} failed ({result.returncode}): "
                f"{(result.stdout + result.stderr).decode(errors='replace').strip()}"
            )

    async def set_interval(self, uuid: str, interval: int) -> None:
        await self.set_compute_mode(uuid, DEFAULT_MODE)
        await self._run("compute-policy", "-i", uuid, f"--set-timeslice={interval}")

    async def set_compute_mode(self, uuid: str, mode: str) -> None:
        await self._run("-i", uuid, "-c", mode)


class NvSharingManager:
    """Shares of one backend's devices: conflicts, time-slicing and MPS daemons."""

    def __init__(
        self,
        facts: Callable[[str], DeviceFacts],
        policy: GpuPolicy,
        daemons: MpsDaemons,
        parse: Callable[[DeviceShare], NvSharing] | None = None,
    ) -> None:
        self._facts = facts
        self.policy = policy
        self.daemons = daemons
        self._parse = parse or sharing_of

    async def prepare(self, share: DeviceShare, peers: Sequence[DeviceShare]) -> ContainerEdits:
        """Check, set the device up if this is its first share of the kind, return the share's edits."""
        mine = self._checked(share)
        facts = self._facts(share.device)
        self._check_device(share, mine, facts)
        theirs = [(peer, self._parse(peer)) for peer in peers]
        for peer, other in theirs:
            if not _compatible(mine, other):
                raise share_conflict(share, peer, mine.describe(), other.describe())
        if mine.strategy == TIME_SLICING and not any(o.strategy == TIME_SLICING for _, o in theirs):
            await self.policy.set_interval(facts.uuid, INTERVALS[mine.interval])
            log.info("time-slicing set", extra=log_fields(device=share.device, interval=mine.interval))
        if mine.strategy == MPS:
            pinned, threads = self._client_limits(share, mine, facts.uuid)
            await self._start_mps(share.device, facts, mine)
            return self.daemons.edits(share.device, facts.uuid, pinned, threads)
        return ContainerEdits()

    def _checked(self, share: DeviceShare) -> NvSharing:
        """The share's sharing, with its consumed capacity checked against it (`DeviceConfigError`)."""
        mine = self._parse(share)
        compute = compute_share(share)
        memory_share(share)
        if compute is not None and compute < COMPUTE_WHOLE and mine.strategy != MPS:
            where = (
                share.config.where
                if share.config is not None
                else "status.allocation.devices.config (no entry of this driver applies to the device)"
            )
            raise DeviceConfigError(
                share.claim_key,
                where,
                "sharing.strategy",
                None if mine.strategy == EXCLUSIVE_USE.strategy else mine.strategy,
                f"MPS for a compute share: the claim consumed {COMPUTE} {compute} of device "
                f"{share.device!r} and only MPS caps a claim's SMs "
                f"(or request no compute, or {COMPUTE_WHOLE})",
            )
        return mine

    @staticmethod
    def _client_limits(share: DeviceShare, mine: NvSharing, uuid: str) -> tuple[Quantity | None, int | None]:
        """The client's pinned-memory limit and thread percentage: the share's, unless the config's
        daemon defaults set them (then those apply to every client, and the share's are not set)."""
        pinned, threads = memory_share(share), compute_share(share)
        overridden = []
        default_pinned = mine.mps.pinned_for(uuid)
        if pinned is not None and default_pinned is not None:
            overridden.append(f"memory {pinned.canonical()} (config: {default_pinned.canonical()})")
            pinned = None
        if threads is not None and mine.mps.active_thread_percentage is not None:
            overridden.append(f"compute {threads} (config: {mine.mps.active_thread_percentage})")
            threads = None
        if overridden:
            log.info(
                "the claim's MPS defaults win over its share's consumed capacity",
                extra=log_fields(
                    claim=share.claim_key, device=share.device, overridden=", ".join(overridden)
                ),
            )
        return pinned, threads

    async def unprepare(self, share: DeviceShare, peers: Sequence[DeviceShare]) -> None:
        """Tear the device's set-up down when no remaining share needs it."""
        mine = self._parse_or_none(share)
        remaining = [s for s in (self._parse_or_none(p) for p in peers) if s is not None]
        if mine is None:
            return
        if mine.strategy == TIME_SLICING and not any(o.strategy == TIME_SLICING for o in remaining):
            facts = self._facts_or_none(share.device)
            if facts is None:
                log.info(
                    "time-sliced device is gone; nothing to restore", extra=log_fields(device=share.device)
                )
            else:
                await self.policy.set_interval(facts.uuid, INTERVALS["Default"])
                log.info("time-slicing restored to the default", extra=log_fields(device=share.device))
        if mine.strategy == MPS and not any(o.strategy == MPS for o in remaining):
            await self.daemons.stop(share.device)
            facts = self._facts_or_none(share.device)
            if facts is not None and not facts.mig:
                await self.policy.set_compute_mode(facts.uuid, DEFAULT_MODE)

    async def resume(self, shares: Sequence[DeviceShare]) -> None:
        """After a restart: re-adopt (or restart) needed daemons, stop the rest, re-apply intervals."""
        needed: dict[str, NvSharing] = {}
        for share in shares:
            parsed = self._parse_or_none(share)
            if parsed is not None and parsed.strategy != EXCLUSIVE_USE.strategy:
                needed.setdefault(share.device, parsed)
        await stop_unneeded(self.daemons, [d for d, s in needed.items() if s.strategy == MPS])
        for device, sharing in needed.items():
            uuid = self._facts(device).uuid
            if sharing.strategy == MPS:
                if await self._start_mps(device, self._facts(device), sharing):
                    log.warning(
                        "restarted the MPS daemon of a shared device", extra=log_fields(device=device)
                    )
                else:
                    log.info("re-adopted the MPS daemon of a shared device", extra=log_fields(device=device))
            else:
                await self.policy.set_interval(uuid, INTERVALS[sharing.interval])

    async def _start_mps(self, device: str, facts: DeviceFacts, sharing: NvSharing) -> bool:
        """Compute mode EXCLUSIVE_PROCESS on a whole GPU (as NVIDIA's driver sets it), then the daemon."""
        if not facts.mig:  # a MIG device's mode is its parent GPU's, which other devices share
            await self.policy.set_compute_mode(facts.uuid, MPS_MODE)
        try:
            return await self.daemons.ensure(device, facts.uuid, sharing.mps)
        except BaseException:
            if not facts.mig:
                with anyio.CancelScope(shield=True):
                    await self.policy.set_compute_mode(facts.uuid, DEFAULT_MODE)
            raise

    def _facts_or_none(self, device: str) -> DeviceFacts | None:
        try:
            return self._facts(device)
        except DeviceNotFoundError:
            return None

    def _parse_or_none(self, share: DeviceShare) -> NvSharing | None:
        try:
            return self._checked(share)
        except DeviceConfigError:
            return None  # never applied: nothing to undo

    def _check_device(self, share: DeviceShare, mine: NvSharing, facts: DeviceFacts) -> None:
        if mine is EXCLUSIVE_USE or share.config is None:
            return
        where = share.config.where
        wanted = MIG_CONFIG if facts.mig else GPU_CONFIG
        if mine.kind != wanted:
            raise DeviceConfigError(
                share.claim_key, where, "kind", mine.kind, f"{wanted} for device {share.device!r}"
            )
        if mine.strategy == MPS:
            capability = facts.compute_capability
            if capability is not None and capability < MPS_MIN_COMPUTE_CAPABILITY:
                raise DeviceConfigError(
                    share.claim_key,
                    where,
                    "sharing.strategy",
                    MPS,
                    f"TimeSlicing: device {share.device!r} has compute capability "
                    f"{capability[0]}.{capability[1]}, MPS with limits needs 7.0 (Volta) or newer",
                )
            for key in mine.mps.per_device_pinned:
                if key not in ("0", facts.uuid):
                    raise DeviceConfigError(
                        share.claim_key,
                        where,
                        "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit key",
                        key,
                        f"0 or the device's UUID {facts.uuid}",
                    )


def _compatible(a: NvSharing, b: NvSharing) -> bool:
    """MPS only with the same MPS defaults; TimeSlicing with one interval; plain use with TimeSlicing."""
    if MPS in (a.strategy, b.strategy):
        return _device_setup(a) == _device_setup(b)
    if a.strategy == b.strategy == TIME_SLICING:
        return a.interval == b.interval
    return True


def _device_setup(sharing: NvSharing) -> tuple[object, ...]:
    """What must be equal between shares of one device."""
    if sharing.strategy == TIME_SLICING:
        return (TIME_SLICING, sharing.interval)
    if sharing.strategy == MPS:
        mps = sharing.mps
        return (
            MPS,
            mps.active_thread_percentage,
            mps.pinned_memory_limit,
            tuple(sorted(mps.per_device_pinned.items())),
        )
    return (sharing.strategy,)


def sharing_of(share: DeviceShare) -> NvSharing:
    """The share's NVIDIA sharing configuration (exclusive use without one)."""
    if share.config is None:
        return EXCLUSIVE_USE
    return parse_nvidia_config(share.config, share.claim_key)
