"""The NVIDIA driver's user-space files, found the way the NVIDIA Container Toolkit finds them.

The toolkit (``pkg/nvcdi/driver-nvml.go``) mounts every library of the driver's library
directory whose name ends in the driver version (``libcuda.so.550.54.15``, ``libnvidia-ml``,
``libnvidia-ptxjitcompiler``, ``libnvidia-gpucomp``, ``libnvcuvid``, ``libGLX_nvidia``...), the
driver's binaries, the graphics vendor files (EGL, Vulkan ICDs) and the IPC sockets, each at its
path below the driver root; then its ``nvidia-cdi-hook`` runs ``update-ldcache`` (ldconfig in the
container, which also makes the ``.so.1`` links) and ``create-symlinks`` (``libcuda.so`` ->
``libcuda.so.1``). We do the same. Without the hook binary on the host nothing can run
ldconfig in the container, so the ``.so.1`` and ``.so`` links are mounted too: the libraries are
then found in images whose default library path holds the host's library directory.

Paths: files are looked up through the agent's view of the host (`HostView`) and named in
the edits by their host path, because the container runtime resolves them on the host.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from agent.core.backend import Hook, Mount
from agent.core.errors import BackendError
from backends.nvidia.nvml import find_library_dir

DEFAULT_HOOK_PATH = "/usr/bin/nvidia-cdi-hook"
MAX_SYMLINK_HOPS = 256
CREATE_CONTAINER = "createContainer"
BINARIES = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
)
BINARY_DIRS = ("usr/bin", "usr/sbin", "bin", "sbin")
# Graphics vendor files, looked up under etc/ then usr/share/ (the toolkit's config locator).
CONFIG_FILES = (
    "glvnd/egl_vendor.d/10_nvidia.json",
    "egl/egl_external_platform.d/15_nvidia_gbm.json",
    "egl/egl_external_platform.d/10_nvidia_wayland.json",
    "nvidia/nvoptix.bin",
    "vulkan/icd.d/nvidia_icd.json",
    "vulkan/implicit_layer.d/nvidia_layers.json",
)
CONFIG_DIRS = ("etc", "usr/share")
IPC_SOCKETS = ("run/nvidia-persistenced/socket", "run/nvidia-fabricmanager/socket")
# Libraries a CUDA/NVML container cannot work without: a driver root lacking them is reported.
REQUIRED_LIBRARIES = ("libcuda.so", "libnvidia-ml.so")
_VERSION = re.compile(r"^lib(?:nvidia-ml|cuda)\.so\.(\d+\.\d+(?:\.\d+)?)$")
# Links the toolkit's create-symlinks hook adds: (library prefix, link target, link name).
_EXTRA_LINKS = (
    ("libcuda.so.", "libcuda.so.1", "libcuda.so"),
    ("libnvidia-opticalflow.so.", "libnvidia-opticalflow.so.1", "libnvidia-opticalflow.so"),
    ("libGLX_nvidia.so.", "", "libGLX_indirect.so.0"),
)


@dataclass(frozen=True)
class HostView:
    """The host's filesystem as the agent sees it: `root` is where the host's ``/`` is mounted."""

    root: Path = Path("/")

    def view(self, host_path: str | PurePosixPath) -> Path:
        """Where the agent reads the host's `host_path` (blocking: reads symlinks).

        The host's symlinks are followed inside `root`: an absolute one (Ubuntu's ``/var/run ->
        /run``) names a host path, which read as is would leave the host's tree.
        """
        if self.root == Path("/"):
            return Path(host_path)
        pending = [p for p in PurePosixPath(host_path).parts if p != "/"]
        resolved = PurePosixPath("/")
        for _ in range(MAX_SYMLINK_HOPS):
            if not pending:
                break
            part = pending.pop(0)
            candidate = resolved.parent if part == ".." else resolved / part
            seen = self.root / str(candidate).lstrip("/")
            if part != ".." and seen.is_symlink():
                target = PurePosixPath(os.readlink(seen))
                pending = [p for p in target.parts if p != "/"] + pending
                resolved = PurePosixPath("/") if target.is_absolute() else resolved
                continue
            resolved = candidate
        return self.root / "/".join([*resolved.parts[1:], *pending])


@dataclass(frozen=True)
class DriverFiles:
    """What a container needs of the driver's user space, as CDI mounts and hooks."""

    version: str = ""
    mounts: tuple[Mount, ...] = ()
    hooks: tuple[Hook, ...] = ()
    library_dirs: tuple[str, ...] = ()
    """Container directories of the libraries."""
    missing: tuple[str, ...] = REQUIRED_LIBRARIES
    """Required libraries not found under the driver root."""
    hook_path: str = ""
    """The host path of the hook binary, empty when it is not installed."""


