"""Agent configuration: one table of options, each a flag and an environment variable.

The table feeds the CLI (`agent.cli`), the README's configuration reference and validation:
a bad value raises `ConfigError` naming the flag, the value and what is accepted.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from agent.core.backend import DEFAULT_HEALTH_INTERVAL
from agent.core.errors import ConfigError
from agent.core.logs import LOG_FORMATS, LOG_LEVELS
from agent.core.model import check_driver_name, is_dns_subdomain
from agent.observe.address import DEFAULT_METRICS_PORT

"""Ours: clashes neither with dcgm-exporter (9400) nor with AMD's metrics exporter (5000)."""

KUBE_MODES = ("auto", "in-cluster", "kubeconfig", "none")
OPTIONAL_SETTING = "optional"
"""Backend setting for mixed fleets: ``optional=true`` skips a backend whose library or devices are absent."""
_BACKEND_NAME = re.compile(r"^[a-z][a-z0-9_-]*$")


@dataclass(frozen=True)
class BackendSpec:
    """One backend to run: its name and its settings (``driver`` sets the driver name)."""

    name: str
    settings: Mapping[str, str] = field(default_factory=dict)

    @property
    def driver_name(self) -> str | None:
        return self.settings.get("driver")

    @property
    def optional(self) -> bool:
        """``optional=true``: absent library or devices on this node skip the backend instead of failing."""
        return self.settings.get(OPTIONAL_SETTING) == "true"

    @property
    def backend_settings(self) -> dict[str, str]:
        """The settings the backend itself reads (the agent's own ``optional`` left out)."""
        return {k: v for k, v in self.settings.items() if k != OPTIONAL_SETTING}


@dataclass(frozen=True)
class AgentConfig:
    """Everything `dra-agent run` needs; see `OPTIONS` for meanings and defaults."""

    node_name: str = "demo-node"
    backends: tuple[BackendSpec, ...] = (BackendSpec("fake", {"profile": "mixed"}),)
    registry_dir: Path = Path("/var/lib/kubelet/plugins_registry")
    plugins_dir: Path = Path("/var/lib/kubelet/plugins")
    cdi_root: Path = Path("/var/run/cdi")
    state_dir: Path = Path("/var/lib/dra-agent")
    metrics_address: str = f"0.0.0.0:{DEFAULT_METRICS_PORT}"
    log_format: str = "keyvalue"
    log_level: str = "info"
    kube_mode: str = "auto"
    kubeconfig: Path | None = None
    pod_uid: str = ""
    taint_policy: Path | None = None
    taint_hold_seconds: float = 60.0
    health_debounce_seconds: float = 0.05
    resync_seconds: float = 300.0
    watch_timeout_seconds: float = 300.0
    telemetry_interval_seconds: float = 10.0
    health_interval_seconds: float = DEFAULT_HEALTH_INTERVAL
    serve_kubelet: bool = True
    print_for: str = "1.36"


def parse_backend_spec(text: str) -> BackendSpec:
    """``NAME[:key=value,key=value]``, e.g. ``fake:profile=mixed`` or ``nvidia:driver=gpu.nvidia.com``."""
    name, _, rest = text.strip().partition(":")
    if not _BACKEND_NAME.match(name):
        raise ConfigError("--backend", text, "NAME[:key=value,...] with NAME such as fake, nvidia or amd")
    settings: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ConfigError("--backend", text, f"key=value settings after ':', got {item!r}")
        settings[key.strip()] = value.strip()
    if settings.get(OPTIONAL_SETTING, "true") not in ("true", "false"):
        raise ConfigError("--backend", text, f"{OPTIONAL_SETTING}=true or {OPTIONAL_SETTING}=false")
    driver = settings.get("driver")
    if driver is not None and (problem := check_driver_name(driver)):
        raise ConfigError("--backend", text, f"a driver name that {problem}")
    return BackendSpec(name, settings)


def _backends(text: str) -> tuple[BackendSpec, ...]:
    # Several specs are separated by ';' (or given as repeated flags).
    specs = tuple(parse_backend_spec(p) for p in text.split(";") if p.strip())
    if not specs:
        raise ConfigError("--backend", text, "at least one backend, e.g. fake:profile=mixed")
    return specs


def _node_name(text: str) -> str:
    if not is_dns_subdomain(text):
        raise ConfigError("--node-name", text, "a Kubernetes node name (DNS subdomain, lower case)")
    return text


PRINT_FOR_VERSIONS = ("1.34", "1.35", "1.36", "1.37")


