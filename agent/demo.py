"""``dra-agent demo``: the agent's main job on the fake backend, with no cluster and no GPU.

It starts the in-process Kubernetes API emulator (`agent.emulator`), runs the whole agent against
it (the same `AgentParts` as ``dra-agent run``) with the fake backend's ``mixed`` profile, and
then walks through what a platform engineer would check on a GPU node:

1. the ResourceSlices the agent published, as ``kubectl get resourceslices -o yaml`` shows them;
2. an XID fault injected through the fake backend's control socket (what ``dra-agent fake
   inject`` sends): the device taint appears, then is lifted once the device stayed healthy for
   the hold time;
3. the kubelet's side over the real unix sockets: registration (``GetInfo``), a ResourceClaim
   allocated by "the scheduler", ``NodePrepareResources`` with the CDI spec it wrote, and
   ``NodeUnprepareResources``.

Everything lives in a temporary directory and is removed at the end. `run_demo` returns a
`DemoReport` so the tests can check what the demo showed.
"""

from __future__ import annotations

import json
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

import anyio
import yaml
from grpclib.client import Channel

from agent.app import Agent
from agent.config import AgentConfig, BackendSpec
from agent.core.backend import Backend
from agent.core.clock import SystemClock
from agent.core.errors import AgentError
from agent.emulator import KubeApiEmulator
from agent.health.taints import TaintPolicy
from agent.kube.client import KubeClient
from agent.kubelet._protos.k8s.io.kubelet.pkg.apis.dra import v1 as dra_v1
from agent.kubelet._protos.pluginregistration import InfoRequest, RegistrationStatus, RegistrationStub
from agent.kubelet.plugin import socket_paths
from agent.observe.metrics import Metrics
from agent.observe.readiness import Readiness
from agent.runner import AgentParts

DEMO_NODE = "demo-node"
DEMO_NAMESPACE = "default"


class DemoError(AgentError):
    """The demo did not see what it expected (a bug: please report it with the output)."""


@dataclass
class DemoReport:
    """What the demo showed; the tests check it."""

    slices: list[dict[str, Any]] = field(default_factory=list)
    taint: dict[str, Any] = field(default_factory=dict)
    taint_seconds: float = 0.0
    lift_seconds: float = 0.0
    plugin_info: dict[str, dict[str, Any]] = field(default_factory=dict)
    prepare: dict[str, Any] = field(default_factory=dict)
    cdi_spec: dict[str, Any] = field(default_factory=dict)
    cdi_removed: bool = False
    unprepare: dict[str, Any] = field(default_factory=dict)
    shares: dict[str, Any] = field(default_factory=dict)
    """``--sharing``: the two claims' prepare answer, their MPS environment and the daemon's record."""


@dataclass(frozen=True)
class DemoOptions:
    """What the demo runs: profile, which device gets which fault, the taint hold time."""

    profile: str = "mixed"
    kube_version: str = "1.34"
    driver: str = "gpu.nvidia.com"
    fault_device: str = "gpu-0"
    claim_device: str = "gpu-1"
    condition: str = "xid"
    value: str = "79"
    hold_seconds: float = 2.0
    step_timeout: float = 20.0
    sharing: bool = False
    """Publish with consumable-shares=memory and show two MPS claims sharing `share_device`."""
    share_device: str = "gpu-2"


class _Printer:
    def __init__(self, out: TextIO) -> None:
        self.out = out

    def step(self, text: str) -> None:
        self.out.write(f"\n==> {text}\n")
        self.out.flush()

    def line(self, text: str) -> None:
        self.out.write(f"    {text}\n")
        self.out.flush()

    def yaml(self, data: Any) -> None:
        self.out.write(yaml.safe_dump(data, sort_keys=False))
        self.out.flush()


async def _until(what: str, check: Callable[[], Any], limit: float) -> Any:
    """Poll `check` until it returns something truthy; `DemoError` naming `what` after `limit` s."""
    with anyio.move_on_after(limit):
        # Polling: the emulator's store and the readiness table have no change events to wait on.
        while not (result := check()):  # noqa: ASYNC110
            await anyio.sleep(0.01)
        return result
    raise DemoError(f"demo: timed out after {limit:.0f} s waiting for {what}")