def driver_version(libdir: Path) -> str:
    """The driver version from the versioned NVML or CUDA library name, or "" when none."""
    for name in sorted(p.name for p in libdir.iterdir()):
        match = _VERSION.match(name)
        if match:
            return match.group(1)
    return ""


def hook(hook_path: str, name: str, args: list[str]) -> Hook:
    """A createContainer hook of the toolkit's hook CLI (``nvidia-ctk`` takes a ``hook`` subcommand)."""
    base = PurePosixPath(hook_path).name
    prefix = [base, "hook"] if base == "nvidia-ctk" else [base]
    return Hook(CREATE_CONTAINER, hook_path, (*prefix, name, *args))


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:
        return False


def find_driver_files(host: HostView, driver_root: str, hook_path: str = DEFAULT_HOOK_PATH) -> DriverFiles:
    """Look up the driver's files (blocking: run in a worker thread)."""
    root = PurePosixPath(driver_root)
    root_view = host.view(root)
    installed_hook = hook_path if hook_path and _is_file(host.view(hook_path)) else ""

    def mount(relative: PurePosixPath) -> Mount:
        return Mount(str(root / relative), "/" + str(relative))

    mounts: list[Mount] = []
    links: list[str] = []
    dirs: list[str] = []
    version = ""
    found: set[str] = set()
    libdir = find_library_dir(root_view)
    if libdir is not None:
        version = driver_version(libdir)
        rel_dir = PurePosixPath(libdir.relative_to(root_view).as_posix())
        suffix = f".so.{version}"
        for directory in (libdir, libdir / "vdpau"):
            if not version or not directory.is_dir():
                continue
            rel = PurePosixPath(directory.relative_to(root_view).as_posix())
            entries = sorted(directory.iterdir(), key=lambda p: p.name)
            libraries = [p.name for p in entries if p.name.endswith(suffix) and _is_file(p)]
            mounts += [mount(rel / name) for name in libraries]
            dirs += ["/" + str(rel)] if libraries else []
            found.update(name.removesuffix(version) for name in libraries)
            if not installed_hook:
                # No ldconfig in the container: bring the links that point at the libraries too.
                mounts += [
                    mount(rel / p.name)
                    for p in entries
                    if p.is_symlink() and _is_file(p) and p.resolve().name in libraries
                ]
        for prefix, target, name in _EXTRA_LINKS:
            library = next((n for n in sorted(found) if n.startswith(prefix)), None)
            if library is not None:
                links.append(f"{target or library + version}::/{rel_dir / name}")
    for binary in BINARIES:
        for sub in BINARY_DIRS:
            if _is_file(root_view / sub / binary):
                mounts.append(mount(PurePosixPath(sub) / binary))
                break
    for config in CONFIG_FILES:
        for sub in CONFIG_DIRS:
            if _is_file(root_view / sub / config):
                mounts.append(mount(PurePosixPath(sub) / config))
                break
    for socket in IPC_SOCKETS:
        if (root_view / socket).exists():
            mounts.append(mount(PurePosixPath(socket)))
    hooks: list[Hook] = []
    if installed_hook and dirs:
        hooks.append(hook(installed_hook, "update-ldcache", [a for d in dirs for a in ("--folder", d)]))
    if installed_hook and links:
        hooks.append(hook(installed_hook, "create-symlinks", [a for link in links for a in ("--link", link)]))
    missing = tuple(lib for lib in REQUIRED_LIBRARIES if lib + "." not in found)
    return DriverFiles(version, tuple(mounts), tuple(hooks), tuple(dirs), missing, installed_hook)


