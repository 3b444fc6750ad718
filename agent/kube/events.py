"""Kubernetes Events on our Node: taints added and lifted, devices left out, corrupt checkpoints.

Events are best effort: `EventRecorder.record` never raises, drops repeats of the same event
within a window and rate-limits bursts (a token bucket), so a flapping device cannot flood the
API server. `EventQueue` sends them from its own task, so a slow events endpoint delays no
caller (the publisher posts and goes on writing slices).
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import TYPE_CHECKING, Any

import anyio

from agent.core.clock import Clock
from agent.core.errors import KubeApiError
from agent.core.logs import log_fields

if TYPE_CHECKING:
    from agent.kube.client import KubeClient
    from agent.observe.metrics import Metrics

log = logging.getLogger("agent.kube.events")

NORMAL = "Normal"
WARNING = "Warning"
COMPONENT = "dra-agent"
MAX_MESSAGE_LENGTH = 1024


def rfc3339(seconds: float) -> str:
    """``2026-01-02T03:04:05Z`` (Events carry second precision)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


class EventRecorder:
    """Records core/v1 Events about one Node, deduplicated and rate-limited.

    `node_uid` may be empty: it is looked up on the first event (and left out if the Node
    cannot be read).
    """

    def __init__(
        self,
        kube: KubeClient,
        node_name: str,
        node_uid: str = "",
        clock: Clock | None = None,
        *,
        metrics: Metrics | None = None,
        burst: int = 25,
        refill_seconds: float = 5.0,
        dedupe_seconds: float = 600.0,
    ) -> None:
        from agent.core.clock import SystemClock

        self._kube = kube
        self._node = node_name
        self._uid = node_uid
        self._clock = clock or SystemClock()
        self._metrics = metrics
        self._burst = burst
        self._refill = refill_seconds
        self._dedupe = dedupe_seconds
        self._tokens = float(burst)
        self._last_refill = self._clock.monotonic()
        self._sent: dict[tuple[str, str, str], float] = {}
        self._serial = itertools.count()
        self._failing = False
        self.suppressed = 0
        """Events dropped as repeats or by the rate limit."""

    async def record(self, reason: str, message: str, type: str = NORMAL) -> bool:
        """Create an Event on the Node; False when it was suppressed or the API server refused it."""
        now = self._clock.monotonic()
        key = (type, reason, message)
        last = self._sent.get(key)
        if last is not None and now - last < self._dedupe:
            self.suppressed += 1
            return False
        self._tokens = min(float(self._burst), self._tokens + (now - self._last_refill) / self._refill)
        self._last_refill = now
        if self._tokens < 1:
            self.suppressed += 1
            log.debug("event rate-limited", extra=log_fields(reason=reason, event_message=message))
            return False
        self._tokens -= 1
        self._sent[key] = now
        if len(self._sent) > 1000:  # bound memory: forget the oldest half
            for old in sorted(self._sent, key=self._sent.__getitem__)[:500]:
                del self._sent[old]
        try:
            await self._kube.create_event(await self._body(reason, message, type))
        except KubeApiError as error:
            self._record_result("error")
            if not self._failing:
                log.warning(
                    "cannot record Node events; they are dropped until the API server accepts them",
                    extra=log_fields(reason=reason, error=str(error)),
                )
            self._failing = True
            return False
        self._record_result("success")
        if self._failing:
            log.info("recording Node events again")
        self._failing = False
        return True

    def _record_result(self, result: str) -> None:
        if self._metrics is not None:
            self._metrics.api_writes.labels("events", "create", result).inc()

    async def _body(self, reason: str, message: str, type: str) -> dict[str, Any]:
        if not self._uid:
            try:
                node = await self._kube.get_node(self._node)
                self._uid = str(node.get("metadata", {}).get("uid", ""))
            except KubeApiError:
                pass
        involved: dict[str, Any] = {"apiVersion": "v1", "kind": "Node", "name": self._node}
        if self._uid:
            involved["uid"] = self._uid
        stamp = rfc3339(self._clock.time())
        name = f"{self._node}.{int(self._clock.time() * 1e9):x}{next(self._serial):x}"
        return {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": name[:253], "namespace": "default"},
            "involvedObject": involved,
            "reason": reason,
            "message": message[:MAX_MESSAGE_LENGTH],
            "type": type,
            "source": {"component": COMPONENT, "host": self._node},
            "reportingComponent": COMPONENT,
            "reportingInstance": self._node,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }


class EventQueue:
    """A bounded queue of Events that `run` sends through an `EventRecorder`, one at a time.

    `post` never waits: when the queue is full (the API server is slow or down) the Event is
    dropped and counted, as the recorder drops bursts.
    """

    def __init__(self, recorder: EventRecorder, *, capacity: int = 64) -> None:
        self._recorder = recorder
        self._send, self._receive = anyio.create_memory_object_stream[tuple[str, str, str]](capacity)
        self.dropped = 0
        """Events dropped because the queue was full."""

    def post(self, reason: str, message: str, type: str = NORMAL) -> bool:
        """Queue an Event; False when the queue is full and it was dropped."""
        try:
            self._send.send_nowait((reason, message, type))
        except anyio.WouldBlock:
            self.dropped += 1
            log.debug("event queue full; event dropped", extra=log_fields(reason=reason))
            return False
        return True

    async def run(self) -> None:
        """Send queued Events until cancelled."""
        async for reason, message, type in self._receive:
            await self._recorder.record(reason, message, type)
