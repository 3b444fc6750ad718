"""What one agent process knows of the API server, shared by every driver's publisher.

One `NodeApiCache` per process (`agent.runner.AgentParts` builds it; a publisher built alone gets a
private one for its driver) holds:

- **Our slices**, read with one LIST and kept current by one WATCH (``spec.nodeName=<node>``, every
  driver of the node), as the DRA resourceslice controller keeps them
  (``staging/src/k8s.io/dynamic-resource-allocation/resourceslice/resourceslicecontroller.go``: an
  informer, no resync, synced from the store). The taint seed at start, the watch and every
  reconcile pass read the same store: one LIST at start, one after a broken watch (410 or error),
  none for a watch that merely timed out (it resumes from its resourceVersion, as the client-go
  reflector does). The answers of our own creates and updates go into the store at once when newer
  than what it holds (``cache.NewIntegerResourceVersionMutationCache`` in that controller), so a
  pass right after a write sees it.
- **Our own writes in the watch stream**: an event whose resourceVersion one of our writes
  returned, or the deletion of a slice we deleted, wakes nobody. An event that arrives while the
  driver's writes are in flight (our ADDED can come before our create's answer) is held until they
  end and judged then.
- **Discovery and the capability probes**, once per process: the version is read again at each
  resync and after a broken watch, discovery and the probes repeat only when it changed (or when
  a publisher asks to probe again at a resync, at most once per resync for the whole process).
- **The Node's uid** (the owner of our slices), read once for all drivers and kept, as the
  resourceslice controller keeps it ("expected to not change while the controller runs",
  ``syncPool``); read again when someone else deleted one of our slices (the garbage collector
  after the Node was recreated with a new uid) or while the Node does not exist.

Periodic work is jittered (`agent.kube.jitter`): the resync interval, the watch's timeout and the
reconnect backoff, so a fleet started together drifts apart and stays apart.
"""

from __future__ import annotations

import copy
import logging
import random
from collections import Counter, deque
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Protocol

import anyio

from agent.core.clock import Clock
from agent.core.errors import KubeApiError
from agent.core.logs import log_fields
from agent.kube import capabilities, jitter
from agent.kube.capabilities import Capabilities
from agent.kube.client import KubeClient, WatchEvent
from agent.observe.metrics import Metrics

log = logging.getLogger("agent.kube.nodecache")

RESOURCE = "resourceslices"
WATCH_BACKOFF_INITIAL = 0.8
"""The client-go reflector's backoff start (``NewExponentialBackoffManager(800ms, 30s, ...)``)."""
WATCH_BACKOFF_MAX = 30.0


class NodeMissingError(KubeApiError):
    """Our Node object does not exist (yet); slices need it as their owner."""


class SliceListener(Protocol):
    """What the cache tells a driver's publisher (`agent.kube.publisher.SlicePublisher`)."""

    def slice_changed(self, kind: str, obj: Mapping[str, Any]) -> None:
        """Someone else changed one of the driver's slices."""

    def resynced(self, answered: bool) -> None:
        """The resync interval passed (`answered`: the API server's version was read)."""

    def version_checked(self) -> None:
        """The version was read again after a broken watch."""

    def watch_broken(self) -> None:
        """The watch failed or had to list again: changes may have been missed."""


def _rv(obj: Mapping[str, Any] | None) -> int | None:
    text = str((obj or {}).get("metadata", {}).get("resourceVersion", ""))
    return int(text) if text.isdigit() else None


def _newer(obj: Mapping[str, Any], than: Mapping[str, Any] | None) -> bool:
    """Whether `obj` may replace `than` (integer resourceVersions compared; otherwise the later wins)."""
    new, old = _rv(obj), _rv(than)
    return new is None or old is None or new >= old


def _name(obj: Mapping[str, Any]) -> str:
    return str(obj.get("metadata", {}).get("name", ""))