def _device_taints(emu: KubeApiEmulator, driver: str, device: str) -> list[dict[str, Any]]:
    for item in emu.list("resourceslices", field_selector=f"spec.driver={driver}"):
        for entry in item["spec"].get("devices", []):
            if entry["name"] == device:
                return list(entry.get("taints", []))
    return []


def _claim(options: DemoOptions) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "demo-gpu", "namespace": DEMO_NAMESPACE},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": options.driver}}]}},
    }


def _allocate(emu: KubeApiEmulator, options: DemoOptions) -> dict[str, Any]:
    """Play the scheduler: create the claim and allocate `claim_device` of this node's pool to it."""
    created = emu.create("resourceclaims", _claim(options), namespace=DEMO_NAMESPACE)
    created["status"] = {
        "allocation": {
            "devices": {
                "results": [
                    {
                        "request": "gpu",
                        "driver": options.driver,
                        "pool": DEMO_NODE,
                        "device": options.claim_device,
                    }
                ]
            },
            "nodeSelector": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [DEMO_NODE]}]}
                ]
            },
        }
    }
    return emu.update("resourceclaims", created, namespace=DEMO_NAMESPACE, subresource="status")


def demo_config(root: Path, kubeconfig: Path, options: DemoOptions) -> AgentConfig:
    """The agent's config for the demo: everything under `root`, short hold time."""
    settings = {"profile": options.profile, "control": str(root / "fake.sock")}
    if options.sharing:
        settings["consumable-shares"] = "memory"
    fake = BackendSpec("fake", settings)
    return replace(
        AgentConfig(),
        node_name=DEMO_NODE,
        backends=(fake,),
        registry_dir=root / "plugins_registry",
        plugins_dir=root / "plugins",
        cdi_root=root / "cdi",
        state_dir=root / "state",
        metrics_address="127.0.0.1:0",
        kube_mode="kubeconfig",
        kubeconfig=kubeconfig,
        taint_hold_seconds=options.hold_seconds,
    )


@asynccontextmanager
async def agent_running(
    config: AgentConfig, backends: Sequence[Backend] | None = None
) -> AsyncIterator[AgentParts]:
    """The whole agent (as ``dra-agent run`` builds it) running for the duration of the block.

    `config` names the API server (``kube_mode``/``kubeconfig``); `backends` default to the
    config's. The demo and the end-to-end tests use it.
    """
    kube = await KubeClient.connect(config.kube_mode, config.kubeconfig)
    try:
        clock, metrics, readiness = SystemClock(), Metrics(), Readiness()
        parts = AgentParts(
            config,
            kube=kube,
            metrics=metrics,
            readiness=readiness,
            clock=clock,
            policy=TaintPolicy.default(),
        )
        agent = Agent(
            config, backends=backends, metrics=metrics, clock=clock, parts=parts, readiness=readiness
        )
        async with anyio.create_task_group() as tg:
            tg.start_soon(agent.run)
            yield parts
            tg.cancel_scope.cancel()
    finally:
        await kube.close()


async def run_demo(out: TextIO, options: DemoOptions | None = None) -> DemoReport:
    """Run the demo, printing to `out`; raises `DemoError` when a step does not happen."""
    options = options or DemoOptions()
    # Unix socket paths are limited to 108 bytes: keep the directory short.
    with tempfile.TemporaryDirectory(prefix="dra-demo-", dir="/tmp") as tmp:
        root = Path(tmp)
        async with KubeApiEmulator(version=options.kube_version) as emu:
            emu.add_node(DEMO_NODE)
            config = demo_config(root, emu.write_kubeconfig(root / "kubeconfig"), options)
            async with agent_running(config) as parts:
                return await _Walkthrough(_Printer(out), emu, config, parts, options).run()


