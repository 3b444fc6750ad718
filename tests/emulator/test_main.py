"""The standalone entry point ``python -m agent.emulator``."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import anyio
import pytest
import yaml

from agent.emulator import KubeApiEmulator
from agent.emulator.__main__ import _gates, _parse
from tests.emulator.conftest import slice_body


def test_parse_and_gates() -> None:
    args = _parse(
        ["--port", "0", "--version", "1.35", "--node", "a", "--feature-gate", "DRADeviceTaints=false"]
    )
    assert args.version == "1.35" and args.node == ["a"]
    assert _gates(args.feature_gate) == {"DRADeviceTaints": False}
    with pytest.raises(SystemExit, match="expected NAME=true"):
        _gates(["DRADeviceTaints"])


def test_runs_until_sigint() -> None:
    kubeconfig = Path(tempfile.mkdtemp(dir="/tmp")) / "kc"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agent.emulator",
            "--port",
            "0",
            "--node",
            "node-a",
            "--kubeconfig",
            str(kubeconfig),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert "serving on http://127.0.0.1:" in line
        server = yaml.safe_load(kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
        assert line.strip().endswith(server)
        with urllib.request.urlopen(server + "/api/v1/nodes", timeout=5) as response:
            assert [n["metadata"]["name"] for n in json.load(response)["items"]] == ["node-a"]
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=10) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
async def test_kubectl_talks_to_the_emulator() -> None:
    async with KubeApiEmulator(version="1.34") as emu:
        emu.add_node("node-a")
        emu.create("resourceslices", slice_body("s"))
        kubeconfig = emu.write_kubeconfig(Path(tempfile.mkdtemp(dir="/tmp")) / "kc")
        base = ["kubectl", "--kubeconfig", str(kubeconfig)]
        nodes = await anyio.run_process([*base, "get", "nodes"])
        assert b"node-a" in nodes.stdout and b"Ready" in nodes.stdout
        listed = await anyio.run_process([*base, "get", "resourceslices", "-o", "yaml"])
        document = yaml.safe_load(listed.stdout)
        assert document["items"][0]["spec"]["devices"][0]["capacity"]["memory"]["value"] == "80Gi"
        beta = await anyio.run_process(
            [*base, "get", "resourceslices.v1beta1.resource.k8s.io", "s", "-o", "json"]
        )
        assert "basic" in json.loads(beta.stdout)["spec"]["devices"][0]
        await anyio.run_process([*base, "label", "node", "node-a", "team=gpu"])
        node = emu.get("nodes", "node-a")
        assert node is not None and node["metadata"]["labels"]["team"] == "gpu"
