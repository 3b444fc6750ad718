"""Sockets of an agent pod killed during a rollout (issue 25 point 6): the surviving pod removes
them once connecting proves them dead twice, never a live or just-starting peer's.

Upstream facts used: the kubelet's plugin watcher keeps a registration socket file until it is
removed and calls whatever is behind it (pkg/kubelet/pluginmanager/pluginwatcher/plugin_watcher.go);
the Go helper names sockets per pod UID during rolling updates
(staging/src/k8s.io/dynamic-resource-allocation/kubeletplugin/draplugin.go, RollingUpdate)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.kubelet.peersockets import CONFIRM_SECONDS, DeadPeerSockets
from tests.kubelet.grpc_support import short_tmp_dir
from tests.support.clock import FakeClock

DRIVER = "gpu.example.com"


@pytest.fixture
def root() -> Iterator[Path]:
    yield from short_tmp_dir()


def dead_socket(path: Path) -> None:
    """A socket file nobody listens on (what a SIGKILLed process leaves)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()


def live_socket(path: Path) -> socket.socket:
    path.parent.mkdir(parents=True, exist_ok=True)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.listen(8)
    return s


def test_a_dead_peers_sockets_go_after_two_refusals_and_a_live_peers_stay(
    root: Path, fake_clock: FakeClock
) -> None:
    plugins, registry = root / "plugins", root / "registry"
    dead = [plugins / DRIVER / "dra-bbb.sock", registry / f"{DRIVER}-bbb-reg.sock"]
    for path in dead:
        dead_socket(path)
    live = [live_socket(plugins / DRIVER / "dra-ccc.sock"), live_socket(registry / f"{DRIVER}-ccc-reg.sock")]
    own = plugins / DRIVER / "dra-aaa.sock"
    dead_socket(own)  # never ours to judge, even when it refuses
    other_driver = registry / "gpu.other.com-bbb-reg.sock"
    dead_socket(other_driver)
    sweeper = DeadPeerSockets(DRIVER, plugins, registry, "aaa", fake_clock)
    try:
        assert sweeper.sweep() == []  # one refusal is no proof: a starting pod binds before it listens
        fake_clock.advance(CONFIRM_SECONDS - 0.1)
        assert sweeper.sweep() == []
        fake_clock.advance(0.2)
        assert sorted(sweeper.sweep()) == sorted(dead)
        assert not any(p.exists() for p in dead)
        assert own.exists() and other_driver.exists()
        assert (plugins / DRIVER / "dra-ccc.sock").exists() and (registry / f"{DRIVER}-ccc-reg.sock").exists()
    finally:
        for s in live:
            s.close()


def test_a_socket_replaced_between_two_looks_starts_over(root: Path, fake_clock: FakeClock) -> None:
    plugins, registry = root / "plugins", root / "registry"
    path = plugins / DRIVER / "dra-bbb.sock"
    dead_socket(path)
    sweeper = DeadPeerSockets(DRIVER, plugins, registry, "aaa", fake_clock)
    assert sweeper.sweep() == []
    path.unlink()
    dead_socket(path)  # a new pod with that UID bound it again (another inode)
    fake_clock.advance(CONFIRM_SECONDS + 1)
    assert sweeper.sweep() == [] and path.exists()
    fake_clock.advance(CONFIRM_SECONDS + 1)
    assert sweeper.sweep() == [path]