@dataclass
class _Walkthrough:
    """The demo's steps, run against a running agent."""

    p: _Printer
    emu: KubeApiEmulator
    config: AgentConfig
    parts: AgentParts
    options: DemoOptions
    report: DemoReport = field(default_factory=DemoReport)

    async def run(self) -> DemoReport:
        p, options = self.p, self.options
        p.step(
            f"dra-agent on node {DEMO_NODE}: fake backend, profile {options.profile!r}, "
            f"Kubernetes {options.kube_version} API emulator at {self.emu.url}"
        )
        await self.slices()
        await self.fault()
        await self.register()
        await self.prepare()
        if options.sharing:
            await self.share()
        p.step("done: the agent shuts down, its sockets and the demo directory are removed")
        return self.report

    def checks(self) -> dict[str, tuple[bool, str]]:
        return self.parts.readiness.ready()[1]

    async def slices(self) -> None:
        def published() -> bool:
            wanted = {c: ok for c, (ok, _) in self.checks().items() if c.startswith("published/")}
            return bool(wanted) and all(wanted.values())

        await _until("the ResourceSlices to be published", published, self.options.step_timeout)
        report, p = self.report, self.p
        report.slices = self.emu.list("resourceslices", field_selector=f"spec.nodeName={DEMO_NODE}")
        p.step("kubectl get resourceslices -o yaml")
        p.yaml({"apiVersion": "v1", "kind": "List", "items": report.slices})
        for item in report.slices:
            names = ", ".join(d["name"] for d in item["spec"].get("devices", []))
            p.line(f"{item['spec']['driver']}: pool {item['spec']['pool']['name']}, devices {names}")

    async def fault(self) -> None:
        # Exactly what a user types: the fake backend's `dra-agent fake inject` command, found
        # through the CLI's command entry points (it blocks on its own event loop, hence the thread).
        cli_main = _dra_agent_command()

        p, options, report, emu = self.p, self.options, self.report, self.emu
        control = self.config.backends[0].settings["control"]
        device, driver = options.fault_device, options.driver
        argv = [
            *("fake", "inject", "--socket", control, "--driver", driver, "--device", device),
            *("--condition", options.condition, "--value", options.value),
            *("--severity", "critical", "--kind", "event"),
        ]
        p.step(f"dra-agent {' '.join(argv)}")
        start = time.perf_counter()
        if await anyio.to_thread.run_sync(cli_main, argv) != 0:
            raise DemoError(f"dra-agent {' '.join(argv)} failed")
        taints = await _until(
            f"a taint on {device}", lambda: _device_taints(emu, driver, device), options.step_timeout
        )
        report.taint_seconds = time.perf_counter() - start
        report.taint = taints[0]
        p.line(f"taint on {driver}/{device} after {report.taint_seconds * 1000:.0f} ms:")
        p.yaml({"taints": taints})

        # An XID is an event, not a state: the device counts as healthy again once no new fault
        # has come for the hold time, and only then is the taint lifted.
        p.step(f"waiting: no new fault on {device} for --taint-hold={options.hold_seconds:g} s")
        await _until(
            f"the taint on {device} to be lifted",
            lambda: not _device_taints(emu, driver, device),
            options.step_timeout + options.hold_seconds,
        )
        report.lift_seconds = time.perf_counter() - start
        p.line(f"taint lifted {report.lift_seconds:.2f} s after the fault")

    def sockets(self, driver: str) -> tuple[Path, Path]:
        config = self.config
        return socket_paths(driver, config.plugins_dir, config.registry_dir, config.pod_uid)

    async def register(self) -> None:
        """Play the kubelet's plugin watcher for every driver: GetInfo, then the status."""
        p, report, limit = self.p, self.report, self.options.step_timeout
        for driver in sorted({item["spec"]["driver"] for item in report.slices}):
            _, reg_socket = self.sockets(driver)
            await _until(f"the registration socket {reg_socket}", reg_socket.exists, limit)
            p.step(f"kubelet: GetInfo on {reg_socket}")
            async with Channel(path=str(reg_socket)) as channel:
                registration = RegistrationStub(channel, timeout=1.0)
                info = await registration.get_info(InfoRequest())
                report.plugin_info[driver] = info.to_dict()
                p.yaml(report.plugin_info[driver])
                await registration.notify_registration_status(RegistrationStatus(plugin_registered=True))
        try:
            await _until("the agent to be ready (/readyz)", lambda: self.parts.readiness.ready()[0], limit)
        except DemoError as error:
            raise DemoError(f"{error}; checks: {self.checks()}") from None
        p.line("registered; /readyz answers ready: " + ", ".join(sorted(self.checks())))

    async def prepare(self) -> None:
        """Play the scheduler (allocate a claim), then the kubelet: prepare, show CDI, unprepare."""
        p, options, report, config = self.p, self.options, self.report, self.config
        driver = options.driver
        meta = _allocate(self.emu, options)["metadata"]
        p.step(
            f"scheduler: ResourceClaim {meta['namespace']}/{meta['name']} "
            f"gets {driver}/{options.claim_device}"
        )
        claim = dra_v1.Claim(namespace=meta["namespace"], uid=meta["uid"], name=meta["name"])
        dra_socket, _ = self.sockets(driver)
        async with Channel(path=str(dra_socket)) as channel:
            dra = dra_v1.DraPluginStub(channel, timeout=10.0)
            p.step(f"kubelet: NodePrepareResources on {dra_socket}")
            prepared = await dra.node_prepare_resources(dra_v1.NodePrepareResourcesRequest(claims=[claim]))
            report.prepare = prepared.to_dict()
            p.yaml(report.prepare)
            answer = prepared.claims.get(meta["uid"])
            if answer is None or answer.error:
                raise DemoError(
                    f"demo: prepare failed: {answer.error if answer else 'no answer for the claim'}"
                )
            specs = sorted(config.cdi_root.glob("*.yaml")) + sorted(config.cdi_root.glob("*.json"))
            if not specs:
                raise DemoError(f"demo: no CDI spec was written under {config.cdi_root}")
            p.step(f"CDI spec {specs[0]}")
            text = specs[0].read_text()
            report.cdi_spec = _load_spec(text)
            p.out.write(text if text.endswith("\n") else text + "\n")

            p.step("kubelet: NodeUnprepareResources")
            undone = await dra.node_unprepare_resources(dra_v1.NodeUnprepareResourcesRequest(claims=[claim]))
            report.unprepare = undone.to_dict()
            p.yaml(report.unprepare)
        report.cdi_removed = not specs[0].exists()
        state = self.parts.states.get(driver)
        left = len(state.prepared_claims()) if state is not None else 0
        p.line(f"CDI spec removed: {report.cdi_removed}; prepared claims left: {left}")

    def _share_status(self, claims: Sequence[dra_v1.Claim]) -> dict[str, list[dict[str, Any]]] | None:
        """Each claim's ``status.devices`` (device, shareID, Ready), once every claim has one."""
        found = {c.name: _status_entries(self.emu, c.name) for c in claims}
        if not all(found.values()):
            return None
        return {
            name: [
                {
                    "device": e["device"],
                    "shareID": e.get("shareID", ""),
                    "Ready": e["conditions"][0]["status"],
                }
                for e in entries
            ]
            for name, entries in found.items()
        }

    async def share(self) -> None:
        """Two claims with MPS and memory shares of one GPU: share IDs, per-claim limits, one daemon."""
        p, options, report, config = self.p, self.options, self.report, self.config
        driver, device = options.driver, options.share_device
        claims = []
        for name, memory in (("share-a", "20Gi"), ("share-b", "30Gi")):
            meta = _allocate_share(self.emu, driver, device, name, memory)["metadata"]
            claims.append(dra_v1.Claim(namespace=meta["namespace"], uid=meta["uid"], name=meta["name"]))
            p.step(f"scheduler: {meta['namespace']}/{name} gets a {memory} share of {driver}/{device} (MPS)")
        dra_socket, _ = self.sockets(driver)
        async with Channel(path=str(dra_socket)) as channel:
            dra = dra_v1.DraPluginStub(channel, timeout=30.0)
            p.step("kubelet: NodePrepareResources for both claims")
            prepared = await dra.node_prepare_resources(dra_v1.NodePrepareResourcesRequest(claims=claims))
            answers = prepared.to_dict()
            p.yaml(answers)
            errors = [a.error for a in prepared.claims.values() if a.error]
            if errors:
                raise DemoError(f"demo: shared prepare failed: {errors[0]}")
            env = {}
            for claim in claims:
                spec = _load_spec((config.cdi_root / f"k8s.{driver}-claim_{claim.uid}.yaml").read_text())
                env[claim.name] = [
                    line
                    for d in spec["devices"]
                    for line in d["containerEdits"].get("env", [])
                    if "MPS" in line
                ]
            p.step("the claims' CDI specs: the MPS pipe and each share's pinned-memory limit")
            p.yaml(env)
            records = list((config.state_dir / "fake-sharing").rglob("daemon-state.json"))
            daemon = json.loads(records[0].read_text()) if len(records) == 1 else {}
            p.step(f"one MPS control daemon (the fake backend's stand-in) serves {device}")
            p.yaml(daemon)
            report.shares = {"prepare": answers, "env": env, "daemon": daemon, "daemons": len(records)}
            status = await _until("the claims' device status", lambda: self._share_status(claims), 10.0)
            p.step("the API server took each claim's device status: one entry per share, with its shareID")
            p.yaml(status)
            report.shares["status"] = status
            await dra.node_unprepare_resources(dra_v1.NodeUnprepareResourcesRequest(claims=claims))
        left = list((config.state_dir / "fake-sharing").rglob("daemon.json"))
        report.shares["daemons_after"] = len(left)
        p.line(f"both claims unprepared; MPS daemons left: {len(left)}")


