"""Restarts and rolling updates during a held taint (issue 12 points 2 and 3).

One node, one fake-backend pool (the chart's ``backends.fake``), XID 79 on ``gpu-0`` with a hold
time. Then, as a cluster operator would: the agent container is killed and restarted (same pod
UID), and a surge rollout starts a second pod (another pod UID) next to it, after which the old
pod exits. The taint must stay in the API server for its whole hold (counted from its
``timeAdded``), be lifted after it, and the pool be written at most twice over the rollout.

Upstream facts used: the kubelet restarts a container in the same pod (same ``metadata.uid``,
pkg/kubelet/kuberuntime/kuberuntime_manager.go); a DaemonSet with ``maxSurge`` starts the new pod
before it deletes the old one and waits until the new one is available
(pkg/controller/daemon/update.go, rollingUpdate).
"""

from __future__ import annotations

import calendar
import signal
import time
from pathlib import Path
from typing import Any

import anyio

from agent.emulator import KubeApiEmulator
from backends.fake.control import request
from tests.lifecycle.harness import (
    NVIDIA,
    AgentPod,
    chart_pod,
    device_taints,
    fake_values,
    slice_writes,
    until,
)

HOLD = 10.0
DEVICE = "gpu-0"


def rollout_values(control: Path) -> dict[str, Any]:
    """The chart with the fake backend only, its control socket at `control`, and the hold time."""
    return {**fake_values(control=str(control)), "taintHoldSeconds": HOLD}


def xid_taint(emu: KubeApiEmulator) -> dict[str, Any] | None:
    return next((t for t in device_taints(emu, NVIDIA).get(DEVICE, []) if t["key"] == f"{NVIDIA}/xid"), None)


async def test_a_held_taint_survives_a_restart_and_a_surge_rollout(root: Path, emu: KubeApiEmulator) -> None:
    kubeconfig = emu.write_kubeconfig(root / "kubeconfig")
    node = root / "node"

    def pod(uid: str, name: str) -> AgentPod:
        spec = chart_pod(rollout_values(root / f"{name}.sock"), node, kubeconfig=kubeconfig, pod_uid=uid)
        return AgentPod(spec, root / f"{name}.log")

    old = pod("00000a", "old").start()
    pods = [old]
    try:
        await until(lambda: DEVICE in device_taints(emu, NVIDIA), "the first slices")
        await request(
            str(root / "old.sock"),
            {"op": "inject", "device": DEVICE, "condition": "xid", "value": "79", "severity": "critical"},
        )
        taint = await until(lambda: xid_taint(emu), "the XID 79 taint")
        assert (taint["value"], taint["effect"]) == ("79", "NoSchedule")
        lifts_at = calendar.timegm(time.strptime(taint["timeAdded"], "%Y-%m-%dT%H:%M:%SZ")) + HOLD

        drops: list[float] = []

        async def watch_taint() -> None:
            while time.time() < lifts_at - 0.05:
                if xid_taint(emu) is None:
                    drops.append(time.time())
                await anyio.sleep(0.01)

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch_taint)

            # 1. The container is killed (OOM, crash) and the kubelet restarts it: same pod UID.
            old.kill()
            writes = slice_writes(emu)
            restarted = pod("00000a", "restarted").start()
            pods.append(restarted)
            await restarted.wait_log("health condition restored from")
            await restarted.wait_log("serving metrics and probes")

            # 2. Surge rollout: the new pod starts next to the running one and stands by.
            new = pod("00000b", "new").start()
            pods.append(new)
            await new.wait_log("another agent pod publishes this pool; standing by")
            _, text = await new.probe("/readyz")
            assert f"[+] published/{NVIDIA}: standby" in text, text  # ready: the rollout can go on
            assert not new.lines("ResourceSlices published")

            # 3. The DaemonSet controller deletes the old pod; the new one takes over.
            assert await restarted.stop(signal.SIGTERM) == 0, restarted.log()
            await new.wait_log("taking over publishing")
            await new.wait_log("health condition restored from")

        assert drops == [], f"the taint disappeared during its hold at {drops} (lifts at {lifts_at})"
        await until(lambda: xid_taint(emu) is None, "the taint to be lifted after the hold", HOLD + 10)
        assert time.time() >= lifts_at - 0.05
        # The restart and the rollout wrote nothing; the lift is one update.
        assert slice_writes(emu) - writes <= 2, emu.writes
        assert new.lines("health condition lifted")
        assert await new.stop(signal.SIGTERM) == 0
        for agent in pods:
            assert "Traceback" not in agent.log(), agent.log()
    finally:
        for agent in pods:
            agent.kill()
