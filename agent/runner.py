"""Composition root of `dra-agent run`: builds every part of the agent from the config and runs it.

Per driver: health monitor and tracker (in `agent.app`), the slice publisher (or, with
``--kube none``, a printer of the slices it would publish), the claim state and the kubelet
plugin sockets, and the telemetry poller. Once: the metrics/health HTTP server.

Start order: after a restart the kubelet waits for our sockets, so they do not wait for the API
server: the API client connects (credentials, discovery) beside them, and a prepare that arrives
before it is connected waits for it (`LateApi`).
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import anyio

from agent.app import Agent, DriverRuntime, Part, create_backend_set, run_until_signal
from agent.claims.filelock import FileLock
from agent.claims.state.hooks import Listeners, PreparedListener
from agent.claims.state.machine import DeviceState
from agent.config import AgentConfig
from agent.core.backend import GPU_LOST, Backend, ClaimRef, declared_conditions, prepared_status
from agent.core.clock import Clock, SystemClock
from agent.core.errors import KubeApiError
from agent.core.exclusion import ExcludingBackend
from agent.core.logs import log_fields
from agent.core.model import HealthCondition, Severity
from agent.health.taints import EFFECT_NONE, TaintPolicy
from agent.kube.claimstatus import ClaimStatusWriter, StatusTarget
from agent.kube.client import KubeClient
from agent.kube.credentials import check_in_cluster, check_kubeconfig, in_cluster
from agent.kube.events import EventRecorder
from agent.kube.nodecache import NodeApiCache
from agent.kube.printer import pool_document
from agent.kube.publisher import SlicePublisher
from agent.kubelet.deviceplugins import device_plugins_dir, report_device_plugins
from agent.kubelet.peersockets import DeadPeerSockets
from agent.kubelet.plugin import KubeletPlugin, another_pod_serving, socket_paths
from agent.kubelet.podresources import PodResourcesClient, default_socket
from agent.kubelet.workloads import WorkloadAttribution
from agent.observe.allocations import AllocationSeries
from agent.observe.httpserver import MetricsServer
from agent.observe.metrics import Metrics
from agent.observe.readiness import Readiness
from agent.observe.telemetry import TelemetryPoller
from agent.preflight import preflight

log = logging.getLogger("agent.runner")

PUBLISH_LOCK_NAME = "publish.lock"
PUBLISH_LOCK_POLL_SECONDS = 0.1


class NoApiServer:
    """The claim source with ``--kube none``: every claim read fails with a clear reason."""

    async def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        raise KubeApiError(
            f"cannot read ResourceClaim {namespace}/{name}: the agent runs with --kube none "
            "(no API server); run it with --kube in-cluster or --kube kubeconfig to prepare claims"
        )


class LateApi:
    """The API client and its event recorder, connected after the kubelet sockets serve.

    It is the claim source and the event recorder of the claim state from the start: a claim
    read or an event that comes before the client waits for it instead of failing (the kubelet's
    prepare after a restart is answered once the client is connected).
    """

    def __init__(self) -> None:
        self._ready = anyio.Event()
        self._client: KubeClient | None = None
        self._events: EventRecorder | None = None
        self.reads_waiting = 0
        """Claim reads waiting for the client now."""

    def set(self, client: KubeClient, events: EventRecorder) -> None:
        self._client, self._events = client, events
        self._ready.set()

    async def wait(self) -> tuple[KubeClient, EventRecorder]:
        if self._client is None or self._events is None:  # anyio's wait() yields even when set
            await self._ready.wait()
        assert self._client is not None and self._events is not None
        return self._client, self._events

    async def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        self.reads_waiting += 1
        try:
            client, _ = await self.wait()
        finally:
            self.reads_waiting -= 1
        return await client.get_resource_claim(namespace, name)

    async def record(self, reason: str, message: str, type: str) -> bool:
        _, events = await self.wait()
        return await events.record(reason, message, type)


class AgentParts:
    """Builds the parts of the agent; the demo and the tests use it with their own dependencies.

    The API client is either given (`kube`) or connected by `connect_api` with `connect` once the
    kubelet sockets serve; with neither the agent runs without an API server (``--kube none``).
    """

    def __init__(
        self,
        config: AgentConfig,
        *,
        kube: KubeClient | None,
        connect: Callable[[], Awaitable[KubeClient]] | None = None,
        metrics: Metrics,
        readiness: Readiness,
        clock: Clock,
        policy: TaintPolicy,
        out: TextIO = sys.stdout,
    ) -> None:
        self.config = config
        self.kube = kube
        self.metrics = metrics
        self.readiness = readiness
        self.clock = clock
        self.policy = policy
        self.out = out
        self.connect = connect
        self.api = LateApi() if kube is not None or connect is not None else None
        self.publishers: dict[str, SlicePublisher] = {}
        self.node_cache: NodeApiCache | None = None
        """Discovery, probes, the Node and our slices (one LIST/WATCH): one for every publisher."""
        self.plugins: dict[str, KubeletPlugin] = {}
        self.states: dict[str, DeviceState] = {}
        self.status_writers: dict[str, ClaimStatusWriter] = {}
        self.metrics_port: int | None = None
        self.workloads: WorkloadAttribution | None = None
        self._liveness: Callable[[], tuple[bool, str]] | None = None
        self._said_kept: set[tuple[str, str, str, str]] = set()
        if kube is not None:
            self._connected(kube)

    def _connected(self, kube: KubeClient) -> None:
        assert self.api is not None
        self.kube = kube
        self.api.set(kube, EventRecorder(kube, self.config.node_name, clock=self.clock, metrics=self.metrics))

    async def connect_api(self) -> None:
        """Connect the API client with `connect`, beside the kubelet sockets (nothing to do without)."""
        if self.connect is not None:
            self._connected(await self.connect())

    def __call__(self, agent: Agent) -> Sequence[Part]:
        self._liveness = agent.failures.health
        parts = [Part("metrics-server", self._serve_metrics)]
        if self.config.serve_kubelet:
            self.workloads = WorkloadAttribution(
                AllocationSeries(self.metrics),
                node_name=self.config.node_name,
                inventories={d: r.inventory for d, r in agent.drivers.items()},
                claims=self.api,
                pod_resources=PodResourcesClient(default_socket(self.config.plugins_dir)),
                describe={d: functools.partial(prepared_status, r.backend) for d, r in agent.drivers.items()},
            )
            parts.append(Part("workloads", self.workloads.run))
        for runtime in agent.drivers.values():
            parts.extend(self.driver_parts(runtime))
        if self.api is None:
            parts.append(Part("slice-printer", lambda: self._print_slices(agent)))
        return parts

    def driver_parts(self, runtime: DriverRuntime) -> list[Part]:
        """The parts of one driver."""
        config, driver = self.config, runtime.driver
        poller = TelemetryPoller(
            runtime.backend,
            runtime.inventory,
            self.metrics,
            node_name=config.node_name,
            interval=config.telemetry_interval_seconds,
            clock=self.clock,
            readiness=self.readiness,
        )
        parts = [Part(f"{driver}/telemetry", poller.run)]
        if self.api is not None:
            check = f"published/{driver}"
            self.readiness.expect(check)
            parts.append(Part(f"{driver}/publisher", lambda: self._publish(runtime, check)))
        if config.serve_kubelet:
            if self.api is not None:
                writer = self._status_writer(runtime)
                parts.append(Part(f"{driver}/claim-status", writer.run))
            parts.append(Part(f"{driver}/kubelet", lambda: self._serve_kubelet(runtime)))
            if config.pod_uid:
                peers = DeadPeerSockets(
                    driver, config.plugins_dir, config.registry_dir, config.pod_uid, self.clock
                )
                parts.append(Part(f"{driver}/peer-sockets", peers.run))
        return parts

    def _status_writer(self, runtime: DriverRuntime) -> ClaimStatusWriter:
        """The writer of the driver's claims' ``status.devices`` (told by the claim state)."""
        assert self.api is not None
        api = self.api

        async def client() -> KubeClient:
            return (await api.wait())[0]

        def targets(ref: ClaimRef) -> list[StatusTarget]:
            # The checkpoint's results (with their shareIDs): known after a restart too.
            state = self.states.get(runtime.driver)
            entry = state.prepared_claims().get(ref.uid) if state is not None else None
            return [StatusTarget(d.pool, d.device, d.share_id) for d in entry.devices] if entry else []

        writer = ClaimStatusWriter(
            runtime.driver,
            self.config.node_name,
            runtime.inventory,
            client,
            clock=self.clock,
            metrics=self.metrics,
            targets=targets,
            describe=functools.partial(prepared_status, runtime.backend),
        )
        self.status_writers[runtime.driver] = writer
        return writer

    def _state(self, backend: Backend) -> DeviceState:
        config, driver = self.config, backend.driver_name
        plugin_dir = config.plugins_dir / driver
        return DeviceState(
            driver,
            backend,
            self.api if self.api is not None else NoApiServer(),
            node_name=config.node_name,
            cdi_root=config.cdi_root,
            state_dir=config.state_dir / driver,
            metrics=self.metrics,
            events=self.api,
            clock=self.clock,
            lock_path=plugin_dir / "serialize.lock" if config.pod_uid else None,
            listener=self._listener(driver),
            # With a pod UID a second pod may share the checkpoint (a rollout or a rollback).
            peers=functools.partial(another_pod_serving, self._dra_socket(driver))
            if config.pod_uid
            else None,
        )

    def _listener(self, driver: str) -> PreparedListener | None:
        """Who hears of the driver's prepared claims: the workload attribution and the status writer."""
        found = [x for x in (self.workloads, self.status_writers.get(driver)) if x is not None]
        return Listeners(*found) if found else None

    def _dra_socket(self, driver: str) -> Path:
        config = self.config
        return socket_paths(driver, config.plugins_dir, config.registry_dir, config.pod_uid)[0]

    async def _serve_kubelet(self, runtime: DriverRuntime) -> None:
        config, driver = self.config, runtime.driver
        check = f"registered/{driver}"
        self.readiness.expect(check)
        state = self._state(runtime.backend)
        self.states[driver] = state
        loaded = anyio.Event()

        def registered(ok: bool, detail: str = "") -> None:
            self.readiness.set(check, ok, detail)

        plugin = KubeletPlugin(
            driver,
            state,
            runtime.inventory,
            plugins_dir=config.plugins_dir,
            registry_dir=config.registry_dir,
            pod_uid=config.pod_uid,
            pool=config.node_name,
            metrics=self.metrics,
            readiness_callback=registered,
            clock=self.clock,
            preparer_ready=loaded,
        )
        self.plugins[driver] = plugin
        # Registration first: the kubelet waits for our sockets after a restart; claims wait for the
        # checkpoint and the start-up reconcile (its API reads) instead.
        async with anyio.create_task_group() as tg:
            await tg.start(plugin.run)
            await state.start()
            loaded.set()
            await report_device_plugins(
                driver,
                device_plugins_dir(config.plugins_dir),
                self.metrics,
                self.api,
                excluding=isinstance(runtime.backend, ExcludingBackend),
            )

    async def _publisher(self, runtime: DriverRuntime, check: str) -> tuple[KubeClient, SlicePublisher]:
        """The client, once connected, and the driver's publisher (one for all restarts of the part)."""
        assert self.api is not None
        kube, events = await self.api.wait()
        publisher = self.publishers.get(runtime.driver)
        if publisher is None:
            if self.node_cache is None:
                self.node_cache = NodeApiCache(
                    kube,
                    self.config.node_name,
                    clock=self.clock,
                    resync_seconds=self.config.resync_seconds,
                    watch_timeout_seconds=self.config.watch_timeout_seconds,
                    metrics=self.metrics,
                )
            publisher = SlicePublisher(
                kube,
                runtime.inventory,
                self.config.node_name,
                policy=self.policy,
                clock=self.clock,
                metrics=self.metrics,
                events=events,
                debounce_seconds=self.config.health_debounce_seconds,
                resync_seconds=self.config.resync_seconds,
                watch_timeout_seconds=self.config.watch_timeout_seconds,
                on_published=functools.partial(self.readiness.set, check),
                shared=self.node_cache,
            )
            self.publishers[runtime.driver] = publisher
        return kube, publisher

    async def _publish(self, runtime: DriverRuntime, check: str) -> None:
        """Publish the driver's pool: alone on the node, and only after restoring what was published.

        With a pod UID (the DaemonSet), two agent pods run side by side during a rolling update;
        only the one holding ``<plugins-dir>/<driver>/publish.lock`` publishes, the other serves
        the kubelet and stands by until the lock is free (the old pod exited). The taints already
        in our slices seed the health tracker at start (the kubelet's health stream sees them
        too) and again on taking over, before the first write.
        """
        _, publisher = await self._publisher(runtime, check)
        lock = None
        if self.config.pod_uid:
            lock = FileLock(
                self.config.plugins_dir / runtime.driver / PUBLISH_LOCK_NAME,
                clock=self.clock,
                poll_interval=PUBLISH_LOCK_POLL_SECONDS,
            )
        held = False
        try:
            await self._seed(publisher, runtime)
            if lock is not None:
                if not await lock.try_acquire():
                    log.info(
                        "another agent pod publishes this pool; standing by until it exits",
                        extra=log_fields(driver=runtime.driver, lock=str(lock.path)),
                    )
                    # Ready: a rolling update waits for this pod before it stops the old one.
                    self.readiness.set(check, True, "standby: another agent pod on this node publishes")
                    await lock.acquire()
                    log.info("taking over publishing", extra=log_fields(driver=runtime.driver))
                    await self._seed(publisher, runtime, fresh=True)  # what the old pod published last
                held = True
            await publisher.run()
        finally:
            if lock is not None:
                if held:
                    lock.release()
                lock.close()

    async def _seed(self, publisher: SlicePublisher, runtime: DriverRuntime, *, fresh: bool = False) -> None:
        """Hold the taints an earlier agent process published, as conditions of the health tracker.

        Read from the publishers' shared slice store (`agent.kube.nodecache`): its one LIST serves
        the seed, the watch and the first pass; `fresh` reads what the API server has now."""
        prefix = f"{runtime.driver}/"
        taints = await publisher.published_taints(fresh=fresh)
        for taint in taints:
            if not taint.key.startswith(prefix):
                continue  # not a key of ours
            since = taint.time_added if taint.time_added is not None else self.clock.time()
            # The policy maps the condition back to the same effect; the severity only ranks it.
            severity = Severity.INFO if taint.effect == EFFECT_NONE else Severity.CRITICAL
            condition = HealthCondition(
                taint.key[len(prefix) :],
                severity,
                taint.value,
                "held from before the agent restarted",
                since,
                held_effect=taint.effect,
            )
            runtime.tracker.seed(taint.device, condition)
        await self._say_kept_effects(runtime)

    async def _say_kept_effects(self, runtime: DriverRuntime) -> None:
        """One Event per held condition that today's policy would make stricter: it keeps the
        effect it was published with (a policy change acts on new faults, not on the past)."""
        assert self.api is not None
        for held in runtime.tracker.held():
            condition = held.condition
            kept = condition.held_effect
            wanted = self.policy.policy_effect(runtime.driver, condition)
            if not kept or wanted is None or self.policy.effect_for(runtime.driver, condition) == wanted:
                continue
            key = (runtime.driver, held.device, condition.condition, condition.value)
            if key in self._said_kept:
                continue
            self._said_kept.add(key)
            message = (
                f"{runtime.driver} device {held.device}: condition {condition.condition}"
                f"{'=' + condition.value if condition.value else ''} keeps its published effect {kept} "
                f"(the taint policy now says {wanted}); it applies to new faults only"
            )
            log.info("taint effect kept from before the restart", extra=log_fields(message=message))
            await self.api.record("TaintEffectKept", message, "Normal")

    async def _serve_metrics(self) -> None:
        server = MetricsServer(
            self.config.metrics_address,
            self.metrics,
            self.readiness,
            clock=self.clock,
            liveness=self._liveness,
        )
        await server.run()

    async def _print_slices(self, agent: Agent) -> None:
        """With ``--kube none``: print the slices the agent would publish, on every change."""
        async with anyio.create_task_group() as tg:
            for runtime in agent.drivers.values():
                tg.start_soon(self._print_pool, runtime)

    async def _print_pool(self, runtime: DriverRuntime) -> None:
        version = -1
        while True:
            version = await runtime.inventory.wait_changed(version)
            devices = runtime.inventory.devices()
            config = self.config
            self.out.write(
                pool_document(config.node_name, config.print_for, runtime.driver, devices, self.policy)
            )
            self.out.flush()
            await self.clock.sleep(0.1)  # coalesce a burst of changes into one print


