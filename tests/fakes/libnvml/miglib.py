"""The stand-in libnvidia-ml's GPU-instance and compute-instance calls (dynamic MIG).

`MigLibNvml` adds nvml.h's placement, create and destroy functions (nvml.h:12942-13356) to
`LibNvml`. Profiles and placements come from `backends.fake.migtables` (NVIDIA's MIG user guide
tables). ``nvmlDeviceCreateGpuInstanceWithPlacement`` reads ``*placement`` as the real library
must (nvml.h:13016 ``const nvmlGpuInstancePlacement_t *placement``): a placement passed by value
arrives as a bad pointer and reading it kills the process, as on a node.

`mig_hook(phase, call)` runs "before" and "after" each create/destroy (the crash tests kill the
process there and persist `FakeGpu.migs` as the driver would keep them). With `proc_root` and
`dev_root`, creating an instance also makes its MIG capability file
(``driver/nvidia/capabilities/gpu<N>/mig/gi<G>[/ci<C>]/access``) and device node
(``nvidia-caps/nvidia-cap<minor>``), as ``nvidia-modprobe`` would on a host that runs it; with
``make_nodes=False`` only the file, as the driver alone does. Destroying removes the file.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from ctypes import POINTER, c_uint
from pathlib import Path
from typing import Any

from tests.fakes.libnvml.cabi import (
    CI_PROFILE_INFO_V2,
    ERROR_ARGUMENT_VERSION_MISMATCH,
    ERROR_IN_USE,
    ERROR_INSUFFICIENT_RESOURCES,
    ERROR_INSUFFICIENT_SIZE,
    ERROR_INVALID_ARGUMENT,
    ERROR_NOT_FOUND,
    ERROR_NOT_SUPPORTED,
    HANDLE,
    OUT_HANDLE,
    U32,
    CiInfo,
    CiProfileInfoV2,
    NvmlReturn,
    Placement,
    c_function,
    store,
)
from tests.fakes.libnvml.core import FakeInstance, symbol
from tests.fakes.libnvml.devices import NO_CI, FakeGpu, FakeMig
from tests.fakes.libnvml.library import LibNvml

# NVML_COMPUTE_INSTANCE_PROFILE_* index -> compute slices (nvml.h).
CI_PROFILE_SLICES = {0: 1, 1: 2, 2: 3, 3: 4, 4: 7, 5: 8, 6: 6}
CI_PROFILE_SLICES_INDEX = {slices: index for index, slices in CI_PROFILE_SLICES.items()}


class MigLibNvml(LibNvml):
    """`LibNvml` plus GPU-instance profiles, placements, creation and destruction."""

    def __init__(
        self,
        gpus: Sequence[FakeGpu] = (),
        *,
        proc_root: Path | None = None,
        dev_root: Path | None = None,
        make_nodes: bool = True,
        **kwargs: Any,
    ) -> None:
        self.proc_root, self.dev_root = proc_root, dev_root
        self.make_nodes = make_nodes
        self.mig_hook: Callable[[str, str], None] | None = None
        self.once: dict[str, int] = {}
        """C symbol -> error code it returns at its next call only (a transient failure)."""
        self._next_uuid = 0
        super().__init__(gpus, **kwargs)

    def fail_once(self, function: str, code: int) -> None:
        self.once[symbol(function)] = code

    def c_call(self, name: str, method: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        self._hook("before", name)
        code = self.once.pop(name, None)
        if code is not None:
            with self._lock:
                self.calls.append(name)
            raise NvmlReturn(code)
        result = super().c_call(name, method, args)
        self._hook("after", name)
        return result

    def _hook(self, phase: str, call: str) -> None:
        if self.mig_hook is not None and call in HOOKED:
            self.mig_hook(phase, call)

    def _capability(self, gpu: FakeGpu, gi: int, ci: int | None, create: bool) -> None:
        if self.proc_root is None or self.dev_root is None:
            return
        base = self.proc_root / "driver" / "nvidia" / "capabilities" / f"gpu{gpu.minor}" / "mig" / f"gi{gi}"
        path = base / "access" if ci is None else base / f"ci{ci}" / "access"
        minor = 1000 + gpu.minor * 200 + gi * 8 + (0 if ci is None else 1 + ci)
        if create:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"DeviceFileMinor: {minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n")
            if not self.make_nodes:
                return
            node = self.dev_root / "nvidia-caps" / f"nvidia-cap{minor}"
            node.parent.mkdir(parents=True, exist_ok=True)
            node.touch()
        else:
            path.unlink(missing_ok=True)

    def _layout(self, gpu: FakeGpu) -> Any:
        from backends.fake import migtables

        self.gi_api(gpu)
        layout = migtables.layout_for(gpu.name)
        if layout is None:
            raise NvmlReturn(ERROR_NOT_SUPPORTED)
        return layout

    @c_function("nvmlDeviceGetGpuInstancePossiblePlacements_v2", HANDLE, c_uint, POINTER(Placement), U32)
    def placements(self, handle: int, profile_id: int, placements: Any, count: Any) -> None:
        # nvml.h:12915-12942: with placements NULL, *count is set to the number; INSUFFICIENT_SIZE
        # if *count is too small; NOT_SUPPORTED without MIG mode; INVALID_ARGUMENT for a bad profile.
        gpu = self.device("nvmlDeviceGetGpuInstancePossiblePlacements_v2", handle).gpu
        try:
            found = self._layout(gpu).profile(profile_id).placements
        except LookupError:
            raise NvmlReturn(ERROR_INVALID_ARGUMENT) from None
        if not count:
            raise NvmlReturn(ERROR_INVALID_ARGUMENT)
        if placements:
            if count[0] < len(found):
                raise NvmlReturn(ERROR_INSUFFICIENT_SIZE)
            for i, p in enumerate(found):
                placements[i] = Placement(p.start, p.size)
        count[0] = len(found)

    @c_function("nvmlDeviceCreateGpuInstanceWithPlacement", HANDLE, c_uint, POINTER(Placement), OUT_HANDLE)
    def create_gi(self, handle: int, profile_id: int, placement: Any, instance: Any) -> None:
        from backends.nvidia.migprofiles import Placement as Where
        from backends.nvidia.migprofiles import fits, taken_counters

        gpu = self.device("nvmlDeviceCreateGpuInstanceWithPlacement", handle).gpu
        layout = self._layout(gpu)
        try:
            profile = layout.profile(profile_id)
        except LookupError:
            raise NvmlReturn(ERROR_INVALID_ARGUMENT) from None
        if not placement or not instance:
            raise NvmlReturn(ERROR_INVALID_ARGUMENT)
        # The real library reads the structure behind the pointer: so does this one (a structure
        # passed by value is a wild pointer here, and the process dies as it would on a node).
        where = Where(int(placement.contents.start), int(placement.contents.size))
        if where not in profile.placements:
            raise NvmlReturn(ERROR_INVALID_ARGUMENT)
        held = [(layout.profile(m.profile_id), Where(m.start, m.size)) for m in gpu.migs]
        if not fits(layout, taken_counters(layout, held), profile, where):
            raise NvmlReturn(ERROR_INSUFFICIENT_RESOURCES)
        used = {m.gi_id for m in gpu.migs}
        gi_id = next(i for i in range(1, 64) if i not in used)
        mig = FakeMig("", gi_id, NO_CI, profile_id, where.start, where.size)
        gpu.migs.append(mig)
        self._capability(gpu, gi_id, None, create=True)
        store(instance, self.token(FakeInstance(gpu, mig), "gi", mig))

    @c_function(
        "nvmlGpuInstanceGetComputeInstanceProfileInfoV", HANDLE, c_uint, c_uint, POINTER(CiProfileInfoV2)
    )
    def ci_profile(self, handle: int, profile: int, eng_profile: int, info: Any) -> None:
        found = self.instance("nvmlGpuInstanceGetComputeInstanceProfileInfoV", handle)
        if not info:
            raise NvmlReturn(ERROR_INVALID_ARGUMENT)
        if info.contents.version != CI_PROFILE_INFO_V2:  # nvml.h:13140-13159
            raise NvmlReturn(ERROR_ARGUMENT_VERSION_MISMATCH)
        slices = CI_PROFILE_SLICES.get(profile)
        gi_profile = self.profile(found.gpu, found.mig.profile_id)
        if slices is None or slices > gi_profile.slices or eng_profile != 0:
            raise NvmlReturn(ERROR_NOT_SUPPORTED)
        out = info.contents
        out.id, out.sliceCount, out.instanceCount = profile, slices, gi_profile.slices // slices
        out.multiprocessorCount = gi_profile.sms * slices // gi_profile.slices
        out.name = f"MIG {slices}c".encode()

    @c_function("nvmlGpuInstanceCreateComputeInstance", HANDLE, c_uint, OUT_HANDLE)
    def create_ci(self, handle: int, profile_id: int, compute: Any) -> None:
        found = self.instance("nvmlGpuInstanceCreateComputeInstance", handle)
        gpu, mig = found.gpu, found.mig
        if mig.ci_id != NO_CI:
            raise NvmlReturn(ERROR_INSUFFICIENT_RESOURCES)
        if CI_PROFILE_SLICES.get(profile_id) != self.profile(gpu, mig.profile_id).slices:
            raise NvmlReturn(ERROR_NOT_SUPPORTED)  # only full-size compute instances here
        self._next_uuid += 1
        mig.ci_id = 0
        mig.uuid = f"MIG-{gpu.minor:04d}{mig.gi_id:04d}-{self._next_uuid:04d}-0000-0000-000000000000"
        self._capability(gpu, mig.gi_id, 0, create=True)
        store(compute, self.token(FakeInstance(gpu, mig), "ci", mig))

    def _compute(self, name: str, handle: int | None) -> FakeInstance:
        found = self.instance(name, handle)
        if found.mig.ci_id == NO_CI:
            raise NvmlReturn(ERROR_INVALID_ARGUMENT)  # destroyed: the handle is no longer valid
        return found

    @c_function("nvmlGpuInstanceGetComputeInstanceById", HANDLE, c_uint, OUT_HANDLE)
    def ci_by_id(self, handle: int, ci_id: int, compute: Any) -> None:
        found = self.instance("nvmlGpuInstanceGetComputeInstanceById", handle)
        if found.mig.ci_id == NO_CI or found.mig.ci_id != ci_id:
            raise NvmlReturn(ERROR_NOT_FOUND)
        store(compute, self.token(FakeInstance(found.gpu, found.mig), "ci", found.mig))

    @c_function("nvmlComputeInstanceGetInfo_v2", HANDLE, POINTER(CiInfo))
    def ci_info(self, handle: int, info: Any) -> None:
        # nvml.h:12757-12764, 13356: the info carries the MIG device's handle (`device`).
        found = self._compute("nvmlComputeInstanceGetInfo_v2", handle)
        gpu, mig = found.gpu, found.mig
        result = CiInfo(
            device=self.mig_token(gpu, mig),
            gpuInstance=self.token(FakeInstance(gpu, mig), "gi", mig),
            id=mig.ci_id,
            profileId=CI_PROFILE_SLICES_INDEX[self.profile(gpu, mig.profile_id).slices],
        )
        store(info, result)

    @c_function("nvmlComputeInstanceDestroy", HANDLE)
    def destroy_ci(self, handle: int) -> None:
        found = self._compute("nvmlComputeInstanceDestroy", handle)
        self.gi_api(found.gpu)
        self._capability(found.gpu, found.mig.gi_id, found.mig.ci_id, create=False)
        found.mig.ci_id, found.mig.uuid = NO_CI, ""

    @c_function("nvmlGpuInstanceDestroy", HANDLE)
    def destroy_gi(self, handle: int) -> None:
        # nvml.h:13020-13038: IN_USE "if the GPU instance has any compute instance".
        found = self.instance("nvmlGpuInstanceDestroy", handle)
        self.gi_api(found.gpu)
        if found.mig.ci_id != NO_CI:
            raise NvmlReturn(ERROR_IN_USE)
        found.gpu.migs[:] = [m for m in found.gpu.migs if m is not found.mig]
        self._capability(found.gpu, found.mig.gi_id, None, create=False)


HOOKED = frozenset(
    {
        "nvmlDeviceCreateGpuInstanceWithPlacement",
        "nvmlGpuInstanceCreateComputeInstance",
        "nvmlComputeInstanceDestroy",
        "nvmlGpuInstanceDestroy",
    }
)
"""The C functions `mig_hook` sees: those that change the MIG layout."""
