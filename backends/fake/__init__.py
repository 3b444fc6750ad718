"""The fake backend: devices from a YAML profile, with faults injected at run time.

Settings (``--backend fake:key=value,...``):

``profile``
    A shipped profile (``nvidia-a100-8x``, ``nvidia-h100-8x``, ``amd-mi300x-8x``,
    ``amd-mi300x-8x-cpx``, ``mixed``) or the path of a profile file (see `backends.fake.profile`);
    default ``mixed``.
``dynamic-mig``
    ``true``: whole NVIDIA GPUs that can do MIG are published partitionable, as the NVIDIA
    backend's ``dynamic-mig=true`` does (see `backends.fake.dynamicmig`); default ``false``.
``control``
    Path of the control socket for ``dra-agent fake ...``; default
    ``/tmp/dra-agent-fake-<node>.sock``; ``off`` disables it.
``prepare_fail``, ``prepare_fail_rate``, ``prepare_latency``, ``seed``
    Prepare fault injection (see `backends.fake.backend`).
``consumable-shares``
    ``disabled`` (default), ``memory``, ``unlimited`` or a number: publish devices shareable
    (`agent.core.sharing.ConsumableShares`). NVIDIA profiles take NVIDIA's claim configuration
    (time-slicing recorded in ``<state dir>/fake-sharing/<driver>/timeslice.json``, MPS through
    real stand-in daemon processes, `backends.fake.sharing`); AMD profiles take AMD's.
``lost``
    Device names joined by ``+`` whose GPU is lost when the backend starts (no event: its first
    health pass, one ``--health-interval`` after start, reports ``gpu-lost``), as a GPU that died
    while the agent was down.
``device_files``
    Host directory of the per-claim device description files that containers mount (see
    `backends.fake.devicefile`); default ``<state dir>/fake-devices``; ``off``: environment only.

Prepared devices get environment variables and a mounted JSON file, never device nodes, so the
specs run in a real container runtime on nodes without GPUs.

A driver name given with the backend (``driver=...``) renames the driver of a one-driver profile.
"""

from __future__ import annotations

import logging
import math
import re
import tempfile
from pathlib import Path

from agent.core.backend import Backend, BackendOptions
from agent.core.clock import Clock, SystemClock
from agent.core.errors import ConfigError
from agent.core.logs import log_fields
from agent.core.sharing import ConsumableShares
from backends.fake.backend import FakeBackend, PrepareFaults, with_driver
from backends.fake.conditions import FaultError
from backends.fake.faults import FaultInjector
from backends.fake.profile import load_profile

# `driver` comes through `BackendOptions.driver_name`; it is listed so that it is accepted here.
SETTINGS = (
    "driver",
    "profile",
    "control",
    "prepare_fail",
    "prepare_fail_rate",
    "prepare_latency",
    "seed",
    "lost",
    "device_files",
    ConsumableShares.SETTING,
    "dynamic-mig",
)
DEVICE_FILES_DIR = "fake-devices"
SHARING_DIR = "fake-sharing"
DEFAULT_PROFILE = "mixed"


def default_control_path(node_name: str) -> str:
    """Where the control socket lives when ``control`` is not set."""
    return f"/tmp/dra-agent-fake-{node_name or 'node'}.sock"


def _float(key: str, text: str, low: float, high: float) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not low <= value <= high:
        raise ConfigError(f"--backend fake setting {key}", text, f"a number from {low:g} to {high:g}")
    return value


def prepare_faults(settings: dict[str, str]) -> PrepareFaults:
    """Parse the prepare fault settings."""
    # '+' separates names: ',' already separates the settings of --backend.
    names = frozenset(n.strip() for n in re.split(r"[+,\s]", settings.get("prepare_fail", "")) if n.strip())
    seed_text = settings.get("seed", "0")
    if not seed_text.lstrip("-").isdigit():
        raise ConfigError("--backend fake setting seed", seed_text, "an integer")
    return PrepareFaults(
        fail_devices=names - {"*"},
        fail_all="*" in names,
        fail_rate=_float("prepare_fail_rate", settings.get("prepare_fail_rate", "0"), 0.0, 1.0),
        latency=_float("prepare_latency", settings.get("prepare_latency", "0"), 0.0, 3600.0),
        seed=int(seed_text),
    )


