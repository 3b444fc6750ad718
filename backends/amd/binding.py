"""Which `amdsmi` Python binding the backend loads, and whether it matches the host's library.

AMD's binding (``amdsmi_wrapper.py``) binds every symbol of ``libamd_smi.so`` at import, so a
binding newer than the library fails with ``AttributeError: undefined symbol`` and one older
misreads structures that grew. The pair must come from one ROCm release. As AMD's own ``amd-smi``
does, the backend prefers the binding that ships with the host's ROCm (``<rocm>/share/amd_smi``,
where ``<rocm>`` is ``$ROCM_PATH``, else ``/opt/rocm``: the chart mounts the host's ROCm there),
and falls back to the one pinned in the image (``dra-agent[amd]``). It then compares the
library's version (``amdsmi_get_lib_version``) with the binding's.

The wrapper prints to stdout when it cannot find the library; the import runs with stdout
pointed at stderr, so ``dra-agent devices -o yaml`` prints nothing but YAML.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from agent.core.errors import AgentError, BackendError, ConfigError
from agent.core.logs import log_fields

log = logging.getLogger("agent.backends.amd")

DEFAULT_ROCM = "/opt/rocm"
HOST_BINDING = Path("share") / "amd_smi"
"""Where a ROCm installation keeps its amdsmi Python package (relative to the ROCm directory)."""

# libamd_smi's major version per ROCm release of the binding (AMD's release notes: AMD SMI 26.0.2
# in ROCm 7.0.2, 25.3.0 in 6.4.0, 24.5.1 in 6.1.1; 6.2-6.3 kept the 24 line). Keys are
# (major, minor) or (major,) for a whole ROCm major.
LIB_MAJOR_BY_ROCM: dict[tuple[int, ...], int] = {(6, 2): 24, (6, 3): 24, (6, 4): 25, (7,): 26}

# What the backend cannot work without; an amdsmi without these is too old (ROCm < 6.2).
REQUIRED_NAMES = (
    "amdsmi_init",
    "amdsmi_shut_down",
    "amdsmi_get_processor_handles",
    "amdsmi_get_gpu_device_bdf",
    "amdsmi_get_gpu_asic_info",
    "amdsmi_get_gpu_kfd_info",
    "AmdSmiEventReader",
    "AmdSmiEvtNotificationType",
    "AmdSmiGpuBlock",
    "AmdSmiInitFlags",
    "AmdSmiException",
    "AmdSmiLibraryException",
)

INSTALL_HINT = (
    "install ROCm 6.2 or newer on the node (it provides libamd_smi.so and the amdsmi Python package), "
    "with the amdsmi Python package of the same version ('pip install dra-agent[amd]'), or mount the "
    "host's ROCm directory into the agent's container at /opt/rocm (or set ROCM_PATH to it)"
)
PAIR_HINT = (
    "use the binding of the host's ROCm (mount the host's ROCm directory at /opt/rocm: its "
    "share/amd_smi is preferred) or install the matching binding in the image "
    "(pip install 'amdsmi==<the host's ROCm version>')"
)


class BindingMismatchError(BackendError, ConfigError):
    """The amdsmi binding and the host's libamd_smi.so are not one ROCm release: a deployment
    error (exit 2 in ``dra-agent devices``; an optional backend is not served, a required one fails)."""

    def __init__(self, message: str, library: str, binding: str) -> None:
        AgentError.__init__(self, message)
        self.option, self.value, self.accepted = "libamd_smi.so", library, f"the library of amdsmi {binding}"


def rocm_dir() -> Path:
    """The ROCm directory the wrapper loads ``lib/libamd_smi.so`` from first."""
    return Path(os.environ.get("ROCM_HOME") or os.environ.get("ROCM_PATH") or DEFAULT_ROCM)


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """The wrapper's ``print``s (and the C library's) go to stderr, not into the command's output."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no file descriptor 1 (an embedded interpreter): redirect Python's only
        with contextlib.redirect_stdout(sys.stderr):
            yield
        return
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _host_binding() -> Path | None:
    candidate = rocm_dir() / HOST_BINDING
    return candidate if (candidate / "amdsmi" / "__init__.py").is_file() else None


def _import(import_module: Callable[[str], Any], host: Path | None) -> Any:
    if host is None:
        return import_module("amdsmi")
    sys.path.insert(0, str(host))
    try:
        return import_module("amdsmi")
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(str(host))


