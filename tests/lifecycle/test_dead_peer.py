"""A rollout in which one pod is killed with SIGKILL (issue 25 point 6): the surviving pod removes
the dead pod's sockets (its registration socket would otherwise answer the kubelet UNAVAILABLE)
and keeps its own. Upstream: pkg/kubelet/pluginmanager/pluginwatcher/plugin_watcher.go keeps a
registration socket until its file goes."""

from __future__ import annotations

import signal
from pathlib import Path

from agent.emulator import KubeApiEmulator
from tests.lifecycle.harness import NVIDIA, AgentPod, chart_pod, fake_values, until


async def test_the_surviving_pod_removes_a_killed_peers_sockets(root: Path, emu: KubeApiEmulator) -> None:
    kubeconfig = emu.write_kubeconfig(root / "kubeconfig")
    node = root / "node"

    def pod(uid: str) -> AgentPod:
        spec = chart_pod(fake_values(), node, kubeconfig=kubeconfig, pod_uid=uid)
        return AgentPod(spec, root / f"{uid}.log").start()

    old, new = pod("00000a"), pod("00000b")
    try:
        old_sockets, new_sockets = old.sockets(NVIDIA), new.sockets(NVIDIA)
        await until(lambda: all(p.exists() for p in (*old_sockets, *new_sockets)), "both pods' sockets")
        old.kill()
        await until(lambda: not any(p.exists() for p in old_sockets), "the dead pod's sockets to go", 40)
        assert all(p.exists() for p in new_sockets)
        assert new.lines("removed the socket of an agent pod that is gone")
        assert await new.stop(signal.SIGTERM) == 0
        assert "Traceback" not in new.log(), new.log()
    finally:
        old.kill()
        new.kill()