def _driver(obj: Mapping[str, Any]) -> str:
    return str(obj.get("spec", {}).get("driver", ""))


class NodeApiCache:
    """Discovery, probes, the Node's uid and the slices of node `node_name`, for every publisher of a process.

    `driver` limits the LIST and WATCH to one driver (a publisher's private cache); None watches
    every driver of the node. The list/watch and resync loops run inside `attach`, which every
    publisher runs: one of them runs the loops, the others take over when it stops.
    """

    def __init__(
        self,
        kube: KubeClient,
        node_name: str,
        *,
        clock: Clock,
        driver: str | None = None,
        resync_seconds: float = 300.0,
        watch_timeout_seconds: float = 300.0,
        backoff_initial: float = WATCH_BACKOFF_INITIAL,
        backoff_max: float = WATCH_BACKOFF_MAX,
        rng: random.Random | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self._kube = kube
        self.node_name = node_name
        self._driver = driver
        self._clock = clock
        self._resync = resync_seconds
        self._watch_timeout = watch_timeout_seconds
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._rng = rng or random.Random()
        self._metrics = metrics
        self._listeners: dict[str, SliceListener] = {}
        # The store.
        self._items: dict[str, dict[str, Any]] = {}
        self.resource_version = ""
        self.synced = False
        self._listed_rv: int | None = None
        self._list_lock = anyio.Lock()
        self.lists = 0
        """LISTs sent (tests read it)."""
        # Our own writes.
        self._own_versions: deque[str] = deque(maxlen=1024)
        self._own_deletes: deque[str] = deque(maxlen=1024)
        self._writing: Counter[str] = Counter()
        self._held: dict[str, list[tuple[str, dict[str, Any]]]] = {}
        # Discovery, probes, the Node.
        self.epoch = 0
        """Resyncs so far: what was learnt in an earlier one may be asked again."""
        self._version_lock = anyio.Lock()
        self._caps: Capabilities | None = None
        self._caps_epoch = -1
        self._caps_lock = anyio.Lock()
        self._kept: dict[str, tuple[int, str, bool]] = {}
        self._kept_lock = anyio.Lock()
        self._node_uid: str | None = None
        self._node_lock = anyio.Lock()
        # Who runs the loops.
        self._running = False
        self._released = anyio.Event()

    def register(self, driver: str, listener: SliceListener) -> None:
        """Tell `listener` about `driver`'s slices and the resyncs."""
        self._listeners[driver] = listener

    @property
    def watching(self) -> bool:
        """Whether a publisher runs the list/watch loop now."""
        return self._running

    # ----- the loops ----------------------------------------------------------------------

    async def attach(self) -> None:
        """Run the watch and resync loops unless another publisher does; take over when it stops."""
        while True:
            if self._running:
                await self._released.wait()
                continue
            self._running = True
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._resync_loop)
                    await self._watch_loop()
            finally:
                self._running = False
                released, self._released = self._released, anyio.Event()
                released.set()

    async def _resync_loop(self) -> None:
        while True:
            await self._clock.sleep(jitter.resync_wait(self._resync, self._rng))
            self.epoch += 1
            answered = await self.check_version()
            for listener in list(self._listeners.values()):
                listener.resynced(answered)

    def backoff(self, failures: int) -> float:
        """The delay before reconnect number `failures` (full jitter, `agent.kube.jitter.backoff`)."""
        return jitter.backoff(failures, self._backoff_initial, self._backoff_max, self._rng)

    async def _watch_loop(self) -> None:
        failures = 0
        recheck = False
        while True:
            reason = "closed"
            try:
                await self._kube.ensure_discovered()
                if recheck:
                    # A control-plane upgrade restarts the API server and cuts the watch: read its
                    # version before watching again.
                    if not await self.check_version():
                        raise KubeApiError("GET /version: the API server did not answer")
                    recheck = False
                    for listener in list(self._listeners.values()):
                        listener.version_checked()
                if await self.ensure_synced():
                    self._tell_broken()  # listed again: changes may have been missed
                async for event in self._kube.watch_resource_slices(
                    node_name=self.node_name,
                    driver=self._driver,
                    resource_version=self.resource_version,
                    timeout_seconds=jitter.watch_timeout(self._watch_timeout, self._rng),
                ):
                    failures = 0
                    self._apply(event)
            except KubeApiError as error:
                self.synced = False  # the next reader lists (once, shared)
                if error.status == 410:
                    reason = "expired"
                else:
                    reason, recheck = "error", True
                    failures += 1
                    log.debug("slice watch failed", extra=log_fields(node=self.node_name, error=str(error)))
                    self._tell_broken()  # a reconcile pass notices (and logs) an outage
                    await self._clock.sleep(self.backoff(failures))
            except Exception as error:  # keep watching whatever happens
                reason = "internal"
                self.synced = False
                failures += 1
                log.error("slice watch crashed; restarting", exc_info=error)
                await self._clock.sleep(self.backoff(failures))
            if self._metrics is not None:
                self._metrics.watch_restarts.labels(RESOURCE, reason).inc()

    def _tell_broken(self) -> None:
        for listener in list(self._listeners.values()):
            listener.watch_broken()

    # ----- the store ----------------------------------------------------------------------

    async def ensure_synced(self) -> bool:
        """LIST our slices unless the store is current; True if this call listed."""
        async with self._list_lock:
            if self.synced:
                return False
            items, version = await self._kube.list_resource_slices(
                node_name=self.node_name, driver=self._driver
            )
            self.lists += 1
            self._items = {_name(i): i for i in items}
            self.resource_version = version
            self._listed_rv = int(version) if version.isdigit() else None
            self.synced = True
            return True

    def invalidate(self) -> None:
        """The store may be stale (a write conflicted): the next reader lists again."""
        self.synced = False

    async def slices(self, driver: str) -> list[dict[str, Any]]:
        """`driver`'s slices on our node (copies: a caller may change them); lists first if needed."""
        await self.ensure_synced()
        return [
            copy.deepcopy(obj)
            for obj in self._items.values()
            if _driver(obj) == driver and obj.get("spec", {}).get("nodeName") == self.node_name
        ]

    async def fresh_slices(self, driver: str) -> list[dict[str, Any]]:
        """`driver`'s slices as the API server has them now: the store while a watch keeps it
        current, else after a new LIST."""
        if not self._running:
            self.synced = False
        return await self.slices(driver)

    def _apply(self, event: WatchEvent) -> None:
        if event.resource_version:
            self.resource_version = event.resource_version
        if event.type == "BOOKMARK":
            return
        obj, name = event.object, _name(event.object)
        stored = self._items.get(name)
        version = _rv(obj)
        if version is not None and self._listed_rv is not None and version <= self._listed_rv:
            pass  # a LIST since (a conflict's) already holds this change
        elif event.type == "DELETED":
            if stored is not None and _newer(obj, stored):
                del self._items[name]
        elif _newer(obj, stored):
            self._items[name] = obj
        driver = _driver(obj)
        if driver not in self._listeners:
            return  # another driver's slice on this node
        if self._writing[driver]:
            self._held.setdefault(driver, []).append((event.type, obj))  # judged once the writes end
            return
        self._judge(driver, event.type, obj)

    def _judge(self, driver: str, kind: str, obj: dict[str, Any]) -> None:
        if kind == "DELETED":
            own = _name(obj) in self._own_deletes
        else:
            own = str(obj.get("metadata", {}).get("resourceVersion", "")) in self._own_versions
        if not own:
            self._listeners[driver].slice_changed(kind, obj)

    # ----- our writes ---------------------------------------------------------------------

    @contextmanager
    def writing(self, driver: str) -> Iterator[None]:
        """Around `driver`'s writes: its watch events wait for their answers to be judged."""
        self._writing[driver] += 1
        try:
            yield
        finally:
            self._writing[driver] -= 1
            if not self._writing[driver]:
                for kind, obj in self._held.pop(driver, []):
                    self._judge(driver, kind, obj)

    def wrote(self, stored: Mapping[str, Any]) -> None:
        """The answer of our create or update: ours in the watch stream, and in the store if newer."""
        version = str(stored.get("metadata", {}).get("resourceVersion", ""))
        if version:
            self._own_versions.append(version)
        name = _name(stored)
        if name and _newer(stored, self._items.get(name)):
            self._items[name] = dict(stored)

    def deleting(self, name: str) -> None:
        """We are about to delete slice `name`: its DELETED event is ours."""
        self._own_deletes.append(name)

    def deleted(self, name: str) -> None:
        """Slice `name` is gone (our delete succeeded or found it absent)."""
        self._items.pop(name, None)

    # ----- discovery, probes, the Node ----------------------------------------------------

    async def check_version(self) -> bool:
        """Read the server's version; run discovery again if it changed. False: no answer."""
        async with self._version_lock:
            try:
                version = await self._kube.request("GET", "/version")
                known = self._kube.info.git_version if self._kube.has_info else None
                if str(version.get("gitVersion", "")) != known:
                    await self._kube.discover()
            except KubeApiError:
                return False
            return True

    async def capabilities(self, driver: str, *, again: bool = False) -> Capabilities:
        """What the server accepts in slices: probed once per server version for the process, or
        again when `again` and not yet in this resync. Raises `KubeApiError` on an outage."""
        async with self._caps_lock:
            info = await self._kube.ensure_discovered()
            cached = self._caps
            if (
                cached is not None
                and cached.server_version == info.git_version
                and not (again and self._caps_epoch < self.epoch)
            ):
                return cached
            try:
                found = await capabilities.probe(self._kube, info, driver=driver, node_name=self.node_name)
            except KubeApiError as error:
                if error.status in (0, 429) or error.status >= 500:
                    raise  # an outage: retried with backoff like any pass
                found = capabilities.guess(info)
                log.warning(
                    "cannot probe what the API server accepts in ResourceSlices; going by its version until "
                    "the next resync",
                    extra=capabilities.describe(found, driver=driver, error=str(error)),
                )
            else:
                log.info("API server capabilities probed", extra=capabilities.describe(found, driver=driver))
            self._caps, self._caps_epoch = found, self.epoch
            return found

    async def kept(self, what: str, probe: Any, driver: str) -> bool:
        """Whether the server keeps `what` (asked with `probe`, `agent.kube.capabilities`): once per
        resync and server version for the process. Raises `KubeApiError` when it cannot say."""
        async with self._kept_lock:
            info = await self._kube.ensure_discovered()
            hit = self._kept.get(what)
            if hit is not None and hit[0] == self.epoch and hit[1] == info.git_version:
                return hit[2]
            kept = bool(await probe(self._kube, info, driver=driver, node_name=self.node_name))
            self._kept[what] = (self.epoch, info.git_version, kept)
            return kept

    async def node_uid(self) -> str:
        """The uid of our Node: read once for all drivers, again after `forget_node`."""
        async with self._node_lock:
            if self._node_uid is None:
                try:
                    node = await self._kube.get_node(self.node_name)
                except KubeApiError as error:
                    if error.status == 404:
                        raise NodeMissingError(
                            f"node {self.node_name!r} does not exist in the API server (yet); check "
                            "--node-name matches the kubelet's node name",
                            404,
                            "NotFound",
                        ) from error
                    raise
                self._node_uid = str(node.get("metadata", {}).get("uid", ""))
            return self._node_uid

    def forget_node(self) -> None:
        """Read the Node again at the next pass (a slice was deleted: the Node may have been recreated)."""
        self._node_uid = None
