"""`NvidiaBackend`: the `agent.core.backend.Backend` for NVIDIA GPUs and MIG devices through NVML."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio
import anyio.to_thread

from agent.core.backend import BackendOptions, ClaimRef, ContainerEdits, DeviceTelemetry, HealthSink, Mount
from agent.core.clock import Clock, SystemClock
from agent.core.errors import BackendError, ConfigError, DeviceNotFoundError
from agent.core.logs import log_fields
from agent.core.model import Device, check_driver_name
from backends.nvidia.discovery import DEFAULT_DRIVER_NAME, Discovery, NvDevice, discover_sync
from backends.nvidia.dynamicmig import DynamicMig, gpu_handles_sync
from backends.nvidia.edits import CDI_MODES, EditsConfig, container_edits, driver_mounts, resolve_dev_root
from backends.nvidia.health import CONDITIONS, HealthMonitor, HealthState, XidPolicy
from backends.nvidia.migjournal import MigJournal
from backends.nvidia.nvml import Nvml, load_pynvml
from backends.nvidia.telemetry import read_telemetry_sync

log = logging.getLogger("agent.backends.nvidia")

SETTINGS = (
    "driver",
    "cdi-mode",
    "driver-root",
    "ignored-xids",
    "critical-xids",
    "telemetry-interval",
    "health-wait-ms",
    "recovery-interval",
    "dynamic-mig",
    "dynamic-mig-dir",
)
DEFAULT_DYNAMIC_MIG_DIR = "/var/lib/dra-agent"


def _float_setting(settings: Mapping[str, str], key: str, default: float, minimum: float) -> float:
    raw = settings.get(key)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ConfigError(f"nvidia setting {key}", raw, f"a number of seconds >= {minimum}")
    return value


class NvidiaBackend:
    """NVIDIA GPUs and MIG devices: discovery, health, CDI edits and telemetry through NVML."""

    health_conditions = CONDITIONS

    def __init__(
        self,
        options: BackendOptions,
        *,
        nvml_module: ModuleType | Any | None = None,
        clock: Clock | None = None,
        sysfs_root: Path = Path("/sys"),
        proc_root: Path = Path("/proc"),
        dev_root: Path | None = None,
    ) -> None:
        settings = options.settings
        unknown = sorted(set(settings) - set(SETTINGS))
        if unknown:
            raise ConfigError("nvidia backend settings", ",".join(unknown), f"one of {', '.join(SETTINGS)}")
        self._driver = options.driver_name or DEFAULT_DRIVER_NAME
        if problem := check_driver_name(self._driver):
            raise ConfigError("nvidia setting driver", self._driver, f"a driver name that {problem}")
        mode = settings.get("cdi-mode", "own") or "own"
        if mode not in CDI_MODES:
            raise ConfigError("nvidia setting cdi-mode", mode, " or ".join(CDI_MODES))
        driver_root = Path(settings.get("driver-root") or "/")
        if not driver_root.is_absolute():
            raise ConfigError("nvidia setting driver-root", str(driver_root), "an absolute path such as /")
        self._policy = XidPolicy.from_settings(settings)
        self._telemetry_interval = _float_setting(settings, "telemetry-interval", 0.0, 0.0)
        self._wait_ms = int(_float_setting(settings, "health-wait-ms", 500, 10))
        self._recovery_interval = _float_setting(settings, "recovery-interval", 5.0, 0.0)
        dynamic = (settings.get("dynamic-mig") or "false").lower()
        if dynamic not in ("true", "false"):
            raise ConfigError("nvidia setting dynamic-mig", dynamic, "true or false")
        journal_dir = Path(settings.get("dynamic-mig-dir") or DEFAULT_DYNAMIC_MIG_DIR)
        if not journal_dir.is_absolute():
            raise ConfigError(
                "nvidia setting dynamic-mig-dir", str(journal_dir), "an absolute directory path"
            )
        self._journal_path = journal_dir / f"dynamic-mig-{self._driver}.json" if dynamic == "true" else None
        self._dynamic: DynamicMig | None = None
        self._module = nvml_module
        self._nvml: Nvml | None = None
        self._driver_root = driver_root
        self._clock: Clock = clock or SystemClock()
        self._sysfs_root = sysfs_root
        self._edits = EditsConfig(
            mode=mode,
            driver_root=driver_root,
            dev_root=dev_root if dev_root is not None else resolve_dev_root(driver_root),
            proc_root=proc_root,
        )
        self._mounts: tuple[Mount, ...] | None = None
        self._discovery = Discovery()
        self._discovered = False
        self._said_no_gpus = False
        self._health = HealthState()
        self._telemetry_cache: list[DeviceTelemetry] = []
        self._telemetry_at: float | None = None
        self._prepared: dict[tuple[str, str], ContainerEdits] = {}

    @property
    def driver_name(self) -> str:
        return self._driver

    @property
    def cdi_mode(self) -> str:
        return self._edits.mode

    def _lib(self) -> Nvml:
        if self._nvml is None:
            raise BackendError("NVIDIA backend: used before start(); call start() first")
        return self._nvml

    async def start(self) -> None:
        """Load pynvml and initialize NVML; raises `BackendError` saying how to fix a missing driver."""
        if self._nvml is not None:
            return
        module = self._module if self._module is not None else load_pynvml()
        nvml = Nvml(module, self._driver_root)
        await nvml.run(nvml.init_sync)
        self._nvml = nvml
        if self._journal_path is not None:
            journal = MigJournal(self._journal_path)
            await anyio.to_thread.run_sync(journal.load)
            self._dynamic = DynamicMig(nvml, journal)
            handles = await nvml.run(gpu_handles_sync, nvml)
            await nvml.run(self._dynamic.reconcile_sync, handles)
        if self._edits.mode == "own":
            self._mounts = await anyio.to_thread.run_sync(driver_mounts, self._driver_root)
            if not self._mounts:
                log.warning(
                    "no NVIDIA driver libraries under the driver root: containers get device nodes only",
                    extra=log_fields(
                        driver_root=str(self._driver_root),
                        hint="set driver-root (Helm nvidia.driverRoot) or use cdi-mode=toolkit",
                    ),
                )

    async def stop(self) -> None:
        nvml, self._nvml = self._nvml, None
        if nvml is not None:
            with anyio.CancelScope(shield=True):
                await nvml.run(nvml.shutdown_sync)

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
        self._discovery = discovery
        self._discovered = True
        if not discovery.devices and not self._said_no_gpus:
            self._said_no_gpus = True
            log.warning(
                "no NVIDIA GPUs found: publishing an empty pool",
                extra=log_fields(gpus=len(discovery.gpus), hint="check 'nvidia-smi -L' on the node"),
            )
        return [d.device for d in discovery.devices]

    async def _ensure_discovered(self) -> Discovery:
        if not self._discovered:
            await self.discover()
        return self._discovery

    async def monitor_health(self, sink: HealthSink) -> None:
        """Watch the GPUs of the latest discovery (a restart of the monitor picks up new ones)."""
        nvml = self._lib()
        discovery = await self._ensure_discovered()
        monitor = HealthMonitor(
            nvml,
            discovery.devices,
            self._clock,
            policy=self._policy,
            state=self._health,
            wait_ms=self._wait_ms,
            recovery_interval=self._recovery_interval,
        )
        await monitor.run(sink)

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

            async def finish(mig: NvDevice) -> ContainerEdits:
                return await anyio.to_thread.run_sync(container_edits, mig, self._edits, self._mounts)

            edits = await self._dynamic.prepare(placement, claim.uid, nv, finish)
        else:
            edits = await anyio.to_thread.run_sync(container_edits, nv, self._edits, self._mounts)
        self._prepared[key] = edits
        log.info("prepared device", extra=log_fields(device=device, claim=claim.uid, mode=self._edits.mode))
        return edits

    async def unprepare(self, device: str, claim: ClaimRef) -> None:
        # Only a dynamic MIG device changes the GPU when prepared; the others have nothing to undo.
        if self._dynamic is not None:
            # The journal, not the current discovery, says which GPU holds the claim's MIG device.
            gpus = {g.uuid: g.handle for g in (await self._ensure_discovered()).gpus}
            await self._dynamic.unprepare(device, claim.uid, gpus)
        self._prepared.pop((claim.uid, device), None)

    async def telemetry(self) -> Sequence[DeviceTelemetry]:
        nvml = self._lib()
        discovery = await self._ensure_discovered()
        now = self._clock.monotonic()
        if self._telemetry_at is not None and now - self._telemetry_at < self._telemetry_interval:
            return list(self._telemetry_cache)
        placements = self._dynamic.placements if self._dynamic is not None else {}
        # A MIG placement is no device until prepared: its GPU reports for it.
        devices = [d for d in discovery.devices if d.name not in placements]
        readings = await nvml.run(
            read_telemetry_sync, nvml, devices, dict(self._health.last_xid), self._clock.time()
        )
        self._telemetry_cache, self._telemetry_at = readings, now
        return readings
