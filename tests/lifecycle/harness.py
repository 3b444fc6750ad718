"""Whole ``dra-agent run`` processes, configured exactly as the Helm chart configures the DaemonSet.

`chart_pod` renders the chart (real Helm v4 engine, `tests.deploy.chart`), takes the DaemonSet's
command, environment and volumes and the rendered ConfigMaps, and turns them into a process
started on this machine. The only changes are those a test machine forces:

- host paths are mapped into a temporary "node" directory (every mount's path, wherever it
  appears in an environment value, e.g. ``driver-root=/run/nvidia/driver``); the kubelet creates
  the ``DirectoryOrCreate`` host paths before the container starts, and so does `AgentPod`;
- the downward API (``NODE_NAME``, ``POD_UID``) gets the test's node and pod UID;
- ``DRA_AGENT_KUBE=in-cluster`` becomes a kubeconfig for the API emulator (no service account);
- the metrics port becomes 0: pods have their own network namespaces, these processes share one;
- the vendor libraries are the fakes of tests/fakes (see `vendorlibs/`), chosen per "node" with
  ``DRA_TEST_NVIDIA_GPUS`` and ``DRA_TEST_AMD_GPUS``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import anyio
from grpclib.client import Channel

from agent.emulator import KubeApiEmulator
from agent.kubelet._protos.pluginregistration import InfoRequest, RegistrationStatus, RegistrationStub
from agent.kubelet.plugin import socket_paths
from tests.deploy.chart import render_objects

REPO = Path(__file__).resolve().parents[2]
VENDORLIBS = Path(__file__).resolve().parent / "vendorlibs"
NODE = "gpu-node-1"
NVIDIA = "gpu.nvidia.com"
AMD = "gpu.amd.com"


async def until(check: Callable[[], Any], what: str, limit: float = 30.0) -> Any:
    """Poll `check` until it returns something truthy (files, logs, the emulator's store: no events)."""
    with anyio.move_on_after(limit):
        while not (result := check()):  # noqa: ASYNC110
            await anyio.sleep(0.02)
        return result
    raise AssertionError(f"timed out after {limit:.0f} s waiting for {what}")


@dataclass(frozen=True)
class PodSpec:
    """What the kubelet would run for one agent pod, mapped onto this machine."""

    argv: list[str]
    env: dict[str, str]
    files: dict[Path, str] = field(default_factory=dict)
    """ConfigMap files at their mapped mount paths."""
    create_dirs: list[Path] = field(default_factory=list)
    """``DirectoryOrCreate`` host paths: the kubelet creates them before the container starts."""

    def path(self, variable: str) -> Path:
        return Path(self.env[variable])


def _field_ref(source: Mapping[str, Any], node: str, pod_uid: str) -> str:
    path = source["fieldRef"]["fieldPath"]
    values = {"spec.nodeName": node, "metadata.uid": pod_uid}
    if path not in values:
        raise AssertionError(f"the harness does not know the downward API field {path}")
    return values[path]


def chart_pod(
    values: Mapping[str, Any],
    root: Path,
    *,
    kubeconfig: Path,
    pod_uid: str,
    node: str = NODE,
    nvidia_gpus: int = 0,
    amd_gpus: int = 0,
) -> PodSpec:
    """The agent process of the chart rendered with `values`, on a node whose files live in `root`."""
    objects = render_objects(values)
    (ds,) = [o for o in objects if o["kind"] == "DaemonSet"]
    configmaps = {o["metadata"]["name"]: o["data"] for o in objects if o["kind"] == "ConfigMap"}
    pod = ds["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}

    def mapped(path: str) -> Path:
        return root / path.lstrip("/")

    mounts: list[str] = []
    files: dict[Path, str] = {}
    create: list[Path] = []
    for mount in container["volumeMounts"]:
        volume = volumes[mount["name"]]
        if mount["mountPath"] != "/dev":  # device nodes come from the fakes
            mounts.append(mount["mountPath"])
        if "configMap" in volume:
            for key, text in configmaps[volume["configMap"]["name"]].items():
                files[mapped(mount["mountPath"]) / key] = text
        elif volume["hostPath"].get("type") == "DirectoryOrCreate":
            create.append(mapped(volume["hostPath"]["path"]))
    # Longest first, whole path components only: /var/lib/kubelet/plugins_registry before .../plugins.
    patterns = [
        (re.compile(rf"(?<![\w.-]){re.escape(m)}(?=$|[/,;])"), str(mapped(m)))
        for m in sorted(mounts, key=len, reverse=True)
    ]

    def map_value(text: str) -> str:
        for pattern, replacement in patterns:
            text = pattern.sub(replacement.replace("\\", "\\\\"), text)
        return text

    env: dict[str, str] = {}
    for item in container["env"]:
        if "valueFrom" in item:
            env[item["name"]] = _field_ref(item["valueFrom"], node, pod_uid)
        else:
            env[item["name"]] = map_value(str(item["value"]))
    assert env.pop("DRA_AGENT_KUBE") == "in-cluster"
    env["DRA_AGENT_KUBE"] = "kubeconfig"
    env["KUBECONFIG"] = str(kubeconfig)
    env["DRA_AGENT_METRICS_ADDRESS"] = "127.0.0.1:0"
    env["DRA_TEST_NVIDIA_GPUS"] = str(nvidia_gpus)
    env["DRA_TEST_AMD_GPUS"] = str(amd_gpus)
    command = container["command"]
    assert command[0] == "dra-agent"
    argv = [sys.executable, "-m", "agent.cli", *command[1:], *container.get("args", [])]
    return PodSpec(argv, env, files, create)


class AgentPod:
    """One running agent process of a `PodSpec`; its stderr (the log) goes to a file."""

    def __init__(self, spec: PodSpec, log_path: Path) -> None:
        self.spec = spec
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None

    def prepare(self) -> None:
        """What the kubelet does before the container starts: hostPath directories, ConfigMap files."""
        for directory in self.spec.create_dirs:
            directory.mkdir(parents=True, exist_ok=True)
        for path, text in self.spec.files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)

    def start(self) -> AgentPod:
        self.prepare()
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.spec.argv, env=self.environment(), cwd=self.cwd, stdout=log, stderr=subprocess.STDOUT
            )
        return self

    cwd = REPO

    def environment(self) -> dict[str, str]:
        """The process environment: the pod's, the fake vendor libraries first on the path."""
        return {
            **{k: v for k, v in os.environ.items() if not k.startswith(("DRA_AGENT_", "KUBELET_"))},
            **self.spec.env,
            "PYTHONPATH": f"{VENDORLIBS}{os.pathsep}{REPO}",
            "PYTHONUNBUFFERED": "1",
        }

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def lines(self, text: str) -> list[str]:
        return [line for line in self.log().splitlines() if text in line]

    @property
    def metrics_port(self) -> int | None:
        found = re.search(r"serving metrics and probes.*?port\W+(\d+)", self.log())
        return int(found.group(1)) if found else None

    async def wait_log(self, text: str, limit: float = 30.0) -> None:
        await until(lambda: text in self.log() or self.exited(), f"log line {text!r}", limit)
        assert text in self.log(), f"the agent exited before logging {text!r}:\n{self.log()}"

    def exited(self) -> bool:
        return self.process is not None and self.process.poll() is not None

    async def stop(self, sig: int = signal.SIGTERM, limit: float = 20.0) -> int:
        """Send `sig` and wait for the exit code."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(sig)
        await until(self.exited, "the agent to exit", limit)
        code = self.process.returncode
        assert code is not None
        return code

    def kill(self) -> None:
        assert self.process is not None
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    async def probe(self, path: str) -> tuple[int, str]:
        """GET `path` (``/healthz``, ``/readyz``) on the agent's metrics port."""
        port = await until(lambda: self.metrics_port, "the metrics port")
        async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}{path}") as reply:
            return reply.status, await reply.text()

    def sockets(self, driver: str) -> tuple[Path, Path]:
        """(DRA socket, registration socket) of `driver` for this pod."""
        return socket_paths(
            driver,
            self.spec.path("KUBELET_PLUGINS_DIRECTORY_PATH"),
            self.spec.path("KUBELET_REGISTRAR_DIRECTORY_PATH"),
            self.spec.env["POD_UID"],
        )

    async def register(self, driver: str) -> str:
        """Play the kubelet's plugin manager: GetInfo, then accept; returns the advertised endpoint."""
        _, reg_socket = self.sockets(driver)
        with anyio.fail_after(30):
            while True:
                # A killed agent's socket file stays until the restarted one replaces it.
                await until(reg_socket.exists, f"the registration socket of {driver}")
                try:
                    async with Channel(path=str(reg_socket)) as channel:
                        stub = RegistrationStub(channel, timeout=5.0)
                        info = await stub.get_info(InfoRequest())
                        assert info.name == driver, info
                        await stub.notify_registration_status(RegistrationStatus(plugin_registered=True))
                    return str(info.endpoint)
                except OSError:
                    await anyio.sleep(0.05)


