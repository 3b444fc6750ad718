"""`NvidiaBackend`: the `agent.core.backend.Backend` for NVIDIA GPUs and MIG devices through NVML."""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import anyio.to_thread

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
from agent.core.model import Device, check_driver_name
from agent.core.sharing import ConsumableShares, DeviceShare, merge_edits
from agent.core.vendorcall import DEFAULT_CALL_TIMEOUT
from backends.nvidia.capnodes import NodeMaker, ensure_cap_nodes, mknod
from backends.nvidia.checks import CHECKS, RATE_SETTINGS, TRENDS, TrendThresholds
from backends.nvidia.discovery import DEFAULT_DRIVER_NAME, Discovery, NvDevice, discover_sync
from backends.nvidia.driverfiles import (
    DEFAULT_HOOK_PATH,
    DriverFiles,
    HostView,
    driver_program,
    find_driver_files,
)
from backends.nvidia.dynamicmig import DynamicMig, gpu_handles_sync
from backends.nvidia.edits import (
    AUTO,
    CDI_MODES,
    OWN,
    TOOLKIT,
    DevDir,
    EditsConfig,
    own_edits,
    resolve_dev_dir,
    toolkit_edits,
)
from backends.nvidia.health import CONDITIONS, HealthMonitor, HealthState
from backends.nvidia.migjournal import MigJournal
from backends.nvidia.migstatus import static_mig_status
from backends.nvidia.mps import CONTROL_PROGRAM, ControlProgram, MpsDaemons, MpsProgram, ShmMounter
from backends.nvidia.nvml import Nvml, load_pynvml
from backends.nvidia.sharing import DeviceFacts, GpuPolicy, NvSharingManager, SmiGpuPolicy, facts_of
from backends.nvidia.telemetry import read_telemetry_sync
from backends.nvidia.toolkitspec import ToolkitDevices, ToolkitSpecReader
from backends.nvidia.xids import XidPolicy

log = logging.getLogger("agent.backends.nvidia")

SETTINGS = (
    "driver",
    "cdi-mode",
    "driver-root",
    "host-root",
    "cdi-hook-path",
    "ignored-xids",
    "critical-xids",
    "telemetry-interval",
    "health-wait-ms",
    "recovery-interval",
    ConsumableShares.SETTING,
    "dynamic-mig",
    "dynamic-mig-dir",
    *RATE_SETTINGS,
)
STATE_SUBDIR = "mps"
LIBRARY_LINKS_SUBDIR = "driver-libraries"
"""Links to the driver's libraries: the library path of the driver programs the agent runs."""
DEFAULT_DYNAMIC_MIG_DIR = "/var/lib/dra-agent"


def _path_setting(settings: Mapping[str, str], key: str, default: str) -> str:
    value = settings.get(key) or default
    if not value.startswith("/"):
        raise ConfigError(f"nvidia setting {key}", value, f"an absolute path such as {default}")
    return value


def _float_setting(settings: Mapping[str, str], key: str, default: float, minimum: float) -> float:
    raw = settings.get(key)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = minimum - 1
    if not math.isfinite(value) or value < minimum:
        raise ConfigError(f"nvidia setting {key}", raw, f"a finite number of seconds >= {minimum}")
    return value


def _watched(discovery: Discovery) -> set[tuple[str, str]]:
    """What a health monitor watches: each device name with its GPU."""
    return {(d.name, d.gpu.uuid) for d in discovery.devices}


