"""The AMD backend: amdsmi discovery, health, CDI container edits and telemetry for one driver name."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import anyio

from agent.core.backend import (
    BackendOptions,
    ClaimRef,
    ContainerEdits,
    DeviceTelemetry,
    HealthSink,
    PreparedStatus,
    PreparePlan,
    UnpreparePlan,
    nothing_to_undo,
)
from agent.core.clock import Clock, SystemClock
from agent.core.errors import BackendError, ConfigError, DeviceNotFoundError
from agent.core.logs import log_fields
from agent.core.model import Device
from agent.core.sharing import ConsumableShares, DeviceShare
from agent.core.vendorcall import DEFAULT_CALL_TIMEOUT, STOP_TIMEOUT
from backends.amd.binding import check_module, check_pair, import_amdsmi
from backends.amd.checks import CHECKS
from backends.amd.discovery import (
    DEFAULT_DRIVER_NAME,
    DeviceEntry,
    Discovery,
    ProcessorScan,
    Sysfs,
    build_devices,
    scan_processors,
)
from backends.amd.eccstate import ECC_STATE_FILE, boot_id, load_ecc_counts, save_ecc_counts
from backends.amd.edits import StatFn, container_edits, read_edits
from backends.amd.health import CONDITIONS, TRENDS, EccCounts, HealthMemory, HealthMonitor, HealthSettings
from backends.amd.partitionstatus import partition_status
from backends.amd.sharingconfig import check_shares
from backends.amd.smi import SmiLibrary, describe, handle_key, init_error
from backends.amd.telemetry import read_telemetry

log = logging.getLogger("agent.backends.amd")

SETTINGS = {
    "driver": "the DRA driver name (default gpu.amd.com)",
    "poll-interval": "seconds between health passes (default: the agent's --health-interval, 5)",
    "cper-max-age": "seconds after which a fatal CPER record no longer counts (default 3600)",
    "ecc-correctable-rate": "correctable ECC errors per minute above which the trend is raised (default 1)",
    "pcie-replay-rate": "PCIe replays per minute above which the trend is raised (default 8)",
    "trend-window": "seconds over which the correctable-ECC and PCIe-replay rates are measured (default 60)",
    "event-timeout-ms": "milliseconds one event read waits; bounds shutdown delay (default 200)",
    "sysfs-root": "where the host's /sys is visible (default /sys)",
    "dev-root": "where the host's /dev is visible (default /dev)",
    ConsumableShares.SETTING: "disabled (default), memory, unlimited or <N>: publish devices shareable",
}


def _positive(settings: dict[str, str], key: str, default: float) -> float:
    raw = settings.get(key)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(f"--backend amd:{key}", raw, "a positive number")
    return value


def settings_from(options: BackendOptions) -> tuple[HealthSettings, str, str]:
    """Parse the backend settings; raise `ConfigError` for unknown keys or bad values."""
    settings = dict(options.settings)
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise ConfigError("--backend amd", ",".join(unknown), "settings among " + ", ".join(sorted(SETTINGS)))
    defaults = HealthSettings()
    health = HealthSettings(
        # The agent's --health-interval, unless this backend's own setting overrides it.
        poll_interval=_positive(settings, "poll-interval", options.health_interval),
        event_timeout_ms=int(_positive(settings, "event-timeout-ms", defaults.event_timeout_ms)),
        cper_max_age=_positive(settings, "cper-max-age", defaults.cper_max_age),
        trend_window=_positive(settings, "trend-window", defaults.trend_window),
        ecc_correctable_rate=_positive(settings, "ecc-correctable-rate", defaults.ecc_correctable_rate),
        pcie_replay_rate=_positive(settings, "pcie-replay-rate", defaults.pcie_replay_rate),
    )
    return health, settings.get("sysfs-root", "/sys"), settings.get("dev-root", "/dev")


class AmdBackend:
    """Serves one DRA driver name (``gpu.amd.com`` by default) from what amdsmi sees."""

    health_conditions: Sequence[str] = CONDITIONS
    health_checks: Sequence[str] = CHECKS
    """The health pass's checks (`agent.core.backend.PollsHealth`)."""
    trend_conditions: Sequence[str] = TRENDS
    """The informational trends among the conditions (`agent.core.backend.ReportsTrends`)."""

    def __init__(
        self,
        options: BackendOptions,
        *,
        clock: Clock | None = None,
        importer: Callable[[], Any] = import_amdsmi,
        stat_fn: StatFn = os.stat,
        call_timeout: float = DEFAULT_CALL_TIMEOUT,
    ) -> None:
        self._driver = options.driver_name or DEFAULT_DRIVER_NAME
        self._health_settings, sysfs_root, self._dev_root = settings_from(options)
        self._sysfs = Sysfs(sysfs_root)
        self._clock = clock or SystemClock()
        self._importer = importer
        self._stat = stat_fn
        self._shares = ConsumableShares.parse(
            dict(options.settings).get(ConsumableShares.SETTING, "disabled"),
            f"--backend amd setting {ConsumableShares.SETTING}",
        )
        self._lib: SmiLibrary | None = None
        self._discovery = Discovery()
        self._discovered = False
        self._warned: set[str] = set()
        self._logged_empty = False
        self._devices_changed: anyio.Event | None = None
        self._call_timeout = call_timeout
        # What one monitor learned that the next (after a rediscovery, or a restart of the agent
        # in the same boot for the ECC counts) must know to clear or raise it.
        self._memory = HealthMemory()
        self._ecc_path = options.state_dir / self._driver / ECC_STATE_FILE if options.state_dir else None
        self._boot = ""

    @property
    def driver_name(self) -> str:
        return self._driver

    def _library(self) -> SmiLibrary:
        if self._lib is None:
            raise BackendError("amd backend: not started; call start() first")
        return self._lib

    async def start(self) -> None:
        """Load amdsmi and initialize it for AMD GPUs; raise `BackendError` with a fix when it cannot."""
        if self._lib is not None:
            return
        module = self._importer()
        check_module(module)
        lib = SmiLibrary(module, self._call_timeout)

        def init(smi: Any) -> str:
            version = check_pair(smi)
            try:
                smi.amdsmi_init(smi.AmdSmiInitFlags.INIT_AMD_GPUS)
            except smi.AmdSmiException as error:
                raise init_error(error) from error
            return version

        version = await lib.run(init, "amdsmi_init")
        self._lib = lib
        if self._ecc_path is not None:
            self._boot = await anyio.to_thread.run_sync(boot_id)
            counts = await anyio.to_thread.run_sync(load_ecc_counts, self._ecc_path, self._boot)
            self._memory = HealthMemory.with_ecc_counts(counts)
        log.info(
            "amdsmi initialized",
            extra=log_fields(
                driver=self._driver, library=version, binding=getattr(module, "__version__", "")
            ),
        )

    async def stop(self) -> None:
        """Shut amdsmi down (bounded, on no lane a hung call may hold); never raises."""
        lib, self._lib = self._lib, None
        if lib is None:
            return

        def shut_down(smi: Any) -> None:
            try:
                smi.amdsmi_shut_down()
            except Exception as error:
                log.debug("amdsmi_shut_down failed", extra=log_fields(error=describe(error)))

        with anyio.CancelScope(shield=True):
            try:
                await lib.run_unlimited(shut_down, STOP_TIMEOUT, "amdsmi_shut_down")
            except Exception as error:  # never raise from stop
                log.warning("amdsmi shutdown did not finish", extra=log_fields(error=str(error)))

    async def discover(self) -> Sequence[Device]:
        """Read GPUs and partitions now.

        amdsmi lists the processors it found at ``amdsmi_init`` until it is shut down: every
        rediscovery re-initialises it (no other amdsmi call runs meanwhile), so a partition mode
        change or a GPU back from loss appears without a restart. The handles change with it: the
        health monitor restarts on the new ones, its held conditions kept (`HealthMemory`).
        """
        lib = self._library()
        sysfs = self._sysfs
        again = self._discovered

        def read(smi: Any) -> ProcessorScan:
            try:
                if again:
                    # NOT_INIT when the last re-init failed (the driver was away): init again anyway.
                    with contextlib.suppress(smi.AmdSmiException):
                        smi.amdsmi_shut_down()
                    smi.amdsmi_init(smi.AmdSmiInitFlags.INIT_AMD_GPUS)
                return scan_processors(smi, sysfs)
            except smi.AmdSmiException as error:
                raise BackendError(
                    f"amd backend: listing GPUs failed: {describe(error)}; check 'amd-smi list' on the node"
                ) from error

        if again:
            scan = await lib.reinit(read, "reinit_and_read_processors")
        else:
            scan = await lib.run(read, "read_processors")
        previous = self._discovery
        if scan.listing_lost and not previous.entries:
            raise BackendError(
                f"amd backend: listing GPUs failed: {scan.listing_lost}; check 'amd-smi list' on the node"
            )
        self._discovery = self._keep_lost(previous, scan)
        self._discovered = True
        # After a re-initialisation every handle the monitor holds is stale: it restarts on the new.
        if self._devices_changed is not None and again:
            self._devices_changed.set()
        if not self._discovery.devices and not self._logged_empty:
            self._logged_empty = True
            log.warning(
                "amdsmi sees no AMD GPUs; publishing none (is the amdgpu driver loaded?)",
                extra=log_fields(driver=self._driver),
            )
        elif self._discovery.devices:
            self._logged_empty = False
        return [self._shares.apply(d) for d in self._discovery.devices]

    def _keep_lost(self, previous: Discovery, scan: ProcessorScan) -> Discovery:
        """The devices `scan` found, plus the previous devices of GPUs that answered with a lost
        status, as published (name and attributes) but on the handle amdsmi gives them now: they
        stay published, and the next health pass reports them ``gpu-lost``."""
        found = build_devices(scan.infos, self._driver, self._warned)
        if scan.listing_lost:
            log.error(
                "listing GPUs met a lost status; keeping the devices published",
                extra=log_fields(driver=self._driver, error=scan.listing_lost),
            )
            kept = dict(previous.entries)
            why = {name: scan.listing_lost for name in kept}
        else:
            old = {n: e for n, e in previous.entries.items() if e.bdf in scan.lost}
            # The GPU's first partition keeps serving RAS and resets, on its new handle.
            primaries = {
                e.gpu_key: scan.lost[e.bdf][0]
                for e in old.values()
                if handle_key(e.handle) == handle_key(e.primary)
            }
            kept = {
                name: dataclasses.replace(
                    entry,
                    handle=scan.lost[entry.bdf][0],
                    primary=primaries.get(entry.gpu_key, scan.lost[entry.bdf][0]),
                )
                for name, entry in old.items()
            }
            why = {name: scan.lost[entry.bdf][1] for name, entry in kept.items()}
            known = {e.bdf for e in previous.entries.values()}
            for bdf, (_, error) in scan.lost.items():
                if bdf not in known:
                    log.warning(
                        "skipping a GPU that answers with a lost status",
                        extra=log_fields(pci_bus_id=bdf, error=error),
                    )

        if not kept:
            return found
        entries: dict[str, DeviceEntry] = dict(found.entries)
        devices = list(found.devices)
        for device in previous.devices:
            entry = kept.get(device.name)
            if entry is None or device.name in entries:
                continue
            self._memory.suspect(entry.gpu_key, f"rediscovery: {why[device.name]}")
            entries[device.name] = entry
            devices.append(device)
        devices.sort(key=lambda d: (entries[d.name].card, entries[d.name].render))
        return Discovery(tuple(devices), entries)

    async def monitor_health(self, sink: HealthSink) -> None:
        """Watch events and RAS for the discovered devices until cancelled."""
        if not self._discovered:
            await self.discover()
        while True:
            # Each rediscovery re-initialises amdsmi (new handles) and may find other GPUs or
            # partitions (a mode change, a GPU back from loss): watch the new set from then on.
            changed = self._devices_changed = anyio.Event()
            entries = list(self._discovery.entries.values())
            monitor = HealthMonitor(
                self._library(), entries, self._clock, self._health_settings, memory=self._memory
            )
            async with anyio.create_task_group() as tg:
                tg.start_soon(monitor.run, sink)
                tg.start_soon(self._keep_ecc_counts)
                await changed.wait()
                tg.cancel_scope.cancel()
            log.info("devices changed; restarting health monitoring", extra=log_fields(driver=self._driver))

    async def _keep_ecc_counts(self) -> None:
        """Save the ECC counts when they change, so a restarted agent does not take them as a baseline."""
        if self._ecc_path is None:
            await anyio.sleep_forever()
            return
        saved: EccCounts = {}
        while True:
            snapshot = self._memory.ecc_counts()
            if snapshot != saved:
                try:
                    await anyio.to_thread.run_sync(save_ecc_counts, self._ecc_path, self._boot, snapshot)
                    saved = snapshot
                except OSError as error:
                    log.warning("cannot save the ECC counts", extra=log_fields(error=str(error)))
            await self._clock.sleep(self._health_settings.poll_interval)

    async def prepared_status(self, device: str, claim: ClaimRef) -> PreparedStatus:
        """A partition's identity and its GPU's (`DescribesPrepared`)."""
        found = next((d for d in self._discovery.devices if d.name == device), None)
        if found is None:
            raise DeviceNotFoundError(self._driver, device)
        return partition_status(found)

    async def prepare(self, device: str, claim: ClaimRef) -> ContainerEdits:
        """Edits for /dev/kfd and the device's DRM nodes, read from the host now."""
        entry = self._discovery.entries.get(device)
        if entry is None:
            raise DeviceNotFoundError(self._driver, device)
        return await container_edits(self._dev_root, entry.card, entry.render, self._stat)

    def plan_prepare(self, device: str, claim: ClaimRef) -> PreparePlan | None:
        """`prepare` as the core's blocking work (`PlansPrepare`): the device nodes read in its hop."""
        entry = self._discovery.entries.get(device)
        if entry is None:
            raise DeviceNotFoundError(self._driver, device)
        return functools.partial(read_edits, self._dev_root, entry.card, entry.render, self._stat)

    def plan_unprepare(self, device: str, claim: ClaimRef) -> UnpreparePlan | None:
        """Nothing to undo."""
        return nothing_to_undo

    async def unprepare(self, device: str, claim: ClaimRef) -> None:
        """Nothing to undo: preparing only reads device nodes."""

    async def prepare_share(self, share: DeviceShare, peers: Sequence[DeviceShare]) -> ContainerEdits:
        """`prepare` after the AMD config check (`backends.amd.sharingconfig`); nothing to set up."""
        check_shares(share, peers)
        return await self.prepare(share.device, share.claim)

    async def unprepare_share(self, share: DeviceShare, peers: Sequence[DeviceShare]) -> None:
        """Nothing to undo."""

    async def resume_shares(self, shares: Sequence[DeviceShare]) -> None:
        """Nothing to resume: the hardware keeps no sharing state."""

    async def telemetry(self) -> Sequence[DeviceTelemetry]:
        """Read counters of every published device; a failing field is None.

        The ECC totals are the health pass's last reading (never read twice); a device that
        answered only with a lost status makes its GPU suspect, reported lost by the next pass.
        """
        lib = self._library()
        entries = list(self._discovery.entries.values())
        warned = self._warned
        ecc = self._memory.ecc_totals()
        reading = await lib.run(lambda smi: read_telemetry(smi, entries, warned, ecc), "read_telemetry")
        for name, why in reading.lost.items():
            entry = self._discovery.entries.get(name)
            if entry is not None:
                self._memory.suspect(entry.gpu_key, f"telemetry: {why}")
        return reading.devices
