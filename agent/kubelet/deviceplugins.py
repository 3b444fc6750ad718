"""Coexistence guard: is a device plugin of the same vendor registered with this kubelet?

Device plugins serve a socket in the kubelet's ``device-plugins`` directory (next to ``plugins``):
NVIDIA's ``nvidia-gpu.sock`` (``nvidia-mig-*.sock`` with MIG strategies), AMD's ``amdgpu*.sock``...
A socket whose name holds our driver's vendor (the label before the top-level domain,
``gpu.nvidia.com`` -> ``nvidia``) means both may hand out the same GPUs unless the device plugin's
GPUs are excluded from our slices (``exclude-devices=``). The agent says so once at start: a
``dra_agent_device_plugin_present`` series per socket, a log line and an Event.
"""

from __future__ import annotations

import logging
import stat
from pathlib import Path
from typing import Protocol

import anyio.to_thread

from agent.core.logs import log_fields
from agent.observe.metrics import Metrics

log = logging.getLogger("agent.kubelet.deviceplugins")

DEVICE_PLUGINS_DIR = "device-plugins"
KUBELET_SOCKET = "kubelet.sock"
"""The kubelet's own registration socket in that directory."""


class EventRecorder(Protocol):
    """Records a Kubernetes Event about the agent (`agent.kube.events.EventRecorder`)."""

    async def record(self, reason: str, message: str, type: str) -> object: ...


def device_plugins_dir(plugins_dir: Path) -> Path:
    """The kubelet's device-plugins directory next to its plugins directory."""
    return plugins_dir.parent / DEVICE_PLUGINS_DIR


def vendor_of(driver: str) -> str:
    """``gpu.nvidia.com`` -> ``nvidia``; a one-label name is its own vendor."""
    labels = driver.lower().split(".")
    return labels[-2] if len(labels) >= 2 else labels[0]


def find_device_plugins(directory: Path, driver: str) -> list[str]:
    """Names of the sockets in `directory` that belong to a device plugin of `driver`'s vendor."""
    vendor = vendor_of(driver)
    found = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return []  # no device-plugins directory (not mounted, no kubelet): nothing registered
    for entry in entries:
        try:
            is_socket = stat.S_ISSOCK(entry.lstat().st_mode)
        except OSError:
            continue
        if is_socket and entry.name != KUBELET_SOCKET and vendor in entry.name.lower():
            found.append(entry.name)
    return sorted(found)


async def report_device_plugins(
    driver: str,
    directory: Path,
    metrics: Metrics,
    events: EventRecorder | None,
    *,
    excluding: bool,
) -> list[str]:
    """Look once for device plugins of `driver`'s vendor; say so with a metric, a log line and an Event."""
    sockets = await anyio.to_thread.run_sync(find_device_plugins, directory, driver)
    for socket in sockets:
        metrics.device_plugins.labels(driver, socket).set(1)
    if not sockets:
        return sockets
    advice = (
        "the GPUs listed in exclude-devices are left to it"
        if excluding
        else "both may hand out the same GPUs: set exclude-devices= on the backend for the GPUs the "
        "device plugin keeps, or remove the device plugin (README: Migrating from the device plugin)"
    )
    message = f"device plugin {', '.join(sockets)} is registered with this kubelet next to {driver}; {advice}"
    log.warning("device plugin of the same vendor present", extra=log_fields(driver=driver, detail=message))
    if events is not None:
        try:
            await events.record("DevicePluginPresent", message, "Normal" if excluding else "Warning")
        except Exception as error:  # an Event is a courtesy; never fail start over it
            log.warning("cannot record event", extra=log_fields(error=repr(error)))
    return sockets