def device_files_root(settings: dict[str, str], state_dir: Path | None) -> Path | None:
    """Where the device description files go; None: none are written."""
    value = settings.get("device_files", "")
    if value == "off" or (not value and state_dir is None):
        return None
    if not value:
        return Path(state_dir or ".") / DEVICE_FILES_DIR
    if not value.startswith("/"):
        raise ConfigError("--backend fake setting device_files", value, "an absolute directory or off")
    return Path(value)


def create_backend(options: BackendOptions, clock: Clock | None = None) -> list[Backend]:
    """One `FakeBackend` per driver of the profile, sharing one fault injector and control socket."""
    settings = dict(options.settings)
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise ConfigError(
            f"--backend fake setting {unknown[0]}",
            settings[unknown[0]],
            f"one of the settings {', '.join(SETTINGS)}",
        )
    profile = load_profile(settings.get("profile", DEFAULT_PROFILE))
    control = settings.get("control", default_control_path(options.node_name))
    faults = prepare_faults(settings)
    dynamic = settings.get("dynamic-mig", "false").lower()
    if dynamic not in ("true", "false"):
        raise ConfigError("--backend fake setting dynamic-mig", dynamic, "true or false")
    files = device_files_root(settings, options.state_dir)
    shares = ConsumableShares.parse(
        settings.get(ConsumableShares.SETTING, "disabled"),
        f"--backend fake setting {ConsumableShares.SETTING}",
    )
    if dynamic == "true" and shares.enabled and any(d.vendor == "nvidia" for d in profile.drivers):
        logging.getLogger("agent.fake").warning(
            "consumable-shares with dynamic-mig=true: partitionable GPUs and their MIG placements "
            "are published for exclusive use, never shared; the other devices are shared as set",
            extra=log_fields(consumable_shares=settings[ConsumableShares.SETTING], dynamic_mig="true"),
        )
    sharing_root = Path(options.state_dir or tempfile.gettempdir()) / SHARING_DIR
    if options.driver_name and len(profile.drivers) != 1:
        raise ConfigError(
            "--backend fake driver",
            options.driver_name,
            f"no driver name: profile {profile.source} has {len(profile.drivers)} drivers "
            "(a driver name only renames the driver of a one-driver profile)",
        )
    clock = clock or SystemClock()
    injector = FaultInjector(clock=clock, control_path="" if control == "off" else control)
    backends: list[Backend] = []
    for driver in profile.drivers:
        name = options.driver_name or driver.name
        devices = with_driver(driver.devices, name) if name != driver.name else list(driver.devices)
        partitions = None
        if dynamic == "true" and driver.vendor == "nvidia":
            # Imported when used (dynamic-mig=true only): ~15 ms at start.
            from backends.fake.dynamicmig import FakeDynamicMig

            partitions = FakeDynamicMig()
            devices = partitions.partition(devices)
        backends.append(
            FakeBackend(
                name,
                devices,
                injector,
                vendor=driver.vendor,
                prepare_faults=faults,
                clock=clock,
                device_files=files / name if files is not None else None,
                shares=shares,
                sharing_root=sharing_root / name,
                partitions=partitions,
                health_interval=options.health_interval,
            )
        )
    for name in [n for n in settings.get("lost", "").split("+") if n]:
        try:
            injector.find(name).lose_at_first_pass(name)
        except FaultError as error:
            raise ConfigError(
                "--backend fake setting lost", name, f"a device of the profile ({error})"
            ) from None
    return backends


__all__ = ["DEFAULT_PROFILE", "FakeBackend", "FaultInjector", "create_backend", "default_control_path"]