def _ready(entry: Mapping[str, Any]) -> str:
    return next((c["status"] for c in entry.get("conditions") or [] if c.get("type") == "Ready"), "")


def _status_entries(emu: KubeApiEmulator, name: str) -> list[dict[str, Any]]:
    claim = emu.get("resourceclaims", name, namespace="default") or {}
    return list((claim.get("status") or {}).get("devices") or [])


def _allocate_share(emu: KubeApiEmulator, driver: str, device: str, name: str, memory: str) -> dict[str, Any]:
    """Play the scheduler for a memory share with NVIDIA's MPS config."""
    config = {
        "opaque": {
            "driver": driver,
            "parameters": {
                "apiVersion": "resource.nvidia.com/v1beta1",
                "kind": "GpuConfig",
                "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}},
            },
        }
    }
    request = {
        "name": "gpu",
        "exactly": {"deviceClassName": driver, "capacity": {"requests": {"memory": memory}}},
    }
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": DEMO_NAMESPACE},
        "spec": {"devices": {"requests": [request], "config": [config]}},
    }
    created = emu.create("resourceclaims", claim, namespace=DEMO_NAMESPACE)
    result = {
        "request": "gpu",
        "driver": driver,
        "pool": DEMO_NODE,
        "device": device,
        "shareID": str(uuid.uuid4()),
        "consumedCapacity": {"memory": memory},
    }
    created["status"] = {
        "allocation": {
            "devices": {"results": [result], "config": [{"source": "FromClaim", **config}]},
            "nodeSelector": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [DEMO_NODE]}]}
                ]
            },
        }
    }
    return emu.update("resourceclaims", created, namespace=DEMO_NAMESPACE, subresource="status")


def _dra_agent_command() -> Callable[[Sequence[str]], int]:
    """The installed ``dra-agent`` command, as a user types it: its console-script entry point.

    Looked up by name, not imported: `agent.cli` runs the demo (``dra-agent demo``), so the demo
    does not import the CLI back.
    """
    from importlib.metadata import entry_points

    (script,) = entry_points(group="console_scripts", name="dra-agent")
    command: Callable[[Sequence[str]], int] = script.load()
    return command


def _load_spec(text: str) -> dict[str, Any]:
    data = yaml.safe_load(text)
    if not isinstance(data, Mapping):
        raise DemoError("demo: the CDI spec is not a mapping")
    return dict(data)
