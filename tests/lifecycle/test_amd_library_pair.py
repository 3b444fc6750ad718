"""A host ROCm that is not the amdsmi binding's, in ``dra-agent run`` as the chart runs it (issue 30
point 3).

The image pins AMD's binding (amdsmi 7.0.2) while the chart mounts the host's ROCm: on a ROCm 6.4
host the library (libamd_smi 25.3.0) lacks a symbol the binding binds at import, or reports a
version the binding was not made for. Either is one log line naming both versions and the fix:
with the mixed values (AMD optional) the NVIDIA driver registers and serves and the AMD driver is
neither published nor registered; with the AMD values (AMD required) the process exits 2 with that
one line on stderr and nothing on stdout. Never a traceback.

The agent loads AMD's real binding over the stand-in library (tests/lifecycle/vendorlibs/amdsmi.py);
the kubelet side is pkg/kubelet/pluginmanager's GetInfo + NotifyRegistrationStatus, as in
test_chart_examples.
"""

from __future__ import annotations

import signal
from importlib.metadata import version
from pathlib import Path

import anyio
import pytest

from agent.emulator import KubeApiEmulator
from tests.deploy.chart import load_values
from tests.fakes.amd_standin import build
from tests.lifecycle.harness import AMD, NVIDIA, AgentPod, chart_pod, pool_slices, until

POD_UID = "0a1b2c3d"
HOST_LIBRARY = "25.3.0"  # ROCm 6.4's libamd_smi
BINDING = version("amdsmi")

# case -> (the stand-in's environment, what the line must name besides both versions)
CASES = {
    "missing symbol": (
        {"DRA_TEST_AMD_LIBRARY": "no-cper", "DRA_TEST_AMD_LIB_VERSION": HOST_LIBRARY},
        "amdsmi_get_gpu_cper_entries",
    ),
    "version mismatch": ({"DRA_TEST_AMD_LIB_VERSION": HOST_LIBRARY}, "does not match"),
}


def names_both_versions_and_the_fix(line: str, named: str) -> bool:
    return (
        f"libamd_smi {HOST_LIBRARY}" in line
        and BINDING in line
        and named in line
        and "share/amd_smi" in line  # the fix: the host ROCm's binding ...
        and "pip install 'amdsmi==" in line  # ... or the matching one in the image
    )


def pod_of(values: str, case: str, root: Path, emu: KubeApiEmulator, nvidia_gpus: int) -> AgentPod:
    build("no-cper")  # before the agent starts: it would otherwise compile the library itself
    spec = chart_pod(
        load_values(values),
        root / "node",
        kubeconfig=emu.write_kubeconfig(root / "kubeconfig"),
        pod_uid=POD_UID,
        nvidia_gpus=nvidia_gpus,
        amd_gpus=2,
    )
    spec.env.update(CASES[case][0])
    return AgentPod(spec, root / "agent.log")


@pytest.mark.parametrize("case", sorted(CASES))
async def test_optional_amd_is_left_out_in_one_line_and_nvidia_serves(
    case: str, root: Path, emu: KubeApiEmulator
) -> None:
    pod = pod_of("mixed", case, root, emu, nvidia_gpus=2).start()
    try:
        await until(lambda: pool_slices(emu, NVIDIA), "the NVIDIA pool")
        assert len(pool_slices(emu, NVIDIA)[0]["spec"]["devices"]) == 2
        assert await pod.register(NVIDIA) == str(pod.sockets(NVIDIA)[0])
        with anyio.fail_after(30):  # registration reaches the readiness table asynchronously
            while (answer := await pod.probe("/readyz"))[0] != 200 and not pod.exited():  # noqa: ASYNC110
                await anyio.sleep(0.05)
        assert answer[0] == 200 and f"[+] registered/{NVIDIA}" in answer[1], answer

        await pod.wait_log("optional backend not served on this node")
        (line,) = pod.lines(f"libamd_smi {HOST_LIBRARY}")
        assert f"driver={AMD}" in line and names_both_versions_and_the_fix(line, CASES[case][1]), line
        assert "level=warning" in line, line  # a misconfiguration, not a node without ROCm
        assert not pool_slices(emu, AMD)
        assert not any(path.exists() for path in pod.sockets(AMD))
        assert AMD not in answer[1]
        assert await pod.stop(signal.SIGTERM) == 0, pod.log()
        assert "Traceback" not in pod.log(), pod.log()
    finally:
        pod.kill()


@pytest.mark.parametrize("case", sorted(CASES))
async def test_required_amd_fails_in_one_line_and_exit_2(case: str, root: Path, emu: KubeApiEmulator) -> None:
    pod = pod_of("amd", case, root, emu, nvidia_gpus=0)
    pod.prepare()
    code, stdout, stderr = -1, "", "did not exit within 30 s"
    with anyio.move_on_after(30):  # cancelling run_process kills the agent
        done = await anyio.run_process(pod.spec.argv, env=pod.environment(), cwd=str(pod.cwd), check=False)
        code, stdout, stderr = done.returncode, done.stdout.decode(), done.stderr.decode()
    assert code == 2, stderr
    assert stdout == ""
    (line,) = stderr.splitlines()
    assert line.startswith("dra-agent: error: amd backend:"), line
    assert names_both_versions_and_the_fix(line, CASES[case][1]), line
    assert not emu.list("resourceslices")
    assert not any(path.exists() for path in pod.sockets(AMD))
