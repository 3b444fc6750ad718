"""The ResourceSlice publisher: keeps one driver's pool on this node equal to the inventory.

One pool per driver, named after the node. Triggers (inventory changes, watch events on our
slices, a resync timer) are coalesced by a short debounce and a minimum interval between
writing passes, so a storm of health events becomes a few writes and the final state is always
published. A pass lists our slices, deletes obsolete ones (with preconditions), updates changed
ones in place and creates missing ones; when the stored slices already match (compared
semantically: quantities by value, taints without ``timeAdded``) it writes nothing.

Failures are retried with capped, jittered exponential backoff; an episode of failures is logged
once when it starts and once when it ends. `SlicePublisher.run` only ends by cancellation.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import anyio

from agent.core.clock import Clock
from agent.core.errors import KubeApiError
from agent.core.inventory import Inventory
from agent.core.logs import log_fields
from agent.core.model import Device
from agent.health.taints import ClusterTaintSupport, DeviceTaint
from agent.kube.client import KubeClient
from agent.kube.events import NORMAL, WARNING, EventRecorder
from agent.kube.slices import (
    API_GROUP,
    MAX_DEVICES_PER_SLICE,
    chunk_names,
    device_names,
    device_to_api,
    flat_device,
    semantic_device,
    taint_identity,
)
from agent.kube.taintrules import TaintRuleSync
from agent.kube.validation import Problem, check_slice_spec, partition_entries
from agent.observe.metrics import Metrics

log = logging.getLogger("agent.kube.publisher")

MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "dra-agent"
RESOURCE = "resourceslices"
_RETRYABLE = {0, 409, 429, 500, 502, 503, 504}
# One failed pass is a blip the retry absorbs; this many in a row make the agent not ready.
_NOT_READY_AFTER_FAILURES = 3


class TaintMapper(Protocol):
    """What the publisher needs of `agent.health.taints.TaintPolicy`."""

    def taint_map(
        self, devices: Sequence[Device], support: ClusterTaintSupport
    ) -> Mapping[str, Sequence[DeviceTaint]]: ...


class NodeMissingError(KubeApiError):
    """Our Node object does not exist (yet); slices need it as their owner."""


@dataclass(frozen=True)
class PassResult:
    """What one reconcile pass did."""

    created: int = 0
    updated: int = 0
    deleted: int = 0
    rule_writes: int = 0

    @property
    def writes(self) -> int:
        return self.created + self.updated + self.deleted + self.rule_writes


class _Episode:
    """Logs a run of failures once when it starts and once when it ends."""

    def __init__(self, clock: Clock, driver: str) -> None:
        self._clock = clock
        self._driver = driver
        self._since: float | None = None
        self.failures = 0

    def failed(self, error: BaseException) -> None:
        self.failures += 1
        if self._since is not None:
            log.debug("publish retry failed", extra=log_fields(driver=self._driver, error=str(error)))
            return
        self._since = self._clock.monotonic()
        if isinstance(error, NodeMissingError):
            log.warning(
                "node object not found; slices are published once it exists",
                extra=log_fields(driver=self._driver, error=str(error)),
            )
        else:
            log.warning(
                "cannot publish ResourceSlices; retrying with backoff until the API server answers",
                extra=log_fields(driver=self._driver, error=f"{type(error).__name__}: {error}"),
            )

    def ok(self) -> None:
        if self._since is not None:
            log.info(
                "ResourceSlices published again",
                extra=log_fields(
                    driver=self._driver,
                    after_seconds=round(self._clock.monotonic() - self._since, 1),
                    failed_attempts=self.failures,
                ),
            )
        self._since = None
        self.failures = 0


class SlicePublisher:
    """Publishes the ResourceSlices of one driver (`inventory.driver`) on node `node_name`."""

    def __init__(
        self,
        kube: KubeClient,
        inventory: Inventory,
        node_name: str,
        *,
        policy: TaintMapper,
        clock: Clock,
        metrics: Metrics | None = None,
        events: EventRecorder | None = None,
        debounce_seconds: float = 0.05,
        min_write_interval: float = 0.6,
        resync_seconds: float = 300.0,
        backoff_initial: float = 0.2,
        backoff_max: float = 30.0,
        watch_timeout_seconds: int = 300,
        rng: random.Random | None = None,
        on_published: Callable[[bool, str], None] | None = None,
    ) -> None:
        self._kube = kube
        self._on_published = on_published
        self._inventory = inventory
        self.driver = inventory.driver
        self._node = node_name
        self._policy = policy
        self._clock = clock
        self._metrics = metrics
        self._events = events
        self._debounce = debounce_seconds
        self._min_write_interval = min_write_interval
        self._resync = resync_seconds
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._watch_timeout = watch_timeout_seconds
        self._rng = rng or random.Random()
        self._rules = TaintRuleSync(kube, self.driver, node_name, metrics=metrics)
        self._wake = anyio.Event()
        self._node_uid: str | None = None
        self._refresh_node = False
        self._own_versions: deque[str] = deque(maxlen=256)
        self._own_deletes: deque[str] = deque(maxlen=256)
        self._slice_taints: bool | None = None  # None: not decided until discovery info is read
        self._rules_cleanup = True
        self._rules_broken = False
        self._published_taints: dict[str, frozenset[tuple[str, str, str]]] = {}
        self._reported: dict[str, str] = {}
        self._last_refusal = ""
        self._unpublishable: set[str] = set()
        self._gauge_keys: set[tuple[str, str]] = set()
        self._episode = _Episode(clock, self.driver)
        self._last_write_at: float | None = None
        self._pass_lock = anyio.Lock()
        self.passes = 0
        """Reconcile passes run (tests and benchmarks read it)."""

    # ----- public -------------------------------------------------------------------------

    @property
    def taints_in_slices(self) -> bool:
        """False once the API server proved to drop slice taints (DeviceTaintRules are used then)."""
        return self._slice_taints_enabled()

    def trigger(self) -> None:
        """Ask for a reconcile pass soon."""
        self._wake.set()

    async def run(self) -> None:
        """Publish until cancelled; never raises anything but cancellation."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._follow_inventory)
            tg.start_soon(self._watch_slices)
            tg.start_soon(self._resync_timer)
            await self._reconcile_loop()

    # ----- loops --------------------------------------------------------------------------

    async def _follow_inventory(self) -> None:
        version = -1
        while True:
            version = await self._inventory.wait_changed(version)
            self._wake.set()

    async def _resync_timer(self) -> None:
        while True:
            await self._clock.sleep(self._resync)
            self._refresh_node = True
            self._rules_broken = False  # a feature gate may have been turned on meanwhile
            self._wake.set()

    async def _reconcile_loop(self) -> None:
        self._wake.set()
        while True:
            await self._wake.wait()
            await self._clock.sleep(self._debounce)
            if self._last_write_at is not None:
                # Leading edge is immediate; later writes in a storm are spaced out.
                wait = self._last_write_at + self._min_write_interval - self._clock.monotonic()
                if wait > 0:
                    await self._clock.sleep(wait)
            self._wake = anyio.Event()  # changes from here on need another pass
            try:
                result = await self.reconcile()
            except Exception as error:  # nothing may end the publisher; every failure is retried
                self._note_failure(error)
                if self._on_published is not None and self._episode.failures >= _NOT_READY_AFTER_FAILURES:
                    self._on_published(False, f"publishing failing: {error}")
                await self._clock.sleep(self._backoff(self._episode.failures))
                self._wake.set()
                continue
            self._episode.ok()
            if self._on_published is not None:
                self._on_published(True, "")
            if result.writes:
                self._last_write_at = self._clock.monotonic()

    def _note_failure(self, error: Exception) -> None:
        if isinstance(error, NodeMissingError):
            reason = "node_missing"
        elif isinstance(error, KubeApiError):
            reason = {0: "unreachable", 409: "conflict", 429: "throttled"}.get(
                error.status, "server_error" if error.status >= 500 else f"http_{error.status}"
            )
        else:
            reason = "internal"
            log.error(
                "unexpected error while publishing; retrying",
                exc_info=error,
                extra=log_fields(driver=self.driver),
            )
        refused = isinstance(error, KubeApiError) and error.status not in _RETRYABLE
        if refused and not isinstance(error, NodeMissingError) and self._last_refusal != str(error):
            # A refused request (RBAC, validation) is not an outage: say exactly what, keep retrying slowly.
            self._last_refusal = str(error)
            log.error("API server refused a ResourceSlice write", extra=log_fields(error=str(error)))
        self._episode.failed(error)
        if self._metrics is not None:
            self._metrics.publish_errors.labels(self.driver, reason).inc()
            self._metrics.api_retries.labels(reason).inc()

    def _backoff(self, failures: int) -> float:
        delay = min(self._backoff_max, self._backoff_initial * float(2 ** min(max(0, failures - 1), 30)))
        jitter: float = self._rng.uniform(0.5, 1.0)
        return delay * jitter

    async def _watch_slices(self) -> None:
        resource_version = ""
        failures = 0
        while True:
            reason = "closed"
            try:
                await self._kube.ensure_discovered()
                if not resource_version:
                    _, resource_version = await self._kube.list_resource_slices(
                        node_name=self._node, driver=self.driver
                    )
                    self._wake.set()  # we may have missed changes while not watching
                async for event in self._kube.watch_resource_slices(
                    node_name=self._node,
                    driver=self.driver,
                    resource_version=resource_version,
                    timeout_seconds=self._watch_timeout,
                ):
                    failures = 0
                    resource_version = event.resource_version or resource_version
                    if event.type == "BOOKMARK":
                        continue
                    if self._is_own(event.type, event.object):
                        continue
                    if event.type == "DELETED":
                        # Deleted by the garbage collector? The Node may have been recreated with a new uid.
                        self._refresh_node = True
                    log.debug(
                        "slice changed by someone else",
                        extra=log_fields(
                            event=event.type, slice=event.object.get("metadata", {}).get("name")
                        ),
                    )
                    self._wake.set()
            except KubeApiError as error:
                if error.status == 410:
                    reason, resource_version = "expired", ""
                else:
                    reason = "error"
                    failures += 1
                    log.debug("slice watch failed", extra=log_fields(driver=self.driver, error=str(error)))
                    self._wake.set()  # a reconcile pass notices (and logs) an outage
                    await self._clock.sleep(self._backoff(failures))
            except Exception as error:  # keep watching whatever happens
                reason = "internal"
                failures += 1
                log.error(
                    "slice watch crashed; restarting", exc_info=error, extra=log_fields(driver=self.driver)
                )
                await self._clock.sleep(self._backoff(failures))
            if self._metrics is not None:
                self._metrics.watch_restarts.labels(RESOURCE, reason).inc()

    def _is_own(self, kind: str, obj: Mapping[str, Any]) -> bool:
        meta = obj.get("metadata", {})
        if kind == "DELETED":
            return str(meta.get("name", "")) in self._own_deletes
        return str(meta.get("resourceVersion", "")) in self._own_versions

    # ----- one pass -----------------------------------------------------------------------

    def _slice_taints_enabled(self) -> bool:
        if self._slice_taints is None:
            self._slice_taints = self._kube.info.slice_taints_possible
            if not self._slice_taints:
                log.warning(
                    "this Kubernetes version has no device taints in ResourceSlices; using DeviceTaintRules "
                    "where served",
                    extra=log_fields(driver=self.driver, server=self._kube.info.git_version),
                )
        return self._slice_taints

    async def _ensure_node(self) -> str:
        if self._node_uid is None or self._refresh_node:
            try:
                node = await self._kube.get_node(self._node)
            except KubeApiError as error:
                if error.status == 404:
                    raise NodeMissingError(
                        f"node {self._node!r} does not exist in the API server (yet); check --node-name "
                        "matches the kubelet's node name",
                        404,
                        "NotFound",
                    ) from error
                raise
            self._node_uid = str(node.get("metadata", {}).get("uid", ""))
            self._refresh_node = False
        return self._node_uid

    async def reconcile(self) -> PassResult:
        """One pass: make our slices (and taint rules) match the inventory. Raises on API errors."""
        async with self._pass_lock:  # passes never overlap (a direct call may race the loop)
            return await self._reconcile()

    async def _reconcile(self) -> PassResult:
        self.passes += 1
        started = self._clock.monotonic()
        info = await self._kube.ensure_discovered()
        node_uid = await self._ensure_node()
        devices = self._inventory.devices()
        support = info.taint_support
        taint_map = self._policy.taint_map(devices, support)
        slice_taints = self._slice_taints_enabled()
        entries, problems = self._entries(devices, taint_map if slice_taints else {}, info.slice_version)
        valid, rejected = partition_entries(entries, support)
        await self._report_rejections([*problems, *rejected])
        valid_names = [str(e["name"]) for e in valid]
        published_taints = {n: taint_map[n] for n in valid_names if n in taint_map}
        limit = info.max_devices_with_taints if slice_taints else MAX_DEVICES_PER_SLICE
        for problem in check_slice_spec(
            driver=self.driver, node_name=self._node, pool_name=self._node, device_count=0, max_devices=limit
        ):
            # The whole pool is unpublishable (bad driver or node name): a config error, not retried fast.
            raise KubeApiError(f"cannot publish ResourceSlices: {problem}", 422, "Invalid")
        chunks = chunk_names(valid_names, set(), limit, limit)
        by_name: dict[str, dict[str, Any]] = {str(e["name"]): dict(e) for e in valid}

        current, _ = await self._kube.list_resource_slices(node_name=self._node, driver=self.driver)
        applied = await self._apply(
            current, [[by_name[n] for n in c] for c in chunks], node_uid, info.slice_version
        )
        if (applied.created or applied.updated) and self._taints_dropped_in(
            applied, published_taints if slice_taints else {}
        ):
            # The stored slices lack our taints: DRADeviceTaints is off. Adopt the stored form.
            self._slice_taints = False
            self._wake.set()
        rule_writes = await self._sync_rules(published_taints, slice_taints=self._slice_taints_enabled())
        result = PassResult(applied.created, applied.updated, applied.deleted, rule_writes)
        await self._after_pass(result, published_taints, len(chunks), started)
        return result

    def _entries(
        self, devices: Sequence[Device], taints: Mapping[str, Sequence[DeviceTaint]], api_version: str
    ) -> tuple[list[dict[str, Any]], list[Problem]]:
        entries: list[dict[str, Any]] = []
        problems: list[Problem] = []
        for device in devices:
            try:
                entries.append(device_to_api(device, taints.get(device.name, ()), api_version))
            except Exception as error:  # a malformed device must not stop the others
                problems.append(
                    Problem(str(getattr(device, "name", "?")), "device", str(error), "conversion")
                )
        return entries, problems

    async def _report_rejections(self, problems: Sequence[Problem]) -> None:
        now_bad = {p.device: str(p) for p in problems}
        for problem in problems:
            if self._reported.get(problem.device) == str(problem):
                continue
            self._reported[problem.device] = str(problem)
            log.error(
                "device left out of the ResourceSlice: it breaks an API server rule",
                extra=log_fields(driver=self.driver, device=problem.device, problem=str(problem)),
            )
            if self._metrics is not None:
                self._metrics.rejected_devices.labels(self.driver, problem.reason).inc()
            if self._events is not None:
                await self._events.record(
                    "DeviceRejected",
                    f"{self.driver}: device {problem.device} is not published: {problem}",
                    WARNING,
                )
        for device in [d for d in self._reported if d not in now_bad]:
            del self._reported[device]

    def _desired_slice(
        self,
        entries: Sequence[Mapping[str, Any]],
        *,
        generation: int,
        count: int,
        node_uid: str,
        api_version: str,
        current: Mapping[str, Any] | None,
    ) -> dict[str, Any]:
        metadata: dict[str, Any] = {}
        if current is not None:
            old = current.get("metadata", {})
            metadata = {k: v for k, v in old.items() if k not in ("managedFields",)}
            entries = [_keep_time_added(e, current) for e in entries]
        else:
            metadata["generateName"] = f"{self._node}-{self.driver}-"
        metadata["labels"] = {**metadata.get("labels", {}), MANAGED_BY_LABEL: MANAGED_BY}
        metadata["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "Node", "name": self._node, "uid": node_uid, "controller": True}
        ]
        return {
            "apiVersion": f"{API_GROUP}/{api_version}",
            "kind": "ResourceSlice",
            "metadata": metadata,
            "spec": {
                "driver": self.driver,
                "nodeName": self._node,
                "pool": {"name": self._node, "generation": generation, "resourceSliceCount": count},
                "devices": list(entries),
            },
        }

    def _differs(self, current: Mapping[str, Any], desired: Mapping[str, Any], generation: int) -> bool:
        spec = current.get("spec", {})
        want = desired["spec"]
        pool = spec.get("pool", {})
        if (
            pool.get("name") != self._node
            or pool.get("generation") != generation
            or pool.get("resourceSliceCount") != want["pool"]["resourceSliceCount"]
            or spec.get("nodeName") != self._node
            or any(
                spec.get(k) for k in ("nodeSelector", "allNodes", "perDeviceNodeSelection", "sharedCounters")
            )
        ):
            return True
        meta = current.get("metadata", {})
        if meta.get("labels", {}).get(MANAGED_BY_LABEL) != MANAGED_BY:
            return True
        owners = meta.get("ownerReferences") or []
        if [(o.get("kind"), o.get("name"), o.get("uid"), o.get("controller")) for o in owners] != [
            ("Node", self._node, desired["metadata"]["ownerReferences"][0]["uid"], True)
        ]:
            return True
        have = [semantic_device(d) for d in spec.get("devices") or []]
        return have != [semantic_device(d) for d in want["devices"]]

    async def _apply(
        self,
        current: list[dict[str, Any]],
        chunks: list[list[dict[str, Any]]],
        node_uid: str,
        api_version: str,
    ) -> _Applied:
        ours = [s for s in current if s.get("spec", {}).get("pool", {}).get("name") == self._node]
        obsolete = [s for s in current if s not in ours]
        generation = max((int(s["spec"]["pool"].get("generation", 0)) for s in ours), default=0)
        stale = [s for s in ours if int(s["spec"]["pool"].get("generation", 0)) < generation]
        obsolete += stale
        ours = [s for s in ours if s not in stale]

        # Pair desired chunks with current slices: one-to-one, else by identical device-name sets.
        pairs: list[tuple[list[dict[str, Any]], dict[str, Any] | None]] = []
        if len(ours) == 1 and len(chunks) == 1:
            pairs = [(chunks[0], ours[0])]
        else:
            free = list(ours)
            for chunk in chunks:
                names = frozenset(str(e["name"]) for e in chunk)
                match = next((s for s in free if device_names(s) == names), None)
                if match is not None:
                    free.remove(match)
                pairs.append((chunk, match))
            obsolete += free
        count = len(chunks)
        changed = [
            (chunk, cur)
            for chunk, cur in pairs
            if cur is not None
            and self._differs(
                cur,
                self._desired_slice(
                    chunk,
                    generation=generation,
                    count=count,
                    node_uid=node_uid,
                    api_version=api_version,
                    current=cur,
                ),
                generation,
            )
        ]
        new = [chunk for chunk, cur in pairs if cur is None]
        # Bump the generation when the pool's layout changes (slices added or removed), so consumers
        # never combine old and new layouts. Unlike the Go helper we do not bump when only device
        # contents change (taints): each device stays in one slice, and a storm then rewrites only
        # the slices whose devices changed instead of every slice of the pool.
        if ours and (new or obsolete):
            generation += 1
            changed = [(chunk, cur) for chunk, cur in pairs if cur is not None]

        applied = _Applied()
        for old in obsolete:
            meta = old.get("metadata", {})
            name = str(meta.get("name", ""))
            self._own_deletes.append(name)
            await self._write(
                "delete",
                self._kube.delete_resource_slice(
                    name, uid=str(meta.get("uid", "")), resource_version=str(meta.get("resourceVersion", ""))
                ),
            )
            applied.deleted += 1
        for chunk, cur in changed:
            body = self._desired_slice(
                chunk,
                generation=generation,
                count=count,
                node_uid=node_uid,
                api_version=api_version,
                current=cur,
            )
            stored = await self._write("update", self._kube.update_resource_slice(body))
            applied.updated += 1
            applied.stored.append((body, stored))
        for chunk in new:
            body = self._desired_slice(
                chunk,
                generation=generation,
                count=count,
                node_uid=node_uid,
                api_version=api_version,
                current=None,
            )
            stored = await self._write("create", self._kube.create_resource_slice(body))
            applied.created += 1
            applied.stored.append((body, stored))
        return applied

    async def _write(self, verb: str, call: Any) -> dict[str, Any]:
        try:
            stored = await call
        except KubeApiError as error:
            if self._metrics is not None:
                self._metrics.api_writes.labels(RESOURCE, verb, "error").inc()
            if verb == "delete" and error.status == 404:
                return {}
            raise
        if self._metrics is not None:
            self._metrics.api_writes.labels(RESOURCE, verb, "success").inc()
        if isinstance(stored, dict):
            version = stored.get("metadata", {}).get("resourceVersion")
            if version:
                self._own_versions.append(str(version))
            return stored
        return {}

    def _taints_dropped_in(self, applied: _Applied, taints: Mapping[str, Sequence[DeviceTaint]]) -> bool:
        if not taints:
            return False
        for sent, stored in applied.stored:
            stored_devices = {
                str(d.get("name")): flat_device(d) for d in stored.get("spec", {}).get("devices") or []
            }
            for entry in sent["spec"]["devices"]:
                flat = flat_device(entry)
                if flat.get("taints") and not stored_devices.get(str(flat.get("name")), {}).get("taints"):
                    log.warning(
                        "the API server dropped the device taints from our ResourceSlice (feature gate "
                        "DRADeviceTaints is off); publishing taints as DeviceTaintRules instead",
                        extra=log_fields(driver=self.driver, device=flat.get("name")),
                    )
                    if self._metrics is not None:
                        self._metrics.dropped_taint_fallbacks.labels(self.driver).inc()
                    return True
        return False

    async def _sync_rules(self, taints: Mapping[str, Sequence[DeviceTaint]], *, slice_taints: bool) -> int:
        if slice_taints and not self._rules_cleanup:
            return 0
        wanted = {} if slice_taints else taints
        if not self._rules.supported or self._rules_broken:
            await self._report_unpublishable(wanted)
            self._rules_cleanup = False
            return 0
        try:
            writes = await self._rules.sync(wanted)
        except KubeApiError as error:
            if error.status not in (403, 404, 405):
                raise
            self._rules_broken = True
            log.error(
                "DeviceTaintRules cannot be written; unhealthy devices stay published without taints",
                extra=log_fields(driver=self.driver, error=str(error)),
            )
            await self._report_unpublishable(wanted)
            return 0
        if slice_taints:
            self._rules_cleanup = False
        self._unpublishable = set()
        return writes

    async def _report_unpublishable(self, taints: Mapping[str, Sequence[DeviceTaint]]) -> None:
        for device in sorted(set(taints) - self._unpublishable):
            text = ", ".join(_taint_text(t) for t in taints[device])
            log.error(
                "device is unhealthy but the cluster accepts neither slice taints nor DeviceTaintRules; "
                "it stays published (enable the DRADeviceTaints and DRADeviceTaintRules feature gates)",
                extra=log_fields(driver=self.driver, device=device, taints=text),
            )
            if self._metrics is not None:
                self._metrics.publish_errors.labels(self.driver, "taints_unsupported").inc()
            if self._events is not None:
                await self._events.record(
                    "DeviceTaintUnsupported",
                    f"{self.driver}: device {device} should be tainted ({text}) but the cluster accepts no "
                    "device taints",
                    WARNING,
                )
        self._unpublishable = set(taints)

    async def _after_pass(
        self,
        result: PassResult,
        taints: Mapping[str, Sequence[DeviceTaint]],
        slice_count: int,
        started: float,
    ) -> None:
        if result.writes:
            log.info(
                "ResourceSlices published",
                extra=log_fields(
                    driver=self.driver,
                    created=result.created,
                    updated=result.updated,
                    deleted=result.deleted,
                    taint_rule_writes=result.rule_writes,
                ),
            )
        if self._metrics is not None:
            self._metrics.slices_published.labels(self.driver).set(slice_count)
            if result.writes:
                self._metrics.publish_latency.labels(self.driver).observe(self._clock.monotonic() - started)
            counts: dict[tuple[str, str], int] = {}
            for device_taints in taints.values():
                for t in device_taints:
                    counts[(t.key, t.effect)] = counts.get((t.key, t.effect), 0) + 1
            for key in self._gauge_keys | set(counts):
                self._metrics.taints.labels(self.driver, key[0], key[1]).set(counts.get(key, 0))
            self._gauge_keys |= set(counts)
        await self._taint_events(taints)

    async def _taint_events(self, taints: Mapping[str, Sequence[DeviceTaint]]) -> None:
        now = {d: frozenset(taint_identity(_taint_dict(t)) for t in ts) for d, ts in taints.items()}
        health = {d.name: d.health for d in self._inventory.devices()}
        for device in sorted(set(now) | set(self._published_taints)):
            added = now.get(device, frozenset()) - self._published_taints.get(device, frozenset())
            lifted = self._published_taints.get(device, frozenset()) - now.get(device, frozenset())
            for key, value, effect in sorted(added):
                why = health[device].message if device in health else ""
                log.info(
                    "device tainted",
                    extra=log_fields(
                        driver=self.driver, device=device, taint=key, value=value, effect=effect
                    ),
                )
                if self._events is not None:
                    await self._events.record(
                        "DeviceTainted",
                        f"{self.driver}: device {device} tainted {_identity_text(key, value, effect)}"
                        + (f": {why}" if why else ""),
                        WARNING,
                    )
            for key, value, effect in sorted(lifted):
                log.info(
                    "device taint lifted",
                    extra=log_fields(
                        driver=self.driver, device=device, taint=key, value=value, effect=effect
                    ),
                )
                if self._events is not None:
                    reason = "the device is gone" if device not in health else "the condition cleared"
                    await self._events.record(
                        "DeviceTaintLifted",
                        f"{self.driver}: device {device} taint {_identity_text(key, value, effect)} "
                        f"lifted: {reason}",
                        NORMAL,
                    )
        self._published_taints = now