def pool_slices(emu: KubeApiEmulator, driver: str, node: str = NODE) -> list[dict[str, Any]]:
    return list(emu.list("resourceslices", field_selector=f"spec.nodeName={node},spec.driver={driver}"))


def device_taints(emu: KubeApiEmulator, driver: str, node: str = NODE) -> dict[str, list[dict[str, Any]]]:
    """Taints per published device of `driver` on `node`."""
    return {
        d["name"]: list(d.get("taints") or [])
        for s in pool_slices(emu, driver, node)
        for d in s["spec"]["devices"]
    }


def slice_writes(emu: KubeApiEmulator) -> int:
    return sum(n for (_, resource), n in emu.writes.items() if resource == "resourceslices")


def fake_values(**settings: str) -> dict[str, Any]:
    """Chart values with the fake backend only (8 simulated A100s), as the chart README shows."""
    return {
        "backends": {
            "nvidia": {"enabled": False},
            "fake": {
                "enabled": True,
                "settings": {"profile": "nvidia-a100-8x", "control": "off", **settings},
            },
        },
    }


def allocated_claim(emu: KubeApiEmulator, name: str, device: str) -> dict[str, Any]:
    """A claim the scheduler allocated `device` of this node's NVIDIA pool to (as stored)."""
    claim = emu.create(
        "resourceclaims",
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": NVIDIA}}]}},
        },
    )
    result = {"request": "gpu", "driver": NVIDIA, "pool": NODE, "device": device}
    claim["status"] = {"allocation": {"devices": {"results": [result]}}}
    emu.update("resourceclaims", claim, subresource="status")
    return claim