def import_amdsmi(import_module: Callable[[str], Any] = importlib.import_module) -> Any:
    """Import the `amdsmi` binding (the host ROCm's, else the image's), or raise `BackendError`
    saying what to install or mount. Never prints to stdout."""
    host = _host_binding()
    where = f"the host ROCm's binding ({host})" if host else "the image's amdsmi binding"
    try:
        with _stdout_to_stderr():
            module = _import(import_module, host)
    except KeyError as error:
        # amdsmi 7 looks the shared library up in a dict of found libraries at import time.
        missing = error.args[0] if error.args else "libamd_smi.so"
        raise BackendError(
            f"amd backend: ROCm library {missing} was not found under {rocm_dir()}/lib: {INSTALL_HINT}"
        ) from error
    except AttributeError as error:
        # The wrapper binds every symbol at import: the library is older than the binding.
        binding, library = _binding_version(import_module), _library_version()
        raise BindingMismatchError(
            f"amd backend: libamd_smi {library or 'of unknown version'} ({rocm_dir()}/lib/libamd_smi.so)"
            f" lacks a function {where} (amdsmi {binding}) needs ({_symbol(error)}): the library is"
            f" older than the binding; {PAIR_HINT}",
            library or "unknown",
            binding,
        ) from error
    except ImportError as error:
        raise BackendError(
            f"amd backend: the amdsmi Python package cannot be imported ({error}): {INSTALL_HINT}"
        ) from error
    except OSError as error:
        raise BackendError(
            f"amd backend: libamd_smi.so could not be loaded ({error}): {INSTALL_HINT}"
        ) from error
    log.debug("amdsmi binding loaded", extra=log_fields(binding=str(host or "image")))
    return module


def _symbol(error: AttributeError) -> str:
    text = str(error)
    marker = "undefined symbol: "
    return text[text.index(marker) + len(marker) :].split(".", maxsplit=1)[0] if marker in text else text


def _binding_version(import_module: Callable[[str], Any]) -> str:
    try:
        return str(import_module("amdsmi._version").__version__)
    except Exception:
        return "unknown"


def _library_version() -> str | None:
    """The host library's version, read without the binding (which could not bind the library):
    ``amdsmi_get_lib_version`` fills a struct that starts with major, minor and release (uint32,
    ROCm 6.2 and later; a pointer follows, so the buffer is larger than any release's struct)."""
    try:
        lib = ctypes.CDLL(str(rocm_dir() / "lib" / "libamd_smi.so"))
        fields = (ctypes.c_uint32 * 16)()
        if lib.amdsmi_get_lib_version(ctypes.byref(fields)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return ".".join(str(number) for number in fields[:3])


def check_module(module: Any) -> None:
    """Raise `BackendError` when `module` lacks a function the backend needs (amdsmi too old)."""
    missing = [name for name in REQUIRED_NAMES if not hasattr(module, name)]
    if missing:
        raise BackendError(
            f"amd backend: the installed amdsmi is too old (it lacks {', '.join(missing)}): {INSTALL_HINT}"
        )


def _release(version: str) -> tuple[int, int] | None:
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def check_pair(module: Any) -> str:
    """The library's version; `BackendError` naming both versions when the library is not the one
    the binding was made for (blocking: the library call runs in the caller's thread)."""
    binding = str(getattr(module, "__version__", "unknown"))
    try:
        lib = module.amdsmi_get_lib_version()
        lib_version = f"{int(lib['major'])}.{int(lib['minor'])}.{int(lib['release'])}"
        lib_major = int(lib["major"])
    except Exception as error:
        log.warning("libamd_smi version unreadable", extra=log_fields(error=str(error)))
        return "unknown"
    release = _release(binding)
    expected = (LIB_MAJOR_BY_ROCM.get(release) or LIB_MAJOR_BY_ROCM.get(release[:1])) if release else None
    if expected is not None and expected != lib_major:
        raise BindingMismatchError(
            f"amd backend: libamd_smi {lib_version} (under {rocm_dir()}/lib) does not match the amdsmi "
            f"binding {binding} (made for libamd_smi {expected}.x): {PAIR_HINT}",
            lib_version,
            binding,
        )
    return lib_version
