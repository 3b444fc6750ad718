"""Restarts keep taints honest, however long the outage (issue 23 points 4, 5 and 6).

Whole agent processes configured by the chart (fake backend only, as in `test_rollout`), against
the API emulator. Each test is what an operator sees across a restart of the agent:

4. a ``gpu-lost`` taint restored at start is not lifted before the backend's first health pass has
   looked at the GPU (which, still dead, keeps it);
5. restarting with a stricter policy never makes the taint of a fault seen before the restart
   stricter (one Event says so), while a new fault follows the new policy;
6. after an outage longer than the kubelet's 30 s grace, when the kubelet has deleted the node's
   slices, the restarted agent still publishes the held taint (from its state directory).

Upstream facts used: the kubelet deletes the ResourceSlices of a driver 30 s after its plugin
deregistered (pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go, cleanupResourcesWithDelay); a
NoExecute device taint evicts the pods using the device
(pkg/controller/devicetainteviction/device_taint_eviction.go); a restarted container keeps its
pod UID (pkg/kubelet/kuberuntime/kuberuntime_manager.go).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio

from agent.emulator import KubeApiEmulator
from backends.fake.control import request
from tests.lifecycle.harness import NODE, NVIDIA, AgentPod, chart_pod, device_taints, fake_values, until

DEVICE = "gpu-0"
INTERVAL = 3.0
XID79 = {"op": "inject", "device": DEVICE, "condition": "xid", "value": "79", "severity": "critical"}


def values(control: Path, hold: float, **extra: Any) -> dict[str, Any]:
    settings = {"control": str(control), **extra.pop("settings", {})}
    return {
        **fake_values(**settings),
        "taintHoldSeconds": hold,
        "healthIntervalSeconds": INTERVAL,
        **extra,
    }


def taint(emu: KubeApiEmulator, key: str) -> dict[str, Any] | None:
    return next(
        (t for t in device_taints(emu, NVIDIA).get(DEVICE, []) if t["key"] == f"{NVIDIA}/{key}"), None
    )


def kept_events(emu: KubeApiEmulator) -> list[dict[str, Any]]:
    return [e for e in emu.list("events", namespace="default") if e.get("reason") == "TaintEffectKept"]


async def published(pod: AgentPod) -> None:
    """Until the pod's publisher has reconciled the pool once (its readiness check)."""
    with anyio.fail_after(30):
        while f"[+] published/{NVIDIA}" not in (await pod.probe("/readyz"))[1]:  # noqa: ASYNC110
            await anyio.sleep(0.05)


class Node:
    def __init__(self, root: Path, emu: KubeApiEmulator) -> None:
        self.root = root
        self.emu = emu
        self.kubeconfig = emu.write_kubeconfig(root / "kubeconfig")
        self.pods: list[AgentPod] = []

    def start(self, name: str, chart_values: dict[str, Any]) -> AgentPod:
        spec = chart_pod(chart_values, self.root / "node", kubeconfig=self.kubeconfig, pod_uid="00000a")
        pod = AgentPod(spec, self.root / f"{name}.log").start()
        self.pods.append(pod)
        return pod

    async def xid79(self, hold: float) -> tuple[AgentPod, dict[str, Any]]:
        """A first pod (control socket ``a.sock``) holding XID 79 on `DEVICE`; its taint."""
        first = self.start("first", values(self.root / "a.sock", hold))
        await until(lambda: DEVICE in device_taints(self.emu, NVIDIA), "the first slices")
        await request(str(self.root / "a.sock"), XID79)
        return first, await until(lambda: taint(self.emu, "xid"), "the XID 79 taint")

    def no_traceback(self) -> None:
        for pod in self.pods:
            assert "Traceback" not in pod.log(), pod.log()


async def test_a_restored_gpu_lost_stays_until_the_first_pass_has_looked_at_the_gpu(
    root: Path, emu: KubeApiEmulator
) -> None:
    hold = 0.5
    node = Node(root, emu)
    first = node.start("first", values(root / "a.sock", hold))
    try:
        await until(lambda: DEVICE in device_taints(emu, NVIDIA), "the first slices")
        await request(str(root / "a.sock"), {"op": "lose", "device": DEVICE})
        lost = await until(lambda: taint(emu, "gpu-lost"), "the gpu-lost taint")
        first.kill()
        since = time.time()
        await until(lambda: time.time() - since > 2 * hold, "the taint to be older than its hold")

        # The GPU is still dead when the agent comes back; its first pass comes one interval later.
        restarted = node.start("restarted", values(root / "b.sock", hold, settings={"lost": DEVICE}))
        started = time.time()
        drops: list[float] = []
        while time.time() - started < INTERVAL + 3:
            if taint(emu, "gpu-lost") is None:
                drops.append(time.time() - started)
            await anyio.sleep(0.02)
        assert drops == [], f"gpu-lost lifted {drops[0]:.2f} s after the restart, before any health pass"
        assert taint(emu, "gpu-lost") == lost  # same timeAdded: nothing churned
        assert restarted.lines("health condition restored from")
        assert not restarted.lines("health condition lifted")
        await restarted.stop()
    finally:
        for pod in node.pods:
            pod.kill()
    node.no_traceback()


async def test_a_stricter_policy_after_a_restart_keeps_the_published_effect_of_an_earlier_fault(
    root: Path, emu: KubeApiEmulator
) -> None:
    hold = 60.0
    node = Node(root, emu)
    try:
        first, before = await node.xid79(hold)
        assert before["effect"] == "NoSchedule"
        first.kill()

        strict = {"rules": [{"condition": "xid", "value": 79, "effect": "NoExecute"}]}
        restarted = node.start("restarted", values(root / "b.sock", hold, taintPolicy=strict))
        await until(lambda: kept_events(emu), "the TaintEffectKept Event")
        await published(restarted)
        assert taint(emu, "xid") == before  # never NoExecute: the running pod is not evicted
        events = kept_events(emu)
        assert len(events) == 1 and "NoExecute" in events[0]["message"], events

        # A new fault follows the new policy.
        await request(str(root / "b.sock"), XID79)
        after = await until(
            lambda: (t := taint(emu, "xid")) and t["effect"] == "NoExecute" and t, "NoExecute"
        )
        assert after["value"] == "79"
        await restarted.stop()
    finally:
        for pod in node.pods:
            pod.kill()
    node.no_traceback()


async def test_a_held_taint_survives_an_outage_after_which_the_kubelet_deleted_the_slices(
    root: Path, emu: KubeApiEmulator
) -> None:
    hold = 300.0
    node = Node(root, emu)
    try:
        first, before = await node.xid79(hold)
        held = root / "node" / "var" / "lib" / "dra-agent" / NVIDIA / "health.json"
        await until(lambda: held.exists() and b'"xid"' in held.read_bytes(), "the held-conditions file")
        first.kill()
        # More than 30 s later the kubelet has deleted the node's slices of the driver.
        for item in emu.list("resourceslices"):
            if item["spec"].get("nodeName") == NODE:
                emu.delete("resourceslices", item["metadata"]["name"])
        assert device_taints(emu, NVIDIA) == {}

        restarted = node.start("restarted", values(root / "b.sock", hold))
        after = await until(lambda: taint(emu, "xid"), "the XID 79 taint published again")
        assert after == before  # same value, effect and timeAdded
        await restarted.stop()
    finally:
        for pod in node.pods:
            pod.kill()
    node.no_traceback()
