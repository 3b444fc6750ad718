"""The ResourceSlice publisher: keeps one driver's pool on this node equal to the inventory.

One pool per driver, named after the node. Triggers (inventory changes, watch events on our
slices, a resync timer) are coalesced by a short debounce and a minimum interval between
writing passes, so a storm of health events becomes a few writes and the final state is always
published. A pass asks the pure pool reconciler (`agent.kube.pool`: the Go slice controller's rules) which
writes turn the stored slices into the desired ones, and sends them: deletes (with
preconditions), updates, creates; when the stored slices already match it writes nothing.
What the server accepts (taints kept? the ``None`` effect?) comes from a dry-run probe
(`agent.kube.capabilities`) at start and after a control-plane upgrade. Logs, Events (sent from
their own queue and task) and metrics are in `agent.kube.report`.

The stored slices, the probes, discovery and the Node's uid come from `agent.kube.nodecache`,
shared by the publishers of a process: one LIST and one WATCH for the node, passes read the
store (no LIST per pass), our own writes never wake a pass, probes and discovery once per process.

Failures are retried with capped exponential backoff, fully jittered (`agent.kube.jitter`); an
episode of failures is logged once when it starts and once when it ends. `SlicePublisher.run`
only ends by cancellation.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import anyio

from agent.core.clock import Clock
from agent.core.errors import KubeApiError
from agent.core.inventory import Inventory
from agent.core.logs import log_fields
from agent.core.model import Device
from agent.health.taints import ClusterTaintSupport, DeviceTaint
from agent.kube import capabilities, jitter
from agent.kube.capabilities import Capabilities
from agent.kube.client import KubeClient
from agent.kube.events import EventQueue, EventRecorder
from agent.kube.nodecache import NodeApiCache, NodeMissingError
from agent.kube.pool import PoolPlan, PoolTarget, desired_pool, plan_pool
from agent.kube.published import PublishedTaint, slice_taints
from agent.kube.report import SHARES, PoolReport
from agent.kube.slices import flat_device, server_minor, without_counters, without_shares
from agent.kube.validation import check_slice_spec
from agent.observe.metrics import Metrics

COUNTERS_SAID = "shared counters"
SHARES_SAID = "sharing fields"
log = logging.getLogger("agent.kube.publisher")

RESOURCE = "resourceslices"
_RETRYABLE = {0, 409, 429, 500, 502, 503, 504}
# One failed pass is a blip the retry absorbs; this many in a row make the agent not ready.
_NOT_READY_AFTER_FAILURES = 3


class TaintMapper(Protocol):
    """What the publisher needs of `agent.health.taints.TaintPolicy`."""

    def taint_map(
        self, devices: Sequence[Device], support: ClusterTaintSupport
    ) -> Mapping[str, Sequence[DeviceTaint]]: ...


__all__ = ["NodeMissingError", "PassResult", "SlicePublisher", "TaintMapper"]


@dataclass(frozen=True)
class PassResult:
    """What one reconcile pass did."""

    created: int = 0
    updated: int = 0
    deleted: int = 0

    @property
    def writes(self) -> int:
        return self.created + self.updated + self.deleted


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
        watch_timeout_seconds: float = 300.0,
        rng: random.Random | None = None,
        on_published: Callable[[bool, str], None] | None = None,
        event_queue_size: int = 64,
        shared: NodeApiCache | None = None,
    ) -> None:
        """`shared`: the process's `NodeApiCache` (one for every driver); without it the publisher
        keeps a private one for its driver, with its resync, watch timeout, backoff and `rng`."""
        self._kube = kube
        self._on_published = on_published
        self._inventory = inventory
        self.driver = inventory.driver
        self._node = node_name
        self._policy = policy
        self._clock = clock
        self._metrics = metrics
        self.events = EventQueue(events, capacity=event_queue_size) if events is not None else None
        self._report = PoolReport(self.driver, metrics=metrics, events=self.events)
        self._debounce = debounce_seconds
        self._min_write_interval = min_write_interval
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._rng = rng or random.Random()
        if shared is None:
            shared = NodeApiCache(
                kube,
                node_name,
                clock=clock,
                driver=self.driver,
                resync_seconds=resync_seconds,
                watch_timeout_seconds=watch_timeout_seconds,
                backoff_initial=backoff_initial,
                backoff_max=backoff_max,
                rng=self._rng,
                metrics=metrics,
            )
        self._shared = shared
        shared.register(self.driver, self)
        self._wake = anyio.Event()
        self._probe_again = False
        self._capabilities: Capabilities | None = None
        self._said: dict[str, bool] = {}
        """What the last probe said of each optional field ("shared counters", "sharing fields")."""
        self._episode = _Episode(clock, self.driver)
        self._last_refusal = ""
        self._last_write_at: float | None = None
        self._pass_lock = anyio.Lock()
        self.passes = 0
        """Reconcile passes run (tests and benchmarks read it)."""

    # ----- public -------------------------------------------------------------------------

    @property
    def shared(self) -> NodeApiCache:
        """The node's cache this publisher reads its slices, probes and Node from."""
        return self._shared

    @property
    def capabilities(self) -> Capabilities | None:
        """What the server accepts in our slices (None before the first pass)."""
        return self._capabilities

    @property
    def taints_in_slices(self) -> bool:
        """False once the API server proved to drop slice taints (the devices are then unpublishable)."""
        return self._capabilities is None or self._capabilities.slice_taints

    def trigger(self) -> None:
        """Ask for a reconcile pass soon."""
        self._wake.set()

    async def published_taints(self, *, fresh: bool = False) -> list[PublishedTaint]:
        """The device taints in our slices (`agent.kube.published`), from the shared store: the
        seed at start costs no LIST of its own. `fresh`: as the API server has them now (taking
        over from another pod). Raises `KubeApiError` when unreadable."""
        await self._kube.ensure_discovered()
        shared = self._shared
        items = await (shared.fresh_slices(self.driver) if fresh else shared.slices(self.driver))
        return slice_taints(items, self._node)

    async def run(self) -> None:
        """Publish until cancelled; never raises anything but cancellation."""
        async with anyio.create_task_group() as tg:
            if self.events is not None:
                tg.start_soon(self.events.run)
            tg.start_soon(self._follow_inventory)
            tg.start_soon(self._shared.attach)  # the node's watch and resync, run by one publisher
            await self._reconcile_loop()

    # ----- loops --------------------------------------------------------------------------

    async def _follow_inventory(self) -> None:
        version = -1
        while True:
            version = await self._inventory.wait_changed(version)
            self._wake.set()

    # ----- what the shared cache tells us (`agent.kube.nodecache.SliceListener`) ---------

    def slice_changed(self, kind: str, obj: Mapping[str, Any]) -> None:
        if kind == "DELETED":
            # Deleted by the garbage collector? The Node may have been recreated with a new uid.
            self._shared.forget_node()
        log.debug(
            "slice changed by someone else",
            extra=log_fields(event=kind, slice=obj.get("metadata", {}).get("name")),
        )
        self._wake.set()

    def resynced(self, answered: bool) -> None:
        if answered:
            self._version_read()
        self._wake.set()

    def version_checked(self) -> None:
        self._version_read()

    def watch_broken(self) -> None:
        self._wake.set()

    def _version_read(self) -> None:
        """The server's version was read again (`KubeClient.info`, discovery re-run if it changed):
        probe again after an upgrade or while taints are dropped."""
        before = self._capabilities
        if before is None or not self._kube.has_info:
            return
        info = self._kube.info
        if info.git_version != before.server_version or not before.slice_taints or not before.probed:
            if info.git_version != before.server_version:
                log.info(
                    "the API server's version changed; probing what it accepts again",
                    extra=log_fields(driver=self.driver, before=before.server_version, now=info.git_version),
                )
            self._capabilities = None
            self._probe_again = True
            self._wake.set()
        elif before.counters is not None or before.shares is not None:
            # Ask again at each resync (the gate may have changed). A gate turned off later keeps
            # the fields of our slices (in use), so no write would show it; the probe's create would.
            self._capabilities = before.with_counters(None).with_shares(None)

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
                if isinstance(error, KubeApiError) and error.status == 409:
                    self._shared.invalidate()  # our copy of a slice was stale: read them again
                self._note_failure(error)
                if self._on_published is not None and self._episode.failures >= _NOT_READY_AFTER_FAILURES:
                    self._on_published(False, f"publishing failing: {error}")
                await self._clock.sleep(self._backoff(self._episode.failures))
                self._wake.set()
                continue
            self._episode.ok()
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
        return jitter.backoff(failures, self._backoff_initial, self._backoff_max, self._rng)

    # ----- one pass -----------------------------------------------------------------------

    async def _ensure_node(self) -> str:
        return await self._shared.node_uid()

    async def _ensure_capabilities(self) -> Capabilities:
        if self._capabilities is not None:
            return self._capabilities
        found = await self._shared.capabilities(self.driver, again=self._probe_again)
        self._probe_again = False
        self._capabilities = found
        return found

    async def _probe_kept(self, what: str, probe: Callable[..., Awaitable[bool]]) -> bool:
        """Whether the server keeps `what` ("shared counters", "sharing fields"), asked with `probe`
        (kept, when it cannot say and no write showed otherwise)."""
        try:
            kept = await self._shared.kept(what, probe, self.driver)
        except KubeApiError as error:
            if error.status in (0, 429) or error.status >= 500:
                raise  # an outage: retried with backoff like any pass
            # Refused: the writes show whether the fields are dropped (`_counters_dropped`,
            # `_shares_dropped`), and what they showed stands (no rewrite at each resync).
            kept = self._said.get(what) is not False
            log.warning(
                f"cannot probe whether the API server keeps {what}",
                extra=log_fields(driver=self.driver, error=str(error), assumed=kept),
            )
        if kept != self._said.get(what):
            self._said[what] = kept
            log.info(f"API server {what} probed", extra=log_fields(driver=self.driver, kept=kept))
        return kept

    async def reconcile(self) -> PassResult:
        """One pass: make our slices match the inventory. Raises on API errors."""
        async with self._pass_lock:  # passes never overlap (a direct call may race the loop)
            return await self._reconcile()

    async def _reconcile(self) -> PassResult:
        self.passes += 1
        started = self._clock.monotonic()
        for problem in check_slice_spec(
            driver=self.driver, node_name=self._node, pool_name=self._node, device_count=0
        ):
            # The whole pool is unpublishable (bad driver or node name): a config error, not retried fast.
            raise KubeApiError(f"cannot publish ResourceSlices: {problem}", 422, "Invalid")
        info = await self._kube.ensure_discovered()
        caps = await self._ensure_capabilities()
        node_uid = await self._ensure_node()
        devices: Sequence[Device] = self._inventory.devices()
        if caps.counters is None and any(d.counter_sets or d.consumes_counters for d in devices):
            kept = await self._probe_kept(COUNTERS_SAID, capabilities.probe_counters)
            caps = self._capabilities = caps.with_counters(kept)
        if caps.shares is None and any(d.allow_multiple_allocations for d in devices):
            kept = await self._probe_kept(SHARES_SAID, capabilities.probe_shares)
            caps = self._capabilities = caps.with_shares(kept)
        withheld: list[str] = []
        if caps.counters is False:
            devices, withheld = without_counters(devices)
        exclusive: list[str] = []
        if caps.shares is False:
            devices, exclusive = without_shares(devices)
        wanted = self._policy.taint_map(devices, caps.taint_support)
        desired = desired_pool(
            devices,
            wanted if caps.slice_taints else {},
            support=caps.taint_support,
            api_version=info.slice_version,
            max_devices=caps.max_devices_per_slice,
            minor=server_minor(info.git_version),
        )
        self._report.rejected(desired.problems)
        current = await self._shared.slices(self.driver)
        target = PoolTarget(self.driver, self._node, node_uid, info.slice_version)
        plan = plan_pool(current, desired.chunks, target, desired.counters)
        stored = await self._apply(plan)
        published = desired.taints
        dropped = _taints_dropped(plan, stored) if desired.taints else ""
        if dropped:
            # The stored slices lack our taints: DRADeviceTaints is off. Stop sending them (the
            # next pass rewrites the slices without) until a probe finds them kept again.
            log.warning(
                "the API server dropped the device taints from our ResourceSlice (feature gate "
                "DRADeviceTaints is off)",
                extra=log_fields(driver=self.driver, device=dropped),
            )
            if self._metrics is not None:
                self._metrics.taints_dropped.labels(self.driver).inc()
            caps = self._capabilities = caps.without_slice_taints()
            published = {}
            self._wake.set()
        if counters_dropped := _counters_dropped(stored):
            # DRAPartitionableDevices is off though the probe said otherwise (or could not ask):
            # the next pass publishes the whole devices only, until a probe finds counters kept.
            log.warning(
                "the API server dropped the shared counters from our ResourceSlice (feature gate "
                "DRAPartitionableDevices is off)",
                extra=log_fields(driver=self.driver, device=counters_dropped),
            )
            caps = self._capabilities = caps.with_counters(False)
            self._said[COUNTERS_SAID] = False
            self._wake.set()
        if shares_dropped := _shares_dropped(stored):
            # DRAConsumableCapacity is off though the probe said otherwise (or could not ask): the
            # next pass publishes the devices for exclusive use, until a probe finds the fields kept.
            log.warning(
                "the API server dropped allowMultipleAllocations from our ResourceSlice (feature gate "
                f"{SHARES.gate} is off)",
                extra=log_fields(driver=self.driver, device=shares_dropped),
            )
            caps = self._capabilities = caps.with_shares(False)
            self._said[SHARES_SAID] = False
            self._wake.set()
        if not caps.slice_taints:
            valid = {str(e["name"]) for chunk in desired.chunks for e in chunk}
            detail = self._report.unpublishable(
                {d: t for d, t in wanted.items() if d in valid}, info.git_version
            )
        else:
            detail = self._report.unpublishable({}, info.git_version)
        details = (
            detail,
            self._report.counters_unpublishable(withheld, info.git_version),
            self._report.episode(SHARES, exclusive, info.git_version),
        )
        detail = "; ".join(x for x in details if x)
        result = PassResult(len(plan.creates), len(plan.updates), len(plan.deletes))
        self._after_pass(result, published, len(desired.chunks), started)
        if self._on_published is not None:
            self._on_published(True, detail)
        return result

    async def _apply(self, plan: PoolPlan) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """Send the plan's writes; returns (sent, stored) for each create and update.

        Watch events that arrive meanwhile are judged once the answers are in: our own ADDED
        event can come before our create's answer (`NodeApiCache.writing`).
        """
        stored: list[tuple[dict[str, Any], dict[str, Any]]] = []
        with self._shared.writing(self.driver):
            for old in plan.deletes:
                meta = old.get("metadata", {})
                name = str(meta.get("name", ""))
                self._shared.deleting(name)
                await self._write(
                    "delete",
                    self._kube.delete_resource_slice(
                        name,
                        uid=str(meta.get("uid", "")),
                        resource_version=str(meta.get("resourceVersion", "")),
                    ),
                )
                self._shared.deleted(name)
            for body in plan.updates:
                stored.append((body, await self._write("update", self._kube.update_resource_slice(body))))
            for body in plan.creates:
                stored.append((body, await self._write("create", self._kube.create_resource_slice(body))))
        return stored

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
            self._shared.wrote(stored)
            return stored
        return {}

    def _after_pass(
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
                    driver=self.driver, created=result.created, updated=result.updated, deleted=result.deleted
                ),
            )
        if self._metrics is not None:
            self._metrics.slices_published.labels(self.driver).set(slice_count)
            if result.writes:
                self._metrics.publish_latency.labels(self.driver).observe(self._clock.monotonic() - started)
        self._report.published(taints, {d.name: d.health.message for d in self._inventory.devices()})