def _choice(flag: str, choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ConfigError(flag, text, "one of " + ", ".join(choices))
        return text

    return parse


def _seconds(flag: str, minimum: float = 0.0) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise ConfigError(flag, text, "a number of seconds") from None
        # inf would never lift a taint or never publish: a finite bound is always meant.
        if not math.isfinite(value) or value < minimum:
            raise ConfigError(flag, text, f"a finite number of seconds >= {minimum}")
        return value

    return parse


def _address(text: str) -> str:
    _host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(
            "--metrics-address", text, "HOST:PORT such as 0.0.0.0:9478 (port 0 picks a free one)"
        )
    return text


def _bool(flag: str) -> Callable[[str], bool]:
    def parse(text: str) -> bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(flag, text, "true or false")

    return parse


def _pod_uid(text: str) -> str:
    if text and not re.match(r"^[0-9a-fA-F-]{1,64}$", text):
        raise ConfigError("--pod-uid", text, "the pod's UID from the downward API (metadata.uid)")
    return text


@dataclass(frozen=True)
class Option:
    """One configuration option: config field, flag, environment variable, parser and help."""

    field: str
    flag: str
    env: str
    parse: Callable[[str], Any]
    help: str


OPTIONS: tuple[Option, ...] = (
    Option(
        "node_name", "--node-name", "NODE_NAME", _node_name, "name of this node (pool name of our slices)"
    ),
    Option(
        "backends",
        "--backend",
        "DRA_AGENT_BACKENDS",
        _backends,
        "backends to run, NAME[:key=value,...] separated by ';' or repeated: fake:profile=mixed, "
        "nvidia, amd; 'driver=' sets the driver name",
    ),
    Option(
        "registry_dir",
        "--registry-dir",
        "KUBELET_REGISTRAR_DIRECTORY_PATH",
        Path,
        "kubelet plugin registry directory",
    ),
    Option(
        "plugins_dir",
        "--plugins-dir",
        "KUBELET_PLUGINS_DIRECTORY_PATH",
        Path,
        "kubelet plugins directory (our DRA sockets go to <dir>/<driver>/)",
    ),
    Option("cdi_root", "--cdi-root", "CDI_ROOT", Path, "directory for the per-claim CDI spec files"),
    Option(
        "state_dir", "--state-dir", "DRA_AGENT_STATE_DIR", Path, "directory of the prepared-claims checkpoint"
    ),
    Option(
        "metrics_address",
        "--metrics-address",
        "DRA_AGENT_METRICS_ADDRESS",
        _address,
        "HOST:PORT of /metrics, /healthz and /readyz",
    ),
    Option(
        "log_format",
        "--log-format",
        "DRA_AGENT_LOG_FORMAT",
        _choice("--log-format", LOG_FORMATS),
        "keyvalue or json",
    ),
    Option(
        "log_level",
        "--log-level",
        "DRA_AGENT_LOG_LEVEL",
        _choice("--log-level", LOG_LEVELS),
        "debug, info, warning or error",
    ),
    Option(
        "kube_mode",
        "--kube",
        "DRA_AGENT_KUBE",
        _choice("--kube", KUBE_MODES),
        "API server access: auto (in-cluster if possible, else kubeconfig), in-cluster, kubeconfig, "
        "or none (print the slices instead of publishing)",
    ),
    Option("kubeconfig", "--kubeconfig", "KUBECONFIG", Path, "kubeconfig file (with --kube kubeconfig/auto)"),
    Option(
        "pod_uid",
        "--pod-uid",
        "POD_UID",
        _pod_uid,
        "the agent pod's UID: enables rolling-update socket names and the prepare file lock",
    ),
    Option(
        "taint_policy",
        "--taint-policy",
        "DRA_AGENT_TAINT_POLICY",
        Path,
        "YAML file overriding the health-condition to taint policy",
    ),
    Option(
        "taint_hold_seconds",
        "--taint-hold",
        "DRA_AGENT_TAINT_HOLD_SECONDS",
        _seconds("--taint-hold"),
        "seconds a device must stay healthy before its taint is lifted",
    ),
    Option(
        "health_debounce_seconds",
        "--health-debounce",
        "DRA_AGENT_HEALTH_DEBOUNCE_SECONDS",
        _seconds("--health-debounce"),
        "coalescing window for bursts of health events",
    ),
    Option(
        "resync_seconds",
        "--resync",
        "DRA_AGENT_RESYNC_SECONDS",
        _seconds("--resync", 1.0),
        "resync interval of the slices (re-read of the API server's version and the Node; each wait is "
        "drawn over [0.5, 1.5) of it so a fleet does not resync in step)",
    ),
    Option(
        "watch_timeout_seconds",
        "--watch-timeout",
        "DRA_AGENT_WATCH_TIMEOUT_SECONDS",
        _seconds("--watch-timeout", 1.0),
        "base timeout of the slice watch: each watch lasts between 1x and 2x of it (as client-go's "
        "reflector), then resumes without a LIST",
    ),
    Option(
        "telemetry_interval_seconds",
        "--telemetry-interval",
        "DRA_AGENT_TELEMETRY_INTERVAL_SECONDS",
        _seconds("--telemetry-interval", 0.1),
        "device telemetry read interval",
    ),
    Option(
        "health_interval_seconds",
        "--health-interval",
        "DRA_AGENT_HEALTH_INTERVAL_SECONDS",
        _seconds("--health-interval", 0.1),
        "seconds between two health passes (polled checks: the GPU answers, ECC, row remapping, trends)",
    ),
    Option(
        "serve_kubelet",
        "--serve-kubelet",
        "DRA_AGENT_SERVE_KUBELET",
        _bool("--serve-kubelet"),
        "serve the kubelet registration and DRA sockets",
    ),
    Option(
        "print_for",
        "--print-for",
        "DRA_AGENT_PRINT_FOR",
        _choice("--print-for", PRINT_FOR_VERSIONS),
        "with --kube none: print the slices as published to this Kubernetes release (1.34, 1.35, 1.36, 1.37)",
    ),
)


def build_config(
    flags: Mapping[str, str | list[str] | None], env: Mapping[str, str] | None = None
) -> AgentConfig:
    """Build the config: flags win over environment variables, which win over defaults.

    `flags` maps config field names to raw strings (a list for repeated ``--backend``).
    """
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for option in OPTIONS:
        raw = flags.get(option.field)
        if isinstance(raw, list):
            raw = ";".join(raw) if raw else None
        if raw is None:
            raw = env.get(option.env)
            if raw is not None and option.field == "kubeconfig" and not raw:
                raw = None
        if raw is None:
            continue
        try:
            values[option.field] = option.parse(raw)
        except ConfigError as error:
            if raw is not flags.get(option.field) and option.env in env and env[option.env] == raw:
                raise ConfigError(f"{error.option} (from ${option.env})", raw, error.accepted) from None
            raise
    known = {f.name for f in fields(AgentConfig)}
    return AgentConfig(**{k: v for k, v in values.items() if k in known})
