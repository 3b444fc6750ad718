"""A broken node environment fails at start: one line naming the flag, the value and the fix, exit 2,
nothing written (issue 12 point 6f).

Before, each of these restarted a part forever while ``/healthz`` said 200, or (CDI root a regular
file) failed every prepare. The bounded reading of policy and kubeconfig files is tested elsewhere.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import pytest

from agent.emulator import KubeApiEmulator
from tests.lifecycle.harness import REPO, AgentPod, chart_pod, fake_values

Breakage = Callable[[Path, dict[str, str]], str]
"""Breaks the node under the given root (or the env) and returns the text the error line must name."""


def _file_at(variable: str) -> Breakage:
    def breakage(node: Path, env: dict[str, str]) -> str:
        path = Path(env[variable])
        if path.is_dir():
            path.rmdir()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("a regular file where the agent needs a directory\n")
        return str(path)

    return breakage


def _parent_file(variable: str) -> Breakage:
    def breakage(node: Path, env: dict[str, str]) -> str:
        blocker = node / "blocker"
        blocker.write_text("a regular file\n")
        env[variable] = str(blocker / "cannot-be-created")
        return env[variable]

    return breakage


def _set(variable: str, value: str) -> Breakage:
    def breakage(node: Path, env: dict[str, str]) -> str:
        env[variable] = value
        return value

    return breakage


CASES: dict[str, tuple[str, Breakage]] = {
    "state dir is a file": ("--state-dir", _file_at("DRA_AGENT_STATE_DIR")),
    "registry dir is a file": ("--registry-dir", _file_at("KUBELET_REGISTRAR_DIRECTORY_PATH")),
    "plugins dir cannot be created": ("--plugins-dir", _parent_file("KUBELET_PLUGINS_DIRECTORY_PATH")),
    "CDI root is a file": ("--cdi-root", _file_at("CDI_ROOT")),
    "unresolvable metrics host": (
        "--metrics-address",
        _set("DRA_AGENT_METRICS_ADDRESS", "no-such-host.invalid:0"),
    ),
    "taint hold inf": ("--taint-hold", _set("DRA_AGENT_TAINT_HOLD_SECONDS", "inf")),
    "health debounce inf": ("--health-debounce", _set("DRA_AGENT_HEALTH_DEBOUNCE_SECONDS", "inf")),
    "metrics port in use": ("--metrics-address", lambda node, env: env["DRA_AGENT_METRICS_ADDRESS"]),
}


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


def snapshot(root: Path) -> list[tuple[str, int]]:
    return sorted(
        (str(p.relative_to(root)), p.stat().st_size if p.is_file() else -1) for p in root.rglob("*")
    )


async def test_each_bad_environment_is_one_line_and_exit_2(
    root: Path, emu: KubeApiEmulator, busy_port: int
) -> None:
    kubeconfig = emu.write_kubeconfig(root / "kubeconfig")
    values = fake_values()
    results: dict[str, tuple[int, str, str, list[tuple[str, int]], list[tuple[str, int]]]] = {}

    async def one(case: str) -> None:
        flag, breakage = CASES[case]
        node = root / case.replace(" ", "-")
        spec = chart_pod(values, node, kubeconfig=kubeconfig, pod_uid="00000d")
        pod = AgentPod(spec, root / "unused.log")
        env = dict(spec.env)
        if case == "metrics port in use":
            env["DRA_AGENT_METRICS_ADDRESS"] = f"127.0.0.1:{busy_port}"
        for directory in spec.create_dirs:  # the kubelet's hostPath directories
            directory.mkdir(parents=True, exist_ok=True)
        named = breakage(node, env)
        before = snapshot(node)
        code, stderr = -1, "did not exit within 30 s (a part restarting forever?)"
        with anyio.move_on_after(30):  # cancelling run_process kills the agent
            done = await anyio.run_process(
                spec.argv, env={**pod.environment(), **env}, cwd=str(pod.cwd), check=False
            )
            code, stderr = done.returncode, done.stderr.decode()
        results[case] = (code, stderr, f"{flag}|{named}", before, snapshot(node))

    async with anyio.create_task_group() as tg:
        for case in CASES:
            tg.start_soon(one, case)

    for case, (code, stderr, expected, before, after) in sorted(results.items()):
        flag, named = expected.split("|", 1)
        lines = stderr.strip().splitlines()
        assert code == 2, (case, stderr)
        assert len(lines) == 1, (case, stderr)
        assert lines[0].startswith("dra-agent: error:") and flag in lines[0] and named in lines[0], (
            case,
            lines,
        )
        assert before == after, (case, "the agent wrote to the node")
    assert not emu.writes, emu.writes


KUBECONFIG_NO_CLUSTERS = "apiVersion: v1\nkind: Config\nclusters: []\ncontexts: []\nusers: []\n"
KUBECONFIG_NO_SERVER = (
    "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
    "contexts: [{name: c, context: {cluster: k, user: u}}]\n"
    "clusters: [{name: k, cluster: {}}]\nusers: [{name: u, user: {token: t}}]\n"
)


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("missing", "expected an existing kubeconfig file"),
        ("no-clusters", "expected a kubeconfig with a current-context"),
        ("no-server", "names a cluster with a server"),
        ("in-cluster", "expected a Pod with a service account"),
    ],
)
def test_bad_credentials_are_one_line_and_exit_2_before_any_socket(
    tmp_path: Path, case: str, expected: str
) -> None:
    """Issue 25 point 3: a kubeconfig or in-cluster credential error is a configuration error,
    said in one line before the kubelet sockets open (client-go's loaders refuse the same files:
    staging/src/k8s.io/client-go/tools/clientcmd/client_config.go, rest/config.go InClusterConfig)."""
    kubeconfig = tmp_path / "kubeconfig"
    if case == "no-clusters":
        kubeconfig.write_text(KUBECONFIG_NO_CLUSTERS)
    elif case == "no-server":
        kubeconfig.write_text(KUBECONFIG_NO_SERVER)
    kube = (
        ["--kube", "in-cluster"]
        if case == "in-cluster"
        else ["--kube", "kubeconfig", "--kubeconfig", str(kubeconfig)]
    )
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("KUBERNETES_", "DRA_AGENT_", "KUBECONFIG"))
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "agent.cli",
            "run",
            *kube,
            "--backend",
            "fake:control=off",
            "--registry-dir",
            str(tmp_path / "registry"),
            "--plugins-dir",
            str(tmp_path / "plugins"),
            "--cdi-root",
            str(tmp_path / "cdi"),
            "--state-dir",
            str(tmp_path / "state"),
            "--metrics-address",
            "127.0.0.1:0",
        ],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        cwd=REPO,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and expected in done.stderr, done.stderr
    assert not list(tmp_path.rglob("*.sock"))