class NvidiaBackend:
    """NVIDIA GPUs and MIG devices: discovery, health, CDI edits and telemetry through NVML."""

    health_conditions = CONDITIONS
    health_checks = CHECKS
    """The health pass's checks (`PollsHealth`; `backends.nvidia.checks`)."""
    trend_conditions = TRENDS
    """Conditions that are error-rate trends (`ReportsTrends`)."""

    def __init__(
        self,
        options: BackendOptions,
        *,
        nvml_module: ModuleType | Any | None = None,
        clock: Clock | None = None,
        sysfs_root: Path = Path("/sys"),
        proc_root: Path = Path("/proc"),
        dev_root: Path | None = None,
        policy: GpuPolicy | None = None,
        mps_program: MpsProgram | None = None,
        mps_shm: ShmMounter | None = None,
        call_timeout: float = DEFAULT_CALL_TIMEOUT,
        make_node: NodeMaker = mknod,
    ) -> None:
        settings = options.settings
        unknown = sorted(set(settings) - set(SETTINGS))
        if unknown:
            raise ConfigError("nvidia backend settings", ",".join(unknown), f"one of {', '.join(SETTINGS)}")
        self._driver = options.driver_name or DEFAULT_DRIVER_NAME
        if problem := check_driver_name(self._driver):
            raise ConfigError("nvidia setting driver", self._driver, f"a driver name that {problem}")
        mode = settings.get("cdi-mode") or AUTO
        if mode not in CDI_MODES:
            raise ConfigError("nvidia setting cdi-mode", mode, ", ".join(CDI_MODES))
        driver_root = _path_setting(settings, "driver-root", "/")
        host = HostView(Path(_path_setting(settings, "host-root", "/")))
        self._policy = XidPolicy.from_settings(settings)
        self._telemetry_interval = _float_setting(settings, "telemetry-interval", 0.0, 0.0)
        self._wait_ms = int(_float_setting(settings, "health-wait-ms", 500, 10))
        self._recovery_interval = _float_setting(settings, "recovery-interval", 5.0, 0.0)
        self._thresholds = TrendThresholds.from_settings(settings)
        self._health_interval = options.health_interval
        dynamic = (settings.get("dynamic-mig") or "false").lower()
        if dynamic not in ("true", "false"):
            raise ConfigError("nvidia setting dynamic-mig", dynamic, "true or false")
        journal_dir = Path(_path_setting(settings, "dynamic-mig-dir", DEFAULT_DYNAMIC_MIG_DIR))
        self._journal_path = journal_dir / f"dynamic-mig-{self._driver}.json" if dynamic == "true" else None
        self._dynamic: DynamicMig | None = None
        self._module = nvml_module
        self._call_timeout = call_timeout
        self._nvml: Nvml | None = None
        # NVML is loaded from the driver root as mounted in the agent (the chart: the same path).
        self._driver_root = Path(driver_root)
        self._clock: Clock = clock or SystemClock()
        self._sysfs_root = sysfs_root
        self._dev_override = dev_root
        self._make_node = make_node
        self._edits = EditsConfig(
            mode=mode,
            driver_root=driver_root,
            host=host,
            proc_root=proc_root,
            hook_path=_path_setting(settings, "cdi-hook-path", DEFAULT_HOOK_PATH),
        )
        self._files = DriverFiles()
        self._toolkit = ToolkitSpecReader(host)
        self._active_mode = ""
        self._discovery = Discovery()
        self._discovered = False
        self._said_no_gpus = False
        self._health = HealthState()
        # GPUs kept published while rediscovery finds them lost (warned once per episode).
        self._kept_lost: set[str] = set()
        # GPUs a telemetry read found lost (warned once per episode).
        self._telemetry_lost: set[str] = set()
        self._monitor_scopes: set[anyio.CancelScope] = set()
        self._telemetry_cache: list[DeviceTelemetry] = []
        self._telemetry_at: float | None = None
        self._prepared: dict[tuple[str, str], ContainerEdits] = {}
        self._shares = ConsumableShares.parse(
            settings.get(ConsumableShares.SETTING, "disabled"), f"nvidia setting {ConsumableShares.SETTING}"
        )
        if self._journal_path is not None and self._shares.enabled:
            log.warning(
                "consumable-shares with dynamic-mig=true: partitionable GPUs and their MIG placements "
                "are published for exclusive use, never shared; GPUs published whole (MIG mode off, "
                "no MIG) and static MIG devices are shared as set",
                extra=log_fields(consumable_shares=settings[ConsumableShares.SETTING], dynamic_mig="true"),
            )
        state_dir = options.state_dir or Path("/var/lib/dra-agent")
        state = state_dir / STATE_SUBDIR / self._driver
        links = state_dir / LIBRARY_LINKS_SUBDIR / self._driver
        self._sharing = NvSharingManager(
            self._facts,
            # The driver's programs, from the host's driver root: the agent's image has none.
            policy or SmiGpuPolicy(driver_program(host, driver_root, "nvidia-smi", links)),
            MpsDaemons(
                state,
                mps_program or ControlProgram(driver_program(host, driver_root, CONTROL_PROGRAM, links)),
                mps_shm,
            ),
        )

    @property
    def driver_name(self) -> str:
        return self._driver

    @property
    def cdi_mode(self) -> str:
        """The configured CDI mode (``auto``, ``own`` or ``toolkit``)."""
        return self._edits.mode

    @property
    def active_cdi_mode(self) -> str:
        """The mode the last start or prepare chose (``own`` or ``toolkit``); "" before start."""
        return self._active_mode

    def _lib(self) -> Nvml:
        if self._nvml is None:
            raise BackendError("NVIDIA backend: used before start(); call start() first")
        return self._nvml

    async def start(self) -> None:
        """Load pynvml and initialize NVML; raises `BackendError` saying how to fix a missing driver."""
        if self._nvml is not None:
            return
        module = self._module if self._module is not None else load_pynvml()
        nvml = Nvml(module, self._driver_root, self._call_timeout)
        await nvml.run(nvml.init_sync)
        self._nvml = nvml
        if self._journal_path is not None:
            journal = MigJournal(self._journal_path)
            await anyio.to_thread.run_sync(journal.load)
            self._dynamic = DynamicMig(nvml, journal)
            handles = await nvml.run(gpu_handles_sync, nvml)
            await nvml.run(self._dynamic.reconcile_sync, handles)
        await self._choose_cdi_mode()

    async def _choose_cdi_mode(self) -> None:
        """Look up the driver's files and the toolkit's spec; log the mode this start chose and why."""
        config = self._edits
        dev = (
            DevDir(self._dev_override, str(self._dev_override))
            if self._dev_override is not None
            else await anyio.to_thread.run_sync(resolve_dev_dir, config.host, config.driver_root)
        )
        self._edits = config = replace(config, dev=dev)
        try:
            self._files = await anyio.to_thread.run_sync(
                find_driver_files, config.host, config.driver_root, config.hook_path
            )
        except OSError as error:
            # Own edits then carry device nodes only; the warning below names what is missing.
            log.error("cannot read the NVIDIA driver root", extra=log_fields(error=str(error)))
        toolkit = ToolkitDevices()
        if config.mode != OWN:
            toolkit = await anyio.to_thread.run_sync(self._toolkit.read)
        if config.mode == OWN:
            reason = "cdi-mode=own"
        elif toolkit.by_uuid:
            reason = f"the toolkit's CDI spec names the GPUs by UUID: {', '.join(toolkit.files)}"
        else:
            reason = toolkit.why_not("")
        chosen = TOOLKIT if config.mode == TOOLKIT or toolkit.by_uuid else OWN
        self._active_mode = chosen
        fields = log_fields(driver=self._driver, setting=config.mode, mode=chosen, reason=reason)
        if config.mode == TOOLKIT and not toolkit.by_uuid:
            log.error("NVIDIA CDI mode toolkit: claims fail until the toolkit's spec is fixed", extra=fields)
            return
        log.info("NVIDIA CDI mode chosen", extra=fields)
        if chosen == OWN:
            self._warn_about_driver_files()

    def _warn_about_driver_files(self) -> None:
        files, config = self._files, self._edits
        if files.missing:
            log.warning(
                "NVIDIA driver libraries missing under the driver root: containers cannot use CUDA",
                extra=log_fields(
                    driver_root=config.driver_root,
                    host_root=str(config.host.root),
                    missing=",".join(files.missing),
                    hint="set driver-root (Helm backends.nvidia.driverRoot) to where the driver is installed",
                ),
            )
        if not files.hook_path:
            log.warning(
                "nvidia-cdi-hook not found: no ldcache update in containers; the driver libraries are "
                "found only by images whose default library path holds the host's library directory",
                extra=log_fields(
                    hook_path=config.hook_path,
                    library_dirs=",".join(files.library_dirs),
                    hint="install nvidia-container-toolkit-base on the node or set cdi-hook-path",
                ),
            )

    async def stop(self) -> None:
        nvml, self._nvml = self._nvml, None
        if nvml is not None:
            with anyio.CancelScope(shield=True):
                await nvml.shutdown()

    async def discover(self) -> Sequence[Device]:
        nvml = self._lib()
        try:
            discovery = await nvml.run(discover_sync, nvml, self._driver, self._sysfs_root, self._dynamic)
        except Exception as error:
            if nvml.is_error(error):
                raise BackendError(
                    f"NVIDIA backend: cannot list GPUs: {error}: check the driver with 'nvidia-smi'"
                ) from error
            raise
        discovery = self._keep_lost(self._discovery, discovery)
        previous, self._discovery = self._discovery, discovery
        self._discovered = True
        if _watched(previous) != _watched(discovery):
            for scope in self._monitor_scopes:
                scope.cancel()
        if not discovery.devices and not self._said_no_gpus:
            self._said_no_gpus = True
            log.warning(
                "no NVIDIA GPUs found: publishing an empty pool",
                extra=log_fields(gpus=len(discovery.gpus), hint="check 'nvidia-smi -L' on the node"),
            )
        return [self._shares.apply(d.device) for d in discovery.devices]

    def _keep_lost(self, previous: Discovery, found: Discovery) -> Discovery:
        """`found` plus the previous devices of each GPU that now answers GPU_IS_LOST.

        A lost GPU stays published with what it had (the health pass marks it ``gpu-lost``, and
        the taint keeps work off it) rather than vanishing from the pool without a word.
        """
        seen = {g.uuid for g in found.gpus}
        kept = [g for g in previous.gpus if g.index in found.lost and g.uuid not in seen]
        for uuid in self._kept_lost - {g.uuid for g in kept}:
            self._health.suspect.add(uuid)  # read again: the monitor asks it at once
            log.info(
                "GPU no longer kept as lost: rediscovery reads it again or no longer lists it",
                extra=log_fields(gpu=uuid),
            )
        now_kept = {g.uuid for g in kept}
        for gpu in kept:
            self._health.suspect.add(gpu.uuid)
            if gpu.uuid not in self._kept_lost:
                log.warning(
                    "GPU lost: kept published with its devices while it does not answer",
                    extra=log_fields(gpu=gpu.uuid, index=gpu.index, hint="reset the GPU or reboot the node"),
                )
        self._kept_lost = now_kept
        if not kept:
            return found
        gpus = sorted((*found.gpus, *kept), key=lambda g: g.index)
        devices = sorted(
            (*found.devices, *(d for d in previous.devices if d.gpu.uuid in now_kept)),
            key=lambda d: d.gpu.index,
        )
        return Discovery(tuple(gpus), tuple(devices), found.lost)

    async def _ensure_discovered(self) -> Discovery:
        if not self._discovered:
            await self.discover()
        return self._discovery

    async def monitor_health(self, sink: HealthSink) -> None:
        """Watch the GPUs of the latest discovery; a rediscovery that changes them restarts the watch.

        `HealthState` outlives each watch, so the new one clears ``gpu-lost`` and ``unmonitored``
        of GPUs that answer again (a GPU back after a reset, one that appeared later).
        """
        nvml = self._lib()
        discovery = await self._ensure_discovered()
        while True:
            monitor = HealthMonitor(
                nvml,
                discovery.devices,
                self._clock,
                policy=self._policy,
                state=self._health,
                wait_ms=self._wait_ms,
                recovery_interval=self._recovery_interval,
                health_interval=self._health_interval,
                thresholds=self._thresholds,
            )
            # `discover` cancels this scope when the GPUs change; a failure propagates as it is.
            with anyio.CancelScope() as scope:
                self._monitor_scopes.add(scope)
                try:
                    await monitor.run(sink)
                finally:
                    self._monitor_scopes.discard(scope)
            discovery = self._discovery
            log.info(
                "GPUs changed; restarting health monitoring",
                extra=log_fields(driver=self._driver, devices=len(discovery.devices)),
            )

    def _device(self, name: str) -> NvDevice:
        found = self._discovery.by_name().get(name)
        if found is None:
            raise DeviceNotFoundError(self._driver, name)
        return found

    async def prepare(self, device: str, claim: ClaimRef) -> ContainerEdits:
        self._lib()
        await self._ensure_discovered()
        key = (claim.uid, device)
        if key in self._prepared:
            return self._prepared[key]
        nv = self._device(device)
        placement = self._dynamic.placements.get(device) if self._dynamic is not None else None
        if self._dynamic is not None and placement is not None:
            # The MIG device is created first; its edits are those of a static MIG device.
            try:
                edits = await self._dynamic.prepare(placement, claim.uid, nv, self._created_edits)
            except Exception as error:
                self._suspect_if_lost(nv.gpu.uuid, error)
                raise
        else:
            edits = await self._edits_for(nv)
        self._prepared[key] = edits
        self._log_prepared(device, claim)
        return edits

    async def prepared_status(self, device: str, claim: ClaimRef) -> PreparedStatus:
        """A MIG device's identity (`DescribesPrepared`): static, or created for the claim."""
        placement = self._dynamic.placements.get(device) if self._dynamic is not None else None
        if self._dynamic is not None and placement is not None:
            return await self._dynamic.status_of(placement, claim.uid)
        return static_mig_status(self._device(device))

    def plan_prepare(self, device: str, claim: ClaimRef) -> PreparePlan | None:
        """`prepare` of a whole GPU or static MIG device: file reads only, run in the core's hop.

        None (the async `prepare`) before the first discovery and for a dynamic MIG placement,
        which creates the MIG device through NVML.
        """
        self._lib()
        if not self._discovered:
            return None
        key = (claim.uid, device)
        done = self._prepared.get(key)
        if done is not None:
            return lambda: done
        nv = self._device(device)
        if self._dynamic is not None and device in self._dynamic.placements:
            return None

        def edits() -> ContainerEdits:
            found = self._edits_sync(nv)
            self._prepared[key] = found
            self._log_prepared(device, claim)
            return found

        return edits

    def plan_unprepare(self, device: str, claim: ClaimRef) -> UnpreparePlan | None:
        """Nothing to undo on the GPU but with dynamic MIG (then None: the async `unprepare`)."""
        if self._dynamic is not None:
            return None
        self._prepared.pop((claim.uid, device), None)
        return nothing_to_undo

    def _log_prepared(self, device: str, claim: ClaimRef) -> None:
        # Per call at debug: dra_agent_claim_operations_total counts the prepares.
        log.debug("prepared device", extra=log_fields(device=device, claim=claim.uid, mode=self._active_mode))

    async def _created_edits(self, nv: NvDevice) -> ContainerEdits:
        """Edits of a MIG device just created: its capability nodes may not exist yet (we make them)."""
        if nv.mig is not None:
            config = self._edits
            make = functools.partial(ensure_cap_nodes, make=self._make_node)
            await anyio.to_thread.run_sync(
                make,
                config.proc_root,
                config.dev.view,
                nv.gpu.minor,
                nv.mig.gpu_instance_id,
                nv.mig.compute_instance_id,
            )
        return await self._edits_for(nv)

    async def _edits_for(self, nv: NvDevice) -> ContainerEdits:
        return await anyio.to_thread.run_sync(self._edits_sync, nv)

    def _edits_sync(self, nv: NvDevice) -> ContainerEdits:
        """The edits of `nv` in the mode that serves it now (blocking: reads the toolkit's spec and
        the driver's files)."""
        if self._mode_for(nv) == TOOLKIT:
            return toolkit_edits(nv)
        return own_edits(nv, self._edits, self._files)

    def _mode_for(self, device: NvDevice) -> str:
        """The mode that serves `device` now: the toolkit's spec is checked at every prepare (blocking)."""
        if self._edits.mode == OWN:
            return OWN
        toolkit = self._toolkit.read()
        reason = toolkit.why_not(device.uuid)
        if self._edits.mode == TOOLKIT and reason:
            raise BackendError(
                f"NVIDIA backend: cdi-mode=toolkit cannot give {device.name} ({device.uuid}) to a "
                f"container: {reason}; or set cdi-mode=auto to fall back to the agent's own CDI edits"
            )
        mode = OWN if reason else TOOLKIT
        if mode != self._active_mode:
            log.warning(
                "NVIDIA CDI mode changed",
                extra=log_fields(
                    driver=self._driver,
                    device=device.name,
                    previous=self._active_mode,
                    mode=mode,
                    reason=reason or "the toolkit's CDI spec names the GPU by UUID",
                ),
            )
            self._active_mode = mode
        return mode

    async def unprepare(self, device: str, claim: ClaimRef) -> None:
        # Only a dynamic MIG device changes the GPU when prepared; the others have nothing to undo.
        if self._dynamic is not None:
            # The journal, not the current discovery, says which GPU holds the claim's MIG device;
            # a GPU kept published while lost took its MIG devices with it.
            discovery = await self._ensure_discovered()
            gpus = {g.uuid: g.handle for g in discovery.gpus if g.uuid not in self._kept_lost}
            await self._dynamic.unprepare(device, claim.uid, gpus)
        self._prepared.pop((claim.uid, device), None)

    def _suspect_if_lost(self, gpu_uuid: str, error: BaseException) -> None:
        """A call that met GPU_IS_LOST makes the health pass ask that GPU at once."""
        nvml = self._nvml
        cause: BaseException | None = error
        while cause is not None and nvml is not None:
            if nvml.is_gpu_lost(cause):
                self._health.suspect.add(gpu_uuid)
                return
            cause = cause.__cause__

    def _facts(self, name: str) -> DeviceFacts:
        nv = self._device(name)
        return facts_of(nv.device.attributes, nv.uuid)

    async def prepare_share(self, share: DeviceShare, peers: Sequence[DeviceShare]) -> ContainerEdits:
        """`prepare` plus the share's time-slicing or MPS (`backends.nvidia.sharing`)."""
        base = await self.prepare(share.device, share.claim)
        return merge_edits(base, await self._sharing.prepare(share, peers))

    async def unprepare_share(self, share: DeviceShare, peers: Sequence[DeviceShare]) -> None:
        await self._sharing.unprepare(share, peers)
        await self.unprepare(share.device, share.claim)

    async def resume_shares(self, shares: Sequence[DeviceShare]) -> None:
        self._lib()
        await self._ensure_discovered()
        await self._sharing.resume(shares)

    async def telemetry(self) -> Sequence[DeviceTelemetry]:
        nvml = self._lib()
        discovery = await self._ensure_discovered()
        now = self._clock.monotonic()
        if self._telemetry_at is not None and now - self._telemetry_at < self._telemetry_interval:
            return list(self._telemetry_cache)
        placements = self._dynamic.placements if self._dynamic is not None else {}
        # A MIG placement is no device until prepared: its GPU reports for it.
        devices = [d for d in discovery.devices if d.name not in placements]
        # The ECC totals are the health pass's last readings: NVML is not asked twice.
        ecc = {gpu.uuid: self._health.ecc(gpu.uuid) for gpu in discovery.gpus}
        read = await nvml.run(
            read_telemetry_sync, nvml, devices, dict(self._health.last_xid), self._clock.time(), ecc
        )
        self._note_lost(read.lost)
        self._telemetry_cache, self._telemetry_at = read.readings, now
        return read.readings

    def _note_lost(self, lost: Mapping[str, str]) -> None:
        """GPUs a telemetry read found lost: the health pass asks them at once; one warning per episode."""
        for uuid, why in lost.items():
            self._health.suspect.add(uuid)
            if uuid not in self._telemetry_lost:
                log.warning(
                    "GPU does not answer telemetry reads (GPU_IS_LOST): its readings are unknown",
                    extra=log_fields(gpu=uuid, error=why),
                )
        for uuid in self._telemetry_lost - lost.keys():
            log.info("GPU answers telemetry reads again", extra=log_fields(gpu=uuid))
        self._telemetry_lost = set(lost)
