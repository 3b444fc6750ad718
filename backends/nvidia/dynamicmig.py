"""Dynamic MIG: publish every MIG placement, create the MIG device at prepare, destroy it at unprepare.

With the setting ``dynamic-mig=true``, a GPU in MIG mode on which no one else created a GPU
instance is published as partitionable (`migprofiles`): the scheduler picks a placement whose
counters are free, and `prepare` creates that GPU instance and its compute instance through NVML,
journaling each step before and after it (`migjournal`). Any failure rolls back in reverse (the
compute instance, then the GPU instance). `unprepare` destroys the compute instance then the GPU
instance, either of them possibly gone already. At start, `reconcile` destroys what the journal
says was being created or destroyed when the agent stopped; a prepared MIG device stays for its
claim. GPU instances this backend did not create are never touched, and a GPU that has any is
published as its static MIG devices.

All NVML calls here are blocking and run in a worker thread through `Nvml.run`.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio.to_thread

from agent.core.backend import PreparedStatus
from agent.core.errors import BackendError
from agent.core.logs import log_fields
from backends.nvidia.discovery import GpuInfo, MigInfo, NvDevice
from backends.nvidia.migjournal import (
    CI_CREATED,
    CREATING_CI,
    CREATING_GI,
    DESTROYING,
    PREPARED,
    MigEntry,
    MigJournal,
)
from backends.nvidia.migprofiles import MigLayout, PlacementDevice, dynamic_devices, read_layout
from backends.nvidia.migstatus import mig_status
from backends.nvidia.nvml import Nvml, text

log = logging.getLogger("agent.backends.nvidia")
T = TypeVar("T")

MAX_GPU_INSTANCE_ID = 32
MAX_COMPUTE_INSTANCE_ID = 8
# Compute-instance profile index for a compute instance spanning all of a GPU instance's slices.
CI_PROFILE_BY_SLICES = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4, 8: 5, 6: 6}


class DynamicMigError(BackendError):
    """Creating or destroying a MIG device failed; the message names the GPU, placement and NVML error."""


class DynamicMig:
    """The dynamic-MIG part of the NVIDIA backend: which devices are placements, and their life."""

    def __init__(self, nvml: Nvml, journal: MigJournal) -> None:
        self._nvml = nvml
        self._lib: Any = nvml.lib
        self.journal = journal
        self.placements: dict[str, PlacementDevice] = {}
        """Every placement ever published. Kept when its GPU turns static (someone created a MIG
        device by hand), so that a late allocation of it fails to create rather than being given
        the other MIG device that now has the same name."""
        self._layouts: dict[str, MigLayout] = {}
        self._said: set[tuple[str, str]] = set()
        self._refused: set[str] = set()
        """GPUs whose GPU-instance calls fail (published whole), warned once per episode."""

    # -- discovery (worker thread) ------------------------------------------------------------

    def gpu_devices(
        self, whole: NvDevice, total_memory: int, mig_mode: Any, static: list[NvDevice]
    ) -> list[NvDevice]:
        """The devices of one GPU: partitionable when it can be, else as without dynamic MIG."""
        gpu = whole.gpu
        if mig_mode is None:
            self._say(gpu, "GPU cannot do MIG: published as a whole GPU", "")
            return [whole]
        if not gpu.mig_enabled:
            self._say(
                gpu,
                "MIG mode is off: published as a whole GPU",
                f"enable it with 'nvidia-smi -i {gpu.index} -mig 1'",
            )
            return [whole]
        try:
            foreign = self._foreign_instances(gpu)
        except Exception as error:
            if not self._nvml.is_error(error) or self._nvml.is_gpu_lost(error):
                raise
            # nvml.h: NOT_SUPPORTED means "MIG not enabled", which can change between two calls
            # (and NVIDIA's mock answers it always): publish the GPU whole rather than drop it.
            self._refuse(gpu, f"nvmlDeviceGetGpuInstanceById: {error}")
            return [whole]
        if foreign:
            self._say(
                gpu,
                "GPU has MIG devices this agent did not create: "
                "published as static MIG devices, never reconfigured",
                f"GPU instance IDs {sorted(foreign)}; destroy them to let the scheduler pick the layout",
            )
            return static
        layout = self._layouts.get(gpu.uuid)
        if layout is None:
            layout = read_layout(self._nvml, gpu, total_memory)
            if layout.profiles:
                # An empty layout is not kept: the profile calls may answer at the next rediscovery.
                self._layouts[gpu.uuid] = layout
        if not layout.profiles:
            self._refuse(gpu, "NVML lists no MIG placement (the GPU-instance profile calls fail)")
            return [whole]
        if gpu.uuid in self._refused:
            self._refused.discard(gpu.uuid)
            log.info(
                "GPU-instance calls answer again: the GPU is partitionable", extra=log_fields(gpu=gpu.uuid)
            )
        device, placements = dynamic_devices(whole.device, gpu.uuid, gpu.minor, gpu.index, layout)
        found = [NvDevice(device, gpu)]
        for placement_device, placement in placements:
            self.placements[placement.name] = placement
            found.append(NvDevice(placement_device, gpu))
        return found

    def _refuse(self, gpu: GpuInfo, why: str) -> None:
        """Publish `gpu` whole because its GPU-instance calls fail; one warning per episode."""
        if gpu.uuid in self._refused:
            return
        self._refused.add(gpu.uuid)
        log.warning(
            "GPU in MIG mode but its GPU-instance calls fail: published as a whole GPU",
            extra=log_fields(gpu=gpu.uuid, minor=gpu.minor, error=why, hint="check 'nvidia-smi mig -lgip'"),
        )

    def _say(self, gpu: GpuInfo, message: str, hint: str) -> None:
        # One line per GPU and reason, not one per rediscovery.
        if (gpu.uuid, message) in self._said:
            return
        self._said.add((gpu.uuid, message))
        hints = {"hint": hint} if hint else {}
        log.info(message, extra=log_fields(gpu=gpu.uuid, minor=gpu.minor, **hints))

    def _foreign_instances(self, gpu: GpuInfo) -> set[int]:
        ours = {e.gi_id for e in self.journal.entries() if e.gpu_uuid == gpu.uuid and e.gi_id is not None}
        ours |= {gi for gi, _ in self._unjournaled_ours(gpu)}
        return {gi for gi in self._gpu_instances(gpu.handle) if gi not in ours}

    def _unjournaled_ours(self, gpu: GpuInfo) -> list[tuple[int, Any]]:
        """GPU instances created by a prepare that crashed before it journaled the ID."""
        found: list[tuple[int, Any]] = []
        for entry in self.journal.entries():
            if entry.gpu_uuid == gpu.uuid and entry.gi_id is None:
                match = self._find_created(gpu.handle, entry)
                if match is not None:
                    found.append(match)
        return found

    def _gpu_instances(self, handle: Any) -> dict[int, Any]:
        found: dict[int, Any] = {}
        for gi_id in range(MAX_GPU_INSTANCE_ID):
            instance = self._call_or_none(self._lib.nvmlDeviceGetGpuInstanceById, handle, gi_id)
            if instance is not None:
                found[gi_id] = instance
        return found

    def _call_or_none(self, func: Callable[..., Any], *args: Any) -> Any:
        """`func(*args)`, or None when the instance does not exist (NOT_FOUND / INVALID_ARGUMENT)."""
        try:
            return func(*args)
        except Exception as error:
            if self._nvml.is_error(error) and (
                self._nvml.is_not_found(error)
                or isinstance(error, self._nvml.error_class("NVMLError_InvalidArgument"))
            ):
                return None
            raise

    # -- prepare / unprepare ------------------------------------------------------------------

    async def prepare(
        self,
        placement: PlacementDevice,
        claim_uid: str,
        published: NvDevice,
        finish: Callable[[NvDevice], Awaitable[T]],
    ) -> T:
        """Create the MIG device of `placement` for a claim and return `finish(mig_device)`.

        `finish` computes the container edits; if it fails, the MIG device is destroyed too.
        Idempotent: a claim's prepared placement is returned again without creating anything.
        """
        gpu = published.gpu
        entry = await anyio.to_thread.run_sync(self.journal.get, claim_uid, placement.name)
        if entry is not None and entry.step == PREPARED:
            return await finish(self._mig_device(placement, published, entry))
        if entry is not None:  # an earlier attempt of this claim stopped half-way
            await self._nvml.run(self._destroy_sync, gpu.handle, entry)
        entry = await self._nvml.run(self._create_sync, placement, claim_uid, gpu)
        try:
            result = await finish(self._mig_device(placement, published, entry))
            await anyio.to_thread.run_sync(self.journal.put, entry.at(PREPARED))
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._nvml.run(self._rollback_sync, gpu.handle, entry)
            raise
        log.info(
            "created MIG device",
            extra=log_fields(
                gpu=gpu.uuid,
                device=placement.name,
                claim=claim_uid,
                gi=entry.gi_id,
                ci=entry.ci_id,
                mig=entry.mig_uuid,
            ),
        )
        return result

    async def status_of(self, placement: PlacementDevice, claim_uid: str) -> PreparedStatus:
        """The MIG device created for a claim, from the journal (`DescribesPrepared`)."""
        entry = await anyio.to_thread.run_sync(self.journal.get, claim_uid, placement.name)
        if entry is None or entry.step != PREPARED:
            raise DynamicMigError(f"NVIDIA dynamic MIG: no MIG device created for {placement.name}")
        return mig_status(
            mig_uuid=entry.mig_uuid,
            parent_uuid=entry.gpu_uuid,
            gi_id=entry.gi_id,
            ci_id=entry.ci_id,
            profile=placement.profile.name,
        )

    async def unprepare(self, placement_name: str, claim_uid: str, handles: dict[str, Any]) -> None:
        """Destroy the claim's MIG device (compute instance, then GPU instance); gone already is fine.

        `handles` maps GPU UUIDs to NVML handles; a GPU that is gone took its MIG devices with it.
        """
        entry = await anyio.to_thread.run_sync(self.journal.get, claim_uid, placement_name)
        if entry is None:
            return
        handle = handles.get(entry.gpu_uuid)
        if handle is None:
            log.warning(
                "the GPU of a MIG device is gone: forgetting it", extra=log_fields(gpu=entry.gpu_uuid)
            )
            await anyio.to_thread.run_sync(self.journal.remove, entry)
            return
        await self._nvml.run(self._destroy_sync, handle, entry)
        log.info(
            "destroyed MIG device", extra=log_fields(device=placement_name, claim=claim_uid, gi=entry.gi_id)
        )

    def reconcile_sync(self, handles: dict[str, Any]) -> None:
        """At start: destroy the MIG devices the journal says were half-created or being destroyed.

        `handles` maps GPU UUIDs to NVML handles; an entry of a GPU that is gone is dropped.
        """
        for entry in self.journal.entries():
            if entry.step == PREPARED:
                continue  # a prepared claim holds it; the kubelet unprepares it
            handle = handles.get(entry.gpu_uuid)
            if handle is None:
                log.warning(
                    "dropping the journal entry of a GPU that is gone", extra=log_fields(gpu=entry.gpu_uuid)
                )
                self.journal.remove(entry)
                continue
            log.warning(
                "destroying a MIG device left half-created or half-destroyed by a crash",
                extra=log_fields(
                    gpu=entry.gpu_uuid, device=entry.device, claim=entry.claim_uid, step=entry.step
                ),
            )
            self._destroy_sync(handle, entry)

    # -- the NVML steps (worker thread) -------------------------------------------------------

    def _fail(self, what: str, placement: PlacementDevice, error: BaseException) -> DynamicMigError:
        return DynamicMigError(
            f"NVIDIA dynamic MIG: cannot {what} for {placement.profile.name} at placement "
            f"{placement.placement.start} on GPU {placement.gpu_uuid} (gpu-{placement.minor}): {error}: "
            "the placement may be taken by a MIG device created by hand, or the GPU left MIG mode "
            "(check 'nvidia-smi mig -lgi'); nothing was left behind"
        )

    def _create_sync(self, placement: PlacementDevice, claim_uid: str, gpu: GpuInfo) -> MigEntry:
        lib = self._lib
        try:
            preexisting = tuple(sorted(self._gpu_instances(gpu.handle)))
        except Exception as error:
            # nvml.h: NOT_SUPPORTED once the GPU left MIG mode; nothing was created yet.
            if not self._nvml.is_error(error):
                raise
            raise self._fail("list the GPU instances", placement, error) from error
        entry = MigEntry(
            claim_uid=claim_uid,
            device=placement.name,
            gpu_uuid=gpu.uuid,
            profile_id=placement.profile.profile_id,
            start=placement.placement.start,
            size=placement.placement.size,
            step=CREATING_GI,
            preexisting_gis=preexisting,
        )
        self.journal.put(entry)
        where = lib.c_nvmlGpuInstancePlacement_t()
        where.start, where.size = placement.placement.start, placement.placement.size
        try:
            # nvml.h:13016 takes `const nvmlGpuInstancePlacement_t *` and pynvml sets no argtypes:
            # without byref ctypes passes the structure by value and the library reads a wild
            # pointer (the agent dies with SIGSEGV instead of getting an NVML error).
            instance = lib.nvmlDeviceCreateGpuInstanceWithPlacement(
                gpu.handle, placement.profile.profile_id, ctypes.byref(where)
            )
        except Exception as error:
            self.journal.remove(entry)
            raise self._fail("create the GPU instance", placement, error) from error
        try:
            gi_id = int(lib.nvmlGpuInstanceGetInfo(instance).id)
            entry = entry.at(CREATING_CI, gi_id=gi_id)
            self.journal.put(entry)
            ci_profile = lib.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                instance,
                CI_PROFILE_BY_SLICES[placement.profile.slices],
                int(getattr(lib, "NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED", 0)),
            )
            compute = lib.nvmlGpuInstanceCreateComputeInstance(instance, int(ci_profile.id))
        except Exception as error:
            self._rollback_sync(gpu.handle, entry)
            raise self._fail("create the compute instance", placement, error) from error
        try:
            # The compute instance's info carries its MIG device handle (nvml.h:12757-12764), as
            # NVIDIA's driver reads it: walking every MIG slot takes seconds on a loaded GPU.
            info = lib.nvmlComputeInstanceGetInfo(compute)
            mig_uuid = text(lib.nvmlDeviceGetUUID(info.device))
            entry = entry.at(CI_CREATED, ci_id=int(info.id), mig_uuid=mig_uuid)
            self.journal.put(entry)
        except Exception as error:
            self._rollback_sync(gpu.handle, entry)
            raise self._fail("read the new MIG device", placement, error) from error
        return entry

    def _rollback_sync(self, handle: Any, entry: MigEntry) -> None:
        try:
            self._destroy_sync(handle, entry)
        except Exception as error:
            # The journal keeps the entry: the next start-up reconcile tries again.
            log.error(
                "rollback of a MIG device failed: the start-up reconcile retries it",
                extra=log_fields(gpu=entry.gpu_uuid, device=entry.device, gi=entry.gi_id, error=str(error)),
            )

    def _find_created(self, handle: Any, entry: MigEntry) -> tuple[int, Any] | None:
        """Our GPU instance when the journal has no ID yet: at our placement, not there before, no CI."""
        lib = self._lib
        for gi_id, instance in self._gpu_instances(handle).items():
            if gi_id in entry.preexisting_gis:
                continue
            info = lib.nvmlGpuInstanceGetInfo(instance)
            if (
                int(info.profileId) == entry.profile_id
                and int(info.placement.start) == entry.start
                and not self._compute_instances(instance)
            ):
                return gi_id, instance
        return None

    def _compute_instances(self, instance: Any) -> list[Any]:
        found = []
        for ci_id in range(MAX_COMPUTE_INSTANCE_ID):
            compute = self._call_or_none(self._lib.nvmlGpuInstanceGetComputeInstanceById, instance, ci_id)
            if compute is not None:
                found.append(compute)
        return found

    def _destroy_sync(self, handle: Any, entry: MigEntry) -> None:
        """Destroy the entry's compute and GPU instances (those that still exist), then forget it."""
        lib = self._lib
        if entry.step != DESTROYING:
            self.journal.put(entry.at(DESTROYING))
        if entry.gi_id is None:
            found = self._find_created(handle, entry)
            instance = found[1] if found else None
        else:
            instance = self._call_or_none(lib.nvmlDeviceGetGpuInstanceById, handle, entry.gi_id)
        if instance is not None:
            computes = (
                self._compute_instances(instance)
                if entry.ci_id is None
                else [
                    c
                    for c in [
                        self._call_or_none(lib.nvmlGpuInstanceGetComputeInstanceById, instance, entry.ci_id)
                    ]
                    if c
                ]
            )
            for compute in computes:
                self._call_or_none(lib.nvmlComputeInstanceDestroy, compute)
            self._call_or_none(lib.nvmlGpuInstanceDestroy, instance)
        self.journal.remove(entry)

    def _mig_device(self, placement: PlacementDevice, published: NvDevice, entry: MigEntry) -> NvDevice:
        """The created MIG device, as the edits need it (UUID, GPU and compute instance IDs)."""
        mig = MigInfo(
            uuid=entry.mig_uuid,
            handle=None,
            gpu_instance_id=entry.gi_id if entry.gi_id is not None else -1,
            compute_instance_id=entry.ci_id if entry.ci_id is not None else -1,
            profile=placement.profile.name,
            gi_profile_id=placement.profile.profile_id,
            placement_start=placement.placement.start,
            placement_size=placement.placement.size,
        )
        return NvDevice(published.device, published.gpu, mig)


def gpu_handles_sync(nvml: Nvml) -> dict[str, Any]:
    """GPU UUID -> NVML handle of every GPU that answers (blocking)."""
    lib = nvml.lib
    handles: dict[str, Any] = {}
    for index in range(int(lib.nvmlDeviceGetCount())):
        try:
            handle = lib.nvmlDeviceGetHandleByIndex(index)
            handles[text(lib.nvmlDeviceGetUUID(handle))] = handle
        except Exception as error:
            if not nvml.is_error(error):
                raise
    return handles
