"""The AMD backend (amdsmi): GPUs and partitions under ``gpu.amd.com``.

Settings (``--backend amd:key=value,...``): see `backends.amd.backend.SETTINGS`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agent.core.backend import Backend, BackendOptions
    from backends.amd.backend import AmdBackend

__all__ = ["AmdBackend", "create_backend"]


def create_backend(options: BackendOptions) -> list[Backend]:
    """Entry point ``backends.amd:create_backend``: one backend for the AMD driver name."""
    from backends.amd.backend import AmdBackend

    return [AmdBackend(options)]


def __getattr__(name: str) -> Any:
    # The backend module loads on first use: the fake backend imports only AMD's claim
    # configuration (`backends.amd.sharingconfig`), and this package is imported first (~25 ms at start).
    if name == "AmdBackend":
        from backends.amd.backend import AmdBackend

        return AmdBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
