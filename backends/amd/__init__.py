"""The AMD backend (amdsmi): GPUs and partitions under ``gpu.amd.com``.

Settings (``--backend amd:key=value,...``): see `backends.amd.backend.SETTINGS`.
"""

from __future__ import annotations

from agent.core.backend import Backend, BackendOptions
from backends.amd.backend import AmdBackend


def create_backend(options: BackendOptions) -> list[Backend]:
    """Entry point ``backends.amd:create_backend``: one backend for the AMD driver name."""
    return [AmdBackend(options)]


__all__ = ["AmdBackend", "create_backend"]