class DriverProgramMissingError(BackendError):
    """A driver program the agent runs (``nvidia-smi``, ``nvidia-cuda-mps-control``) is not installed."""


@dataclass(frozen=True)
class DriverProgram:
    """A driver program as the agent runs it: its path and what its environment needs."""

    path: str
    env: Mapping[str, str] = field(default_factory=dict)
    """``PATH`` (the control daemon starts ``nvidia-cuda-mps-server`` from its own directory) and
    ``LD_LIBRARY_PATH`` (the driver's libnvidia-ml), both under the driver root as the agent sees it."""

    def environ(self, base: Mapping[str, str]) -> dict[str, str]:
        """`base` with this program's directories put first."""
        merged = dict(base)
        for key, value in self.env.items():
            merged[key] = f"{value}:{base[key]}" if base.get(key) else value
        return merged


ProgramLocator = Callable[[], DriverProgram]
"""Finds a driver program (blocking: run in a worker thread); raises `DriverProgramMissingError`."""


def on_path(name: str) -> ProgramLocator:
    """A program run as named (on the agent's PATH, or an absolute path): tests and stand-ins."""
    return lambda: DriverProgram(name)


DRIVER_LIBRARY = re.compile(r"^lib(?:nvidia-[^/]*|cuda)\.so(?:\.[0-9.]+)?$")
"""The driver's own libraries: only these go on a driver program's library path, never the host's libc."""


def link_driver_libraries(libdir: Path, links: Path) -> None:
    """Fill `links` with links to the driver's libraries in `libdir` (blocking)."""
    links.mkdir(parents=True, exist_ok=True)
    wanted = {p.name: p for p in libdir.iterdir() if DRIVER_LIBRARY.match(p.name)}
    for old in links.iterdir():
        if old.name not in wanted or os.readlink(old) != str(wanted[old.name]):
            old.unlink()
    for name, target in wanted.items():
        if not (links / name).is_symlink():
            (links / name).symlink_to(target)


def driver_program(host: HostView, driver_root: str, name: str, links: Path) -> ProgramLocator:
    """`name` in the driver's binary directories under `driver_root` (a host path) as the agent sees it.

    The agent's image carries no driver: the chart mounts the host's ``/`` at ``/host``
    (``host-root``), and the driver is at ``driver-root`` below it, as for the CDI specs. The
    program's library path is `links`, a directory of links to the driver's libraries alone:
    the host's library directory itself also holds the host's libc, which must not replace the
    agent image's.
    """

    def locate() -> DriverProgram:
        root_view = host.view(PurePosixPath(driver_root))
        for sub in BINARY_DIRS:
            candidate = root_view / sub / name
            if _is_file(candidate) and os.access(candidate, os.X_OK):
                env = {"PATH": str(candidate.parent)}
                libdir = find_library_dir(root_view)
                if libdir is not None:
                    link_driver_libraries(libdir, links)
                    env["LD_LIBRARY_PATH"] = str(links)
                return DriverProgram(str(candidate), env)
        looked = ", ".join(str(root_view / sub) for sub in BINARY_DIRS)
        raise DriverProgramMissingError(
            f"NVIDIA backend: {name} is not installed under the driver root {driver_root} "
            f"(looked in {looked}); set the nvidia backend's driver-root to where the driver is "
            f"installed on the host and host-root to where the agent sees the host's / "
            f"(the chart: backends.nvidia.driverRoot, host-root=/host)"
        )

    return locate
