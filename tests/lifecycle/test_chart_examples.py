"""The chart's example values, run the way the DaemonSet runs them (issue 12 points 1, 4 and 5).

Each ``ci/*.yaml`` is rendered with the real Helm engine and started as ``dra-agent run`` with the
DaemonSet's own command, environment and ConfigMaps (see `tests.lifecycle.harness`), on a fresh
node: the kubelet created the hostPath directories and nothing else, and ``POD_UID`` is set as the
chart always sets it. The agent must register with the kubelet and publish its pool; in mixed mode
on a one-vendor node the other vendor's backend says so once and serves nothing.

The kubelet side follows pkg/kubelet/pluginmanager (GetInfo on the registration socket, then
NotifyRegistrationStatus) as in kubernetes/kubernetes pkg/kubelet/pluginmanager/operationexecutor.
"""

from __future__ import annotations

import signal
from pathlib import Path

import anyio
import pytest

from agent.emulator import KubeApiEmulator
from tests.deploy.chart import CI_VALUES, load_values
from tests.lifecycle.harness import AMD, NODE, NVIDIA, AgentPod, chart_pod, pool_slices, until

POD_UID = "0a1b2c3d"  # real UIDs are 36 characters: too long for unix socket paths under /tmp/...

# (values file, NVIDIA GPUs on the node, AMD GPUs on the node) -> drivers that must be served
CASES = {
    "nvidia-values on an NVIDIA node": ("nvidia", 2, 0, {NVIDIA}),
    "amd-values on an AMD node": ("amd", 0, 2, {AMD}),
    "mixed-values on an NVIDIA-only node": ("mixed", 2, 0, {NVIDIA}),
    "mixed-values on an AMD-only node": ("mixed", 0, 2, {AMD}),
}


def test_every_ci_values_file_is_covered() -> None:
    assert {case[0] for case in CASES.values()} == set(CI_VALUES)


@pytest.mark.parametrize("case", sorted(CASES))
async def test_fresh_node_registers_and_publishes(case: str, root: Path, emu: KubeApiEmulator) -> None:
    name, nvidia_gpus, amd_gpus, served = CASES[case]
    spec = chart_pod(
        load_values(name),
        root / "node",
        kubeconfig=emu.write_kubeconfig(root / "kubeconfig"),
        pod_uid=POD_UID,
        nvidia_gpus=nvidia_gpus,
        amd_gpus=amd_gpus,
    )
    pod = AgentPod(spec, root / "agent.log").start()
    try:
        for driver in served:
            await until(lambda d=driver: pool_slices(emu, d), f"the {driver} pool")  # type: ignore[misc]
            assert len(pool_slices(emu, driver)[0]["spec"]["devices"]) == 2
            endpoint = await pod.register(driver)
            assert endpoint == str(pod.sockets(driver)[0])

        # Registration is reported to the readiness table asynchronously: poll /readyz.
        with anyio.fail_after(30):
            while (answer := await pod.probe("/readyz"))[0] != 200 and not pod.exited():  # noqa: ASYNC110
                await anyio.sleep(0.05)
        status, text = answer
        assert status == 200, text
        for driver in served:
            assert f"[+] registered/{driver}" in text and f"[+] published/{driver}" in text
        assert (await pod.probe("/healthz"))[0] == 200

        absent = {NVIDIA, AMD} - served if name == "mixed" else set()
        for driver in absent:
            # One line, nothing published, nothing registered.
            lines = pod.lines("optional backend not served on this node")
            assert len([line for line in lines if driver in line]) == 1, pod.log()
            assert not pool_slices(emu, driver)
            assert not pod.sockets(driver)[1].exists()
            assert driver not in text
        assert await pod.stop(signal.SIGTERM) == 0, pod.log()
        assert "Traceback" not in pod.log()
        for driver in served:
            assert not any(path.exists() for path in pod.sockets(driver))
        assert {s["spec"]["nodeName"] for s in emu.list("resourceslices")} == {NODE}
    finally:
        pod.kill()
