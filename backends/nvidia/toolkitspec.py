"""The NVIDIA Container Toolkit's CDI spec on the host: which ``nvidia.com/gpu`` devices it names.

``nvidia-ctk cdi generate`` (run by the toolkit's ``nvidia-cdi-refresh`` service, by hand, or by
the GPU Operator's toolkit container) writes one spec of kind ``nvidia.com/gpu``, usually
``/var/run/cdi/nvidia.yaml`` or ``/etc/cdi/nvidia.yaml`` (``nvidia-container-toolkit.json`` on
some distributions), so every spec file of those two directories (the CDI library's defaults) is
read and the kind decides. Devices are named by index (``0``, ``1:0`` for MIG) and, since the
toolkit's default became ``--device-name-strategy=index,uuid``, also by UUID (``GPU-...``,
``MIG-...``). Older ``nvidia-ctk`` names them by index only: such a spec cannot serve a claim,
because only the UUID says which GPU the claim got.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from agent.core.logs import log_fields
from backends.nvidia.driverfiles import HostView

log = logging.getLogger("agent.backends.nvidia")

TOOLKIT_KIND = "nvidia.com/gpu"
SPEC_DIRS = ("/etc/cdi", "/var/run/cdi")
SPEC_SUFFIXES = (".yaml", ".yml", ".json")
# Transient specs of DRA drivers (ours included) live next to the toolkit's: never the toolkit's.
TRANSIENT_PREFIX = "k8s."
MAX_SPEC_BYTES = 16 * 1024 * 1024
UUID_PREFIXES = ("GPU-", "MIG-")

_Loader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@dataclass(frozen=True)
class ToolkitDevices:
    """The ``nvidia.com/gpu`` device names of the toolkit's specs, and the files they came from."""

    files: tuple[str, ...] = ()
    names: frozenset[str] = frozenset()
    problems: tuple[str, ...] = ()
    """Spec files that could not be read, each with the reason."""

    @property
    def by_uuid(self) -> bool:
        """Whether the specs name devices by UUID (else by index only, or no spec at all)."""
        return any(n.startswith(UUID_PREFIXES) for n in self.names)

    def why_not(self, uuid: str) -> str:
        """Why ``nvidia.com/gpu=<uuid>`` cannot resolve, or "" when it can."""
        if uuid in self.names:
            return ""
        if not self.files:
            return (
                f"no NVIDIA Container Toolkit CDI spec (kind {TOOLKIT_KIND}) in {' or '.join(SPEC_DIRS)}: "
                "generate one with 'nvidia-ctk cdi generate --output=/var/run/cdi/nvidia.yaml' "
                "(or enable CDI in the GPU Operator)"
            )
        if not self.by_uuid:
            return (
                f"the toolkit's CDI spec {', '.join(self.files)} names devices by index only "
                "(an older nvidia-ctk): regenerate it with 'nvidia-ctk cdi generate "
                "--device-name-strategy=uuid --output=/var/run/cdi/nvidia.yaml'"
            )
        return (
            f"the toolkit's CDI spec {', '.join(self.files)} has no device {uuid}: it is older than the "
            "GPU (MIG) layout; regenerate it with 'nvidia-ctk cdi generate' (or restart nvidia-cdi-refresh)"
        )


def _spec_names(data: object) -> frozenset[str] | None:
    """Device names of a spec of the toolkit's kind; None for any other spec."""
    if not isinstance(data, dict) or data.get("kind") != TOOLKIT_KIND:
        return None
    devices = data.get("devices")
    if not isinstance(devices, list):
        return frozenset()
    return frozenset(str(d["name"]) for d in devices if isinstance(d, dict) and "name" in d)


class ToolkitSpecReader:
    """Reads the toolkit's specs through the agent's view of the host, re-parsing only changed files.

    Blocking: call through a worker thread.
    """

    def __init__(self, host: HostView, dirs: tuple[str, ...] = SPEC_DIRS) -> None:
        self.host = host
        self.dirs = dirs
        self._parsed: dict[str, tuple[tuple[int, int], frozenset[str] | None]] = {}

    def read(self) -> ToolkitDevices:
        files: list[str] = []
        names: set[str] = set()
        problems: list[str] = []
        parsed: dict[str, tuple[tuple[int, int], frozenset[str] | None]] = {}
        for directory in self.dirs:
            try:
                entries = sorted(os.scandir(self.host.view(directory)), key=lambda e: e.name)
            except OSError:
                continue  # a missing directory holds no spec
            for entry in entries:
                if entry.name.startswith((TRANSIENT_PREFIX, ".")) or not entry.name.endswith(SPEC_SUFFIXES):
                    continue
                host_path = f"{directory}/{entry.name}"
                try:
                    info = entry.stat()
                    key = (info.st_mtime_ns, info.st_size)
                    cached = self._parsed.get(host_path)
                    found = cached[1] if cached and cached[0] == key else self._parse(Path(entry.path), info)
                except (OSError, ValueError, RecursionError, yaml.YAMLError) as error:
                    problems.append(f"{host_path}: {error}")
                    continue
                parsed[host_path] = (key, found)
                if found is not None:
                    files.append(host_path)
                    names.update(found)
        self._parsed = parsed
        for problem in problems:
            log.warning("cannot read a CDI spec file", extra=log_fields(problem=problem))
        return ToolkitDevices(tuple(files), frozenset(names), tuple(problems))

    @staticmethod
    def _parse(path: Path, info: os.stat_result) -> frozenset[str] | None:
        if info.st_size > MAX_SPEC_BYTES:
            raise ValueError(f"larger than {MAX_SPEC_BYTES} bytes ({info.st_size}); not a CDI spec")
        with path.open("rb") as stream:
            text = stream.read(MAX_SPEC_BYTES + 1)
        if len(text) > MAX_SPEC_BYTES:
            raise ValueError(f"larger than {MAX_SPEC_BYTES} bytes; not a CDI spec")
        # JSON is YAML: one loader serves both formats.
        return _spec_names(yaml.load(text, Loader=_Loader))
