"""Test trees laid out like a GPU node: a driver root as the driver's installer leaves it, CDI specs."""

from __future__ import annotations

import json
import logging
from pathlib import Path

VERSION = "550.54.15"
LIBDIR = "usr/lib/x86_64-linux-gnu"
# The driver's own libraries (the versioned files), as a 550 installer leaves them.
DRIVER_LIBRARIES = (
    "libcuda",
    "libnvidia-ml",
    "libnvidia-ptxjitcompiler",
    "libnvidia-gpucomp",
    "libnvidia-nvvm",
    "libnvidia-opticalflow",
    "libGLX_nvidia",
    "libEGL_nvidia",
)
# Each library's SONAME link (.so.1, .so.0 for GLX/EGL) and, for some, its development link (.so).
SONAMES = {"libGLX_nvidia": "so.0", "libEGL_nvidia": "so.0", "libnvidia-nvvm": "so.4"}
DEV_LINKS = ("libcuda", "libnvidia-ml", "libnvidia-ptxjitcompiler")


def make_driver_root(
    root: Path, *, hook: str | None = "usr/bin/nvidia-cdi-hook", host: Path | None = None
) -> Path:
    """A driver root under `root`: libraries with their links, binaries, vendor files, a socket.

    `hook` is where the toolkit's hook binary is installed below `host` (default: `root`).
    """
    libdir = root / LIBDIR
    libdir.mkdir(parents=True)
    for lib in DRIVER_LIBRARIES:
        real = f"{lib}.so.{VERSION}"
        (libdir / real).write_bytes(b"\x7fELF")
        soname = f"{lib}.{SONAMES.get(lib, 'so.1')}"
        (libdir / soname).symlink_to(real)
        if lib in DEV_LINKS:
            (libdir / f"{lib}.so").symlink_to(soname)
    (libdir / "vdpau").mkdir()
    (libdir / "vdpau" / f"libvdpau_nvidia.so.{VERSION}").write_bytes(b"\x7fELF")
    for other in ("libc.so.6", "libz.so.1", "libnvidia-egl-wayland.so.1.1.13"):  # not the driver's
        (libdir / other).write_bytes(b"\x7fELF")
    (root / "usr" / "bin").mkdir(parents=True, exist_ok=True)
    for binary in ("nvidia-smi", "nvidia-debugdump"):
        (root / "usr" / "bin" / binary).write_bytes(b"#!")
    vulkan = root / "usr" / "share" / "vulkan" / "icd.d"
    vulkan.mkdir(parents=True)
    (vulkan / "nvidia_icd.json").write_text("{}")
    egl = root / "usr" / "share" / "glvnd" / "egl_vendor.d"
    egl.mkdir(parents=True)
    (egl / "10_nvidia.json").write_text("{}")
    (root / "run" / "nvidia-persistenced").mkdir(parents=True)
    (root / "run" / "nvidia-persistenced" / "socket").touch()
    if hook is not None:
        path = (host or root) / hook
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\x7fELF")
    return root


def write_toolkit_spec(
    directory: Path, names: list[str], *, name: str = "nvidia.yaml", kind: str = "nvidia.com/gpu"
) -> Path:
    """A spec as ``nvidia-ctk cdi generate`` writes it (JSON is valid YAML, so one format serves)."""
    directory.mkdir(parents=True, exist_ok=True)
    devices = [{"name": n, "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}} for n in names]
    spec = {"cdiVersion": "0.5.0", "kind": kind, "devices": devices, "containerEdits": {}}
    path = directory / name
    path.write_text(json.dumps(spec))
    return path


def logged(records: list[logging.LogRecord], message: str) -> dict[str, object]:
    """The structured fields of the one log record whose message starts with `message`."""
    found = [r for r in records if r.getMessage().startswith(message)]
    assert len(found) == 1, [r.getMessage() for r in records]
    fields = getattr(found[0], "fields", {})
    assert isinstance(fields, dict)
    return fields
