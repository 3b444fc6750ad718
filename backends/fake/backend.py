"""The fake backend: devices from a profile, faults injected at run time, plausible container edits.

`FaultInjector` (`backends.fake.faults`), shared by every `FakeBackend` of one `create_backend`
call, hands injected faults to the backend's health monitor; both take the conditions a fake
reports (the real backends' names, severities and kinds) from `backends.fake.conditions`.

Prepare fault injection (backend settings, all optional):

``prepare_fail``
    Device names joined by ``+`` (``gpu-0+gpu-3``) whose prepare fails with `BackendError`, or ``*``
    for all.
``prepare_fail_rate``
    Probability (0 to 1) that any prepare fails; drawn from a generator seeded by ``seed``.
``prepare_latency``
    Seconds every prepare takes (slept on the backend's clock).
``seed``
    Seed of the failure draws and telemetry noise (default 0), so runs repeat.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import math
import random
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from agent.core.backend import (
    DEFAULT_HEALTH_INTERVAL,
    ClaimRef,
    ContainerEdits,
    DeviceTelemetry,
    HealthEvent,
    HealthSink,
    Mount,
    PreparedStatus,
    PreparePlan,
    UnpreparePlan,
    report_alive,
    report_pass,
)
from agent.core.clock import Clock, SystemClock
from agent.core.errors import BackendError, DeviceNotFoundError
from agent.core.logs import log_fields
from agent.core.model import Device
from agent.core.sharing import ConsumableShares, DeviceShare, merge_edits
from backends.amd.sharingconfig import check_shares
from backends.fake import devicefile
from backends.fake.conditions import CONDITIONS, ActiveFault, FaultError

if TYPE_CHECKING:
    from backends.fake.dynamicmig import FakeDynamicMig
    from backends.fake.faults import FaultInjector
    from backends.nvidia.sharing import DeviceFacts, NvSharingManager

log = logging.getLogger("agent.fake")

MAX_QUEUED_EVENTS = 100_000
ALIVE_INTERVAL_SECONDS = 5.0  # how often an idle monitor says it still runs


@dataclass(frozen=True)
class PrepareFaults:
    """Injected prepare failures and latency (see the module docstring)."""

    fail_devices: frozenset[str] = frozenset()
    fail_all: bool = False
    fail_rate: float = 0.0
    latency: float = 0.0
    seed: int = 0


class FakeBackend:
    """A `Backend` serving one driver's devices from a profile."""

    health_conditions = tuple(CONDITIONS)  # injected others get their series at their first event
    health_checks = ("answers",)
    """Its health pass (`PollsHealth`): every `health_interval`, it has looked at every device
    (a lost one's ``gpu-lost`` stays as injected), so held conditions behave as with hardware."""

    def __init__(
        self,
        driver_name: str,
        devices: Sequence[Device],
        injector: FaultInjector,
        *,
        vendor: str = "generic",
        prepare_faults: PrepareFaults | None = None,
        clock: Clock | None = None,
        device_files: Path | None = None,
        shares: ConsumableShares | None = None,
        sharing_root: Path | None = None,
        partitions: FakeDynamicMig | None = None,
        health_interval: float = DEFAULT_HEALTH_INTERVAL,
    ) -> None:
        self._driver = driver_name
        self._health_interval = health_interval
        self._partitions = partitions
        self._shares = shares or ConsumableShares()
        self._sharing_root = sharing_root if vendor == "nvidia" else None
        self.sharing: NvSharingManager | None = None
        """NVIDIA profiles: time-slicing and MPS through the fakes of `backends.fake.sharing`, set
        up by `_nv_sharing` at the first share (or the resume at start)."""
        self._device_files = device_files
        self._devices = {d.name: d for d in devices}
        self._descriptions: dict[str, dict[str, Any]] = {}
        self._vendor = vendor
        self._faults = prepare_faults or PrepareFaults()
        self._random = random.Random(self._faults.seed)
        self._clock = clock or SystemClock()
        self._injector = injector
        self.lost: set[str] = set()
        self.active: dict[tuple[str, str, str], ActiveFault] = {}
        self.prepared: dict[tuple[str, str], ContainerEdits] = {}
        self._queue: deque[HealthEvent] = deque()
        self._wake: anyio.Event | None = None
        self._dropped = 0
        self._last_xid: dict[str, int] = {}
        self._ecc: dict[str, int] = {}
        self._lost_at_first_pass: set[str] = set()
        injector.add(self)

    @property
    def driver_name(self) -> str:
        return self._driver

    @property
    def vendor(self) -> str:
        return self._vendor

    @property
    def injector(self) -> FaultInjector:
        """The fault injector shared with the other backends of the same `create_backend` call."""
        return self._injector

    def has(self, device: str) -> bool:
        """Whether the profile has `device` (lost or not)."""
        return device in self._devices

    def all_devices(self) -> dict[str, Device]:
        """Every device of the profile, lost or not."""
        return dict(self._devices)

    async def start(self) -> None:
        log.info("fake backend started", extra=log_fields(driver=self._driver, devices=len(self._devices)))

    async def stop(self) -> None:
        self._injector.remove_stale_socket()

    async def discover(self) -> Sequence[Device]:
        # A lost device falls off the bus: it is not discovered until recovered.
        return [self._shares.apply(d) for name, d in self._devices.items() if name not in self.lost]

    async def monitor_health(self, sink: HealthSink) -> None:
        """Forward injected faults to `sink`; also serves the control socket (one per injector)."""
        failure: Exception | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._serve_control)
            try:
                await self._forward(sink)
            except Exception as error:  # re-raised below, unwrapped, for the supervisor's log
                failure = error
            tg.cancel_scope.cancel()
        if failure is not None:
            raise failure

    async def _forward(self, sink: HealthSink) -> None:
        # The first pass one interval after start, as a hardware pass over many GPUs takes time:
        # what was held before a restart stays at least that long.
        next_pass = self._clock.monotonic() + self._health_interval
        while True:
            while self._queue:
                event = self._queue[0]
                await sink(event)
                self._queue.popleft()  # only once delivered: a failed sink sees it again on restart
            report_alive(sink)
            if self._clock.monotonic() >= next_pass:
                for name in sorted(self._lost_at_first_pass):
                    self._injector.lose_now(name, driver=self._driver)
                self._lost_at_first_pass.clear()
                while self._queue:  # the pass's findings before the pass itself
                    await sink(self._queue.popleft())
                report_pass(sink, sorted(self._devices))
                next_pass = self._clock.monotonic() + self._health_interval
            self._wake = anyio.Event()
            wait = min(ALIVE_INTERVAL_SECONDS, max(0.0, next_pass - self._clock.monotonic()))
            with anyio.move_on_after(wait):
                await self._wake.wait()

    async def _serve_control(self) -> None:
        try:
            await self._injector.serve_control()
        except Exception as error:
            # Health monitoring goes on without the control socket.
            log.error(
                "fake control socket failed; fault injection at run time is off",
                extra=log_fields(driver=self._driver, error=str(error)),
            )

    def lose_at_first_pass(self, device: str) -> None:
        """`device`'s GPU is lost from the start; the first health pass finds it (no event)."""
        if device not in self._devices:
            raise FaultError(f"unknown device {device!r} of driver {self._driver}")
        self._lost_at_first_pass.add(device)

    def emit(self, event: HealthEvent) -> None:
        """Queue `event` for the health monitor (never blocks; drops the oldest when far behind)."""
        if len(self._queue) >= MAX_QUEUED_EVENTS:
            self._queue.popleft()
            self._dropped += 1
            if self._dropped == 1:
                log.warning(
                    "fake health queue full; dropping the oldest events (is the health monitor running?)",
                    extra=log_fields(driver=self._driver, limit=MAX_QUEUED_EVENTS),
                )
        self._queue.append(event)
        if event.condition == "xid" and event.value.isdigit() and not event.cleared:
            self._last_xid[event.device] = int(event.value)
        if event.condition == "ecc-uncorrectable" and not event.cleared:
            self._ecc[event.device] = self._ecc.get(event.device, 0) + 1
        if self._wake is not None:
            self._wake.set()

    def _facts(self, name: str) -> DeviceFacts:
        from backends.nvidia.sharing import facts_of  # imported with the sharing manager that calls this

        found = self._devices.get(name)
        if found is None:
            raise DeviceNotFoundError(self._driver, name)
        return facts_of(found.attributes, found.uuid or found.name)

    def group_of(self, device: str) -> list[str]:
        """`device` and every device sharing its physical GPU (MIG devices, partitions)."""
        parent = self._devices[device].parent or device
        return sorted(n for n, d in self._devices.items() if (d.parent or n) == parent)

    async def prepare(self, device: str, claim: ClaimRef) -> ContainerEdits:
        found = self._devices.get(device)
        if found is None or device in self.lost:
            raise DeviceNotFoundError(self._driver, device)
        key = (claim.uid, device)
        if key in self.prepared:
            return self.prepared[key]
        if self._faults.latency > 0:
            await self._clock.sleep(self._faults.latency)
        self._check_injected_failure(device)
        if self._partitions is not None and device in self._partitions.placements:
            self._partitions.create(device, claim.uid)
        work = self._prepare_work(found, claim)
        if self._device_files is None:
            return work()  # nothing blocking to do
        return await anyio.to_thread.run_sync(work)

    async def prepared_status(self, device: str, claim: ClaimRef) -> PreparedStatus:
        """As the vendor backends say it (`DescribesPrepared`): MIG devices, partitions."""
        from backends.fake.preparedstatus import created_mig_status, device_status  # NVIDIA/AMD tables

        found = self._devices.get(device)
        if found is None:
            raise DeviceNotFoundError(self._driver, device)
        if self._partitions is not None and device in self._partitions.placements:
            return created_mig_status(self._partitions.placements[device], claim.uid)
        return device_status(found)

    def plan_prepare(self, device: str, claim: ClaimRef) -> PreparePlan | None:
        """`prepare` as a check and the device file's write (`PlansPrepare`); None with latency or MIG."""
        found = self._devices.get(device)
        if found is None or device in self.lost:
            raise DeviceNotFoundError(self._driver, device)
        key = (claim.uid, device)
        done = self.prepared.get(key)
        if done is not None:
            return lambda: done
        if self._faults.latency > 0 or (
            self._partitions is not None and device in self._partitions.placements
        ):
            return None
        self._check_injected_failure(device)
        return self._prepare_work(found, claim)

    def _prepare_work(self, found: Device, claim: ClaimRef) -> PreparePlan:
        """The rest of a prepare once checked: the device file written (blocking), the edits recorded."""
        mounts: tuple[Mount, ...] = ()
        write: Callable[[], None] | None = None
        if self._device_files is not None:
            path = devicefile.host_path(self._device_files, claim, found.name)
            mounts = (Mount(str(path), devicefile.container_path(self._driver, found.name)),)
            document = devicefile.describe(self._description(found), claim)
            write = functools.partial(self._write_device_file, path, document)
        edits = self._edits(found, mounts)

        def prepare() -> ContainerEdits:
            # Recorded once done: a plan that never runs (the core fell back to `prepare` for
            # another device, or refused the claim) leaves nothing behind.
            if write is not None:
                write()
            self.prepared[(claim.uid, found.name)] = edits
            return edits

        return prepare

    def plan_unprepare(self, device: str, claim: ClaimRef) -> UnpreparePlan | None:
        """`unprepare` as the device file's removal (`PlansPrepare`); None with dynamic MIG."""
        if self._partitions is not None:
            return None
        root = self._device_files

        def unprepare() -> None:
            if root is not None:
                self._remove_device_file(root, claim, device)
            self.prepared.pop((claim.uid, device), None)

        return unprepare

    def _description(self, device: Device) -> dict[str, Any]:
        """`devicefile.describe_device`, once per device (the profile's devices never change)."""
        found = self._descriptions.get(device.name)
        if found is None:
            found = self._descriptions[device.name] = devicefile.describe_device(device, self._vendor)
        return found

    def _check_injected_failure(self, device: str) -> None:
        if (
            self._faults.fail_all
            or device in self._faults.fail_devices
            or (self._faults.fail_rate > 0 and self._random.random() < self._faults.fail_rate)
        ):
            raise BackendError(
                f"fake backend {self._driver}: injected prepare failure for device {device!r} "
                "(backend settings prepare_fail / prepare_fail_rate)"
            )

    def _write_device_file(self, path: Path, document: dict[str, Any]) -> None:
        try:
            devicefile.write_device_file(path, document)
        except OSError as error:
            raise BackendError(
                f"fake backend {self._driver}: cannot write the device file {path}: {error}: "
                "check the agent's state directory, or set the fake backend's device_files "
                "to a writable host directory (or off)"
            ) from error

    def _remove_device_file(self, root: Path, claim: ClaimRef, device: str) -> None:
        try:
            devicefile.remove_device_file(root, claim, device)
        except OSError as error:
            raise BackendError(
                f"fake backend {self._driver}: cannot remove the device file "
                f"{devicefile.host_path(root, claim, device)}: {error}: check the agent's state directory"
            ) from error

    async def unprepare(self, device: str, claim: ClaimRef) -> None:
        if self._partitions is not None:
            self._partitions.destroy(device, claim.uid)
        self.prepared.pop((claim.uid, device), None)
        if self._device_files is not None:
            await anyio.to_thread.run_sync(self._remove_device_file, self._device_files, claim, device)

    async def _nv_sharing(self) -> NvSharingManager | None:
        """The NVIDIA sharing manager (None for other vendors), set up at its first use."""
        if self.sharing is None and self._sharing_root is not None:
            # Imported in a worker thread once the kubelet sockets serve: ~17 ms at start otherwise.
            for name in ("backends.nvidia.sharing", "backends.fake.sharing"):
                await anyio.to_thread.run_sync(importlib.import_module, name)
            from backends.fake.sharing import FakeGpuPolicy, FakeMpsProgram
            from backends.nvidia.mps import MpsDaemons, NoMounter
            from backends.nvidia.sharing import NvSharingManager

            if self.sharing is None:  # not set up meanwhile by a concurrent first share
                root = self._sharing_root
                daemons = MpsDaemons(root / "mps", FakeMpsProgram(), NoMounter())
                self.sharing = NvSharingManager(self._facts, FakeGpuPolicy(root), daemons)
        return self.sharing

    async def prepare_share(self, share: DeviceShare, peers: Sequence[DeviceShare]) -> ContainerEdits:
        """`prepare` with the vendor's sharing: NVIDIA format and fake time-slicing/MPS, or AMD's format."""
        sharing = await self._nv_sharing()
        if sharing is None:
            check_shares(share, peers)
            return await self.prepare(share.device, share.claim)
        if share.device not in self._devices or share.device in self.lost:
            raise DeviceNotFoundError(self._driver, share.device)
        extra = await sharing.prepare(share, peers)
        try:
            return merge_edits(await self.prepare(share.device, share.claim), extra)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await sharing.unprepare(share, peers)
            raise

    async def unprepare_share(self, share: DeviceShare, peers: Sequence[DeviceShare]) -> None:
        sharing = await self._nv_sharing()
        if sharing is not None:
            await sharing.unprepare(share, peers)
        await self.unprepare(share.device, share.claim)

    async def resume_shares(self, shares: Sequence[DeviceShare]) -> None:
        sharing = await self._nv_sharing()
        if sharing is not None:
            await sharing.resume(shares)

    def _edits(self, device: Device, mounts: tuple[Mount, ...]) -> ContainerEdits:
        """Environment and the description file: no device nodes (see `backends.fake.devicefile`).

        The environment has a variable of its own per device, never a list: lists of two claims in
        one container would hide each other (CDI keeps a variable's last value).
        """
        env = devicefile.device_env(self._driver, device, self._vendor)
        return ContainerEdits(env=env, mounts=mounts)

    async def telemetry(self) -> Sequence[DeviceTelemetry]:
        """Synthetic counters: a slow wave per device (phase from its name), deterministic per time."""
        now = self._clock.time()
        out = []
        for name, device in sorted(self._devices.items()):
            if name in self.lost:
                continue
            phase = zlib.crc32(name.encode()) % 1000 / 1000 * 2 * math.pi
            util = round(0.5 + 0.45 * math.sin(now / 60 + phase), 3)
            memory = device.capacity.get("memory")
            total = int(memory.value) if memory is not None else None
            out.append(
                DeviceTelemetry(
                    device=name,
                    utilization_ratio=util,
                    memory_used_bytes=int(total * util * 0.9) if total is not None else None,
                    memory_total_bytes=total,
                    temperature_celsius=round(35 + 45 * util, 1),
                    power_watts=round(90 + 310 * util, 1),
                    ecc_corrected_total=0,
                    ecc_uncorrected_total=self._ecc.get(name, 0),
                    last_error_code=self._last_xid.get(name, 0),
                    read_at=now,
                )
            )
        return out


def with_driver(devices: Sequence[Device], driver: str) -> list[Device]:
    """`devices` under another driver name (validated again)."""
    return [dataclasses.replace(d, driver=driver) for d in devices]
