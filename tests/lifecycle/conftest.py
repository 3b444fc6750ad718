"""Lifecycle test fixtures: a short node directory (unix socket paths are limited), the emulator."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from agent.emulator import KubeApiEmulator
from tests.kubelet.grpc_support import short_tmp_dir
from tests.lifecycle.harness import NODE


@pytest.fixture
def root() -> Iterator[Path]:
    yield from short_tmp_dir()


@pytest.fixture
async def emu() -> AsyncIterator[KubeApiEmulator]:
    """The API server of a 1.34 cluster with our node (device taints on, as the agent's docs ask)."""
    async with KubeApiEmulator(version="1.34", feature_gates={"DRADeviceTaints": True}) as emulator:
        emulator.add_node(NODE)
        yield emulator