@dataclass
class _Applied:
    created: int = 0
    updated: int = 0
    deleted: int = 0

    def __post_init__(self) -> None:
        self.stored: list[tuple[dict[str, Any], dict[str, Any]]] = []


def _taint_dict(taint: DeviceTaint) -> dict[str, str]:
    return {"key": taint.key, "value": taint.value, "effect": taint.effect}


def _identity_text(key: str, value: str, effect: str) -> str:
    return f"{key}{'=' + value if value else ''}:{effect}"


def _taint_text(taint: DeviceTaint) -> str:
    return _identity_text(taint.key, taint.value, taint.effect)


def _keep_time_added(entry: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, Any]:
    """Carry over the stored ``timeAdded`` of taints that stay, so an update does not reset it."""
    name = entry.get("name")
    stored = next(
        (flat_device(d) for d in current.get("spec", {}).get("devices") or [] if d.get("name") == name), None
    )
    if not stored or not stored.get("taints"):
        return dict(entry)
    times = {taint_identity(t): t.get("timeAdded") for t in stored["taints"] if t.get("timeAdded")}
    wrapped = "basic" in entry
    body = dict(entry["basic"] if wrapped else entry)
    if not body.get("taints"):
        return dict(entry)
    body["taints"] = [
        {**t, "timeAdded": times[taint_identity(t)]}
        if taint_identity(t) in times and "timeAdded" not in t
        else t
        for t in body["taints"]
    ]
    return {"name": name, "basic": body} if wrapped else body
