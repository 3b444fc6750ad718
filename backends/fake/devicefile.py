"""What a container gets for a fake device: environment and a mounted JSON file, never a device node.

The fake backend runs in clusters without GPUs (kind-based CI): a CDI spec naming ``/dev/nvidia*``
or ``/dev/kfd`` makes the runtime stat host nodes that do not exist, and the pod never starts. So
the edits carry only what a test can check inside the container:

- one variable per device, ``FAKE_DEVICE_<DEVICE>_<HASH>=<driver>/<device>`` (`device_env_name`),
  and for NVIDIA profiles ``NVIDIA_VISIBLE_DEVICES=void`` as the real NVIDIA backend sets it. No
  variable lists devices: a container with several claims gets each claim's spec in turn and CDI
  keeps the last value of a variable (container-device-interface ``internal/ociedit/spec_editor.go``),
  so a per-claim list would show the last claim's devices only. Variables of their own per device
  never meet; a device shared by two claims gets the same variable and value from both.
  ``env | grep ^FAKE_DEVICE_`` lists them all;
- a read-only JSON file per device at ``/run/dra-fake/<driver>/<device>.json`` describing the device,
  the claim and the device nodes a real backend would have given. The agent writes it at prepare
  under its state directory (a host path, the same inside the agent's container) and removes it at
  unprepare.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

from agent.core.backend import ClaimRef
from agent.core.model import Device

DEVICE_ENV_PREFIX = "FAKE_DEVICE_"
NVIDIA_VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
NVIDIA_VOID = "void"
"""What the real NVIDIA backend sets (`backends.nvidia.edits`): the same in every claim's spec."""
CONTAINER_DIR = "/run/dra-fake"
_GPU_MINOR = re.compile(r"^gpu-(\d+)")
_NOT_NAME = re.compile(r"[^A-Z0-9]")


@functools.lru_cache(maxsize=4096)
def device_env_name(driver: str, device: str) -> str:
    """``FAKE_DEVICE_<DEVICE>_<HASH>``: the device name upper-cased, each other character ``_``, and 8
    hex digits of the SHA-256 of ``<driver>/<device>``, so that same-named devices of two drivers
    (two profiles can both have a ``gpu-0``) get variables of their own."""
    digest = hashlib.sha256(f"{driver}/{device}".encode()).hexdigest()[:8].upper()
    return f"{DEVICE_ENV_PREFIX}{_NOT_NAME.sub('_', device.upper())}_{digest}"


def device_env(driver: str, device: Device, vendor: str) -> dict[str, str]:
    """The environment a container gets for `device`: no value in it depends on the claim."""
    env = {device_env_name(driver, device.name): f"{driver}/{device.name}"}
    if vendor == "nvidia":
        env[NVIDIA_VISIBLE_DEVICES] = NVIDIA_VOID
    return env


def container_path(driver: str, device: str) -> str:
    """Where the container finds the description of `device`."""
    return f"{CONTAINER_DIR}/{driver}/{device}.json"


def host_path(root: Path, claim: ClaimRef, device: str) -> Path:
    """Where the agent writes the description of `device` for `claim` (``root`` is per driver).

    One flat directory: a directory per claim cost a mkdir and an rmdir per claim on the node's
    disk (~0.3 ms of a prepare, and contended in a burst).
    """
    return root / f"{claim.uid}-{device}.json"


def _legacy_host_path(root: Path, claim: ClaimRef, device: str) -> Path:
    """Where earlier agents wrote it (a directory per claim): claims they prepared are removed from there."""
    return root / claim.uid / f"{device}.json"


def real_device_nodes(device: Device, vendor: str) -> list[str]:
    """The device nodes the vendor's real backend would give (described, never injected)."""
    if vendor == "nvidia":
        match = _GPU_MINOR.match(device.parent or device.name)
        minor = int(match.group(1)) if match else 0
        nodes = [f"/dev/nvidia{minor}", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
        if device.attributes.get("type") == "mig":
            nodes.append(f"/dev/nvidia-caps/nvidia-cap{minor * 9 + 1}")
        return nodes
    if vendor == "amd":
        render = device.attributes.get("renderIndex", 128)
        card = device.attributes.get("cardIndex", 0)
        return ["/dev/kfd", f"/dev/dri/renderD{render}", f"/dev/dri/card{card}"]
    return []


def describe_device(device: Device, vendor: str) -> dict[str, Any]:
    """What the document of `device` says whatever the claim (the backend keeps it per device:
    rendering capacities as quantities cost ~30 us per prepare)."""
    return {
        "driver": device.driver,
        "device": device.name,
        "vendor": vendor,
        "uuid": device.uuid,
        "parent": device.parent,
        "attributes": {
            k: v if isinstance(v, bool | int | str) else str(v) for k, v in sorted(device.attributes.items())
        },
        "capacity": {k: str(v) for k, v in sorted(device.capacity.items())},
        "realDeviceNodes": real_device_nodes(device, vendor),
    }


def describe(description: dict[str, Any], claim: ClaimRef) -> dict[str, Any]:
    """The JSON document a container reads: the device's `describe_device` and its claim."""
    return {**description, "claim": {"namespace": claim.namespace, "name": claim.name, "uid": claim.uid}}


def write_device_file(path: Path, document: dict[str, Any]) -> None:
    """Write `document` at `path`, readable by any container user (blocking).

    Written in place, not renamed over: the container mounts it only once the prepare is done,
    and a prepare done again writes the same content.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    # Compact: an indent switches json to its pure-Python encoder.
    data = (json.dumps(document, separators=(",", ":")) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        os.fchmod(fd, 0o644)  # whatever the agent's umask
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def remove_device_file(root: Path, claim: ClaimRef, device: str) -> None:
    """Remove the file (and, where an older agent wrote it, its claim directory); missing is fine."""
    host_path(root, claim, device).unlink(missing_ok=True)
    legacy = _legacy_host_path(root, claim, device)
    legacy.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # other devices of the claim remain, or it never existed
        legacy.parent.rmdir()