def load_policy(path: Path | None) -> TaintPolicy:
    """The taint policy from `path`, or the default one."""
    return TaintPolicy.load(path) if path else TaintPolicy.default()


def check_policy(policy: TaintPolicy, backends: Sequence[Backend]) -> None:
    """Refuse a policy rule naming a condition none of the configured backends reports."""
    known = {b.driver_name: (*declared_conditions(b), GPU_LOST) for b in backends if declared_conditions(b)}
    policy.check_conditions(known, complete=len(known) == len(backends))


async def connect_kube(config: AgentConfig) -> KubeClient:
    """Connect to the API server as configured (``--kube in-cluster`` or ``kubeconfig``)."""
    return await KubeClient.connect(config.kube_mode, config.kubeconfig)


async def run_agent(config: AgentConfig) -> None:
    """Run the agent described by `config` until SIGTERM/SIGINT."""
    clock = SystemClock()
    metrics = Metrics()
    policy = load_policy(config.taint_policy)
    if config.kube_mode != "none":
        # Bad credentials end the agent before anything starts (the client connects later).
        if in_cluster(config.kube_mode, config.kubeconfig):
            await anyio.to_thread.run_sync(check_in_cluster)
        else:
            await anyio.to_thread.run_sync(check_kubeconfig, config.kubeconfig)
    await anyio.to_thread.run_sync(preflight, config)
    backends, optional = create_backend_set(config)
    check_policy(policy, backends)
    readiness = Readiness()
    connect = None if config.kube_mode == "none" else functools.partial(connect_kube, config)
    parts = AgentParts(
        config,
        kube=None,
        connect=connect,
        metrics=metrics,
        readiness=readiness,
        clock=clock,
        policy=policy,
    )
    agent = Agent(
        config,
        backends=backends,
        optional=optional,
        metrics=metrics,
        clock=clock,
        parts=parts,
        readiness=readiness,
        policy=policy,
    )
    try:
        async with anyio.create_task_group() as tg:
            # A failed connection (bad kubeconfig, no token) ends the agent, as it did before.
            tg.start_soon(parts.connect_api)
            await run_until_signal(agent)
            tg.cancel_scope.cancel()
    finally:
        if parts.kube is not None:
            await parts.kube.close()