def _taints_dropped(plan: PoolPlan, stored: Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]]) -> str:
    """A device whose taints a create or update sent and the answer lacks ("" if none): the Go
    controller's ``DroppedFieldsError`` for ``DRADeviceTaints``."""
    if not plan.creates and not plan.updates:
        return ""
    for sent, answer in stored:
        kept = {
            str(d.get("name")): bool(flat_device(d).get("taints"))
            for d in answer.get("spec", {}).get("devices") or []
            if isinstance(d, Mapping)
        }
        for entry in sent["spec"]["devices"]:
            if flat_device(entry).get("taints") and not kept.get(str(entry.get("name")), False):
                return str(entry.get("name"))
    return ""


def _shares_dropped(stored: Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]]) -> str:
    """A shareable device that a create or update sent and the answer stores exclusive ("" if none):
    ``dropDisabledDRAConsumableCapacityFields`` at work."""
    for sent, answer in stored:
        if not answer:
            continue  # no body to compare (a fake client)
        shareable = {
            str(d.get("name"))
            for d in answer.get("spec", {}).get("devices") or []
            if isinstance(d, Mapping) and flat_device(d).get("allowMultipleAllocations")
        }
        for entry in sent.get("spec", {}).get("devices") or []:
            if flat_device(entry).get("allowMultipleAllocations") and str(entry.get("name")) not in shareable:
                return str(entry.get("name"))
    return ""


def _counters_dropped(stored: Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]]) -> str:
    """A counter set or consuming device that a create or update sent and the answer lacks ("" if
    none): ``dropDisabledDRAPartitionableDevicesFields`` at work."""
    for sent, answer in stored:
        if not answer:
            continue  # no body to compare (a fake client)
        spec, kept = sent.get("spec", {}), answer.get("spec", {})
        if spec.get("sharedCounters") and not kept.get("sharedCounters"):
            return str(spec["sharedCounters"][0].get("name"))
        consuming = {
            str(d.get("name"))
            for d in kept.get("devices") or []
            if isinstance(d, Mapping) and flat_device(d).get("consumesCounters")
        }
        for entry in spec.get("devices") or []:
            if flat_device(entry).get("consumesCounters") and str(entry.get("name")) not in consuming:
                return str(entry.get("name"))
    return ""
