"""The kubelet's resource-health stream, ``DRAResourceHealth/NodeWatchResources``, v1 and v1alpha1.

Kubernetes 1.37 added ``v1.DRAResourceHealth`` beside ``v1alpha1.DRAResourceHealth``, with the
same messages in another package; a 1.37 kubelet picks v1 when GetInfo offers both, and 1.34 to
1.36 kubelets call v1alpha1. One `HealthService` serves both: the two APIs differ only in the
method path and in which generated classes carry the (identical) fields, see `HealthAPI`.

Each watcher gets the complete list of the driver's devices on connect, a new complete list on
every inventory change, and the same list again every `heartbeat_interval`, so no device's last
report ever gets older than the kubelet's staleness timeout: the ``health_check_timeout_seconds``
we send (read by 1.35+ kubelets), and the kubelet's fixed 30 s default for a 1.34 kubelet, which
does not know that field. The interval must leave room for at least `MIN_REPORTS_PER_TIMEOUT`
reports inside both. Every stream builds its message from the inventory's current state when it
is ready to send: a slow watcher only delays itself and never queues anything.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import anyio
import grpclib.const
import grpclib.server
from grpclib import GRPCError
from grpclib.const import Status

from agent.core.clock import Clock, SystemClock
from agent.core.inventory import Inventory
from agent.core.logs import log_fields
from agent.core.model import Device, HealthStatus
from agent.kubelet._protos import v1 as pb_v1
from agent.kubelet._protos import v1alpha1 as pb_v1alpha1
from agent.kubelet.registration import HEALTH_V1, HEALTH_V1ALPHA1
from agent.observe.metrics import Metrics

log = logging.getLogger("agent.kubelet.healthservice")

KUBELET_DEFAULT_HEALTH_TIMEOUT = 30
"""Seconds after which the kubelet marks a device Unknown when its report carries no timeout
(and always, on a 1.34 kubelet: ``DefaultHealthTimeout`` in pkg/kubelet/cm/dra/healthinfo.go)."""
MIN_REPORTS_PER_TIMEOUT = 3
"""Complete reports the heartbeat must fit into the effective timeout: one late or lost report
never lets a device go Unknown."""
DEFAULT_HEARTBEAT_INTERVAL = 10.0
DEFAULT_HEALTH_CHECK_TIMEOUT = 60
MAX_MESSAGE_LENGTH = 1024


@dataclass(frozen=True)
class HealthAPI:
    """One version of the health API: its gRPC service and the generated classes of its messages.

    The service name (``<package>.DRAResourceHealth``) is also what GetInfo advertises.
    """

    service: str
    messages: ModuleType

    @property
    def watch_path(self) -> str:
        return f"/{self.service}/NodeWatchResources"


V1 = HealthAPI(HEALTH_V1, pb_v1)
V1ALPHA1 = HealthAPI(HEALTH_V1ALPHA1, pb_v1alpha1)
HEALTH_APIS = (V1, V1ALPHA1)
"""Newest first; what `HealthService` serves by default."""
WATCH_PATH = V1ALPHA1.watch_path
WATCH_PATH_V1 = V1.watch_path

_STATUS = {
    HealthStatus.HEALTHY: int(pb_v1.HealthStatus.HEALTHY),
    HealthStatus.UNHEALTHY: int(pb_v1.HealthStatus.UNHEALTHY),
    HealthStatus.UNKNOWN: int(pb_v1.HealthStatus.UNKNOWN),
}
_MALFORMED = (ValueError, RuntimeError, IndexError)
"""What betterproto raises on bytes that do not parse as the request message."""


def truncate_message(message: str, limit: int = MAX_MESSAGE_LENGTH) -> str:
    """Cut `message` to `limit` characters the way the kubelet does (1021 + ``...``)."""
    return message if len(message) <= limit else message[: limit - 3] + "..."


def device_health(device: Device, pool: str, now: float, timeout_seconds: int, api: HealthAPI = V1) -> Any:
    """The health stream entry of one device, as `api`'s ``DeviceHealth``."""
    pb = api.messages
    return pb.DeviceHealth(
        device=pb.DeviceIdentifier(pool_name=pool, device_name=device.name),
        health=pb.HealthStatus(_STATUS[device.health.status]),
        last_updated_time=int(now),
        health_check_timeout_seconds=timeout_seconds,
        message=truncate_message(device.health.message),
    )


def check_heartbeat(heartbeat_interval: float, health_check_timeout: int) -> None:
    """Raise `ValueError` unless the heartbeat fits `MIN_REPORTS_PER_TIMEOUT` times into both the
    timeout we advertise and the kubelet's default (which a 1.34 kubelet always applies)."""
    effective = min(health_check_timeout, KUBELET_DEFAULT_HEALTH_TIMEOUT)
    if health_check_timeout <= 0 or not 0 < heartbeat_interval <= effective / MIN_REPORTS_PER_TIMEOUT:
        raise ValueError(
            f"heartbeat interval {heartbeat_interval}s must be positive and at most 1/"
            f"{MIN_REPORTS_PER_TIMEOUT} of the health check timeout ({health_check_timeout}s, "
            f"and the kubelet's default {KUBELET_DEFAULT_HEALTH_TIMEOUT}s for kubelets that ignore it)"
        )


class HealthService:
    """Serves `NodeWatchResources` of each API in `apis` from an `Inventory` to any number of watchers."""

    def __init__(
        self,
        inventory: Inventory,
        *,
        pool: str,
        clock: Clock | None = None,
        metrics: Metrics | None = None,
        heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
        health_check_timeout: int = DEFAULT_HEALTH_CHECK_TIMEOUT,
        apis: tuple[HealthAPI, ...] = HEALTH_APIS,
    ) -> None:
        check_heartbeat(heartbeat_interval, health_check_timeout)
        if not apis:
            raise ValueError("the health service needs at least one API version to serve")
        self.apis = apis
        self.inventory = inventory
        self.pool = pool
        self.clock: Clock = clock if clock is not None else SystemClock()
        self.heartbeat_interval = heartbeat_interval
        self.health_check_timeout = health_check_timeout
        self._metrics = metrics
        self.watchers = 0

    def report(self, api: HealthAPI = V1) -> Any:
        """The complete list of the driver's devices with their current health, as `api`'s
        ``NodeWatchResourcesResponse``."""
        now = self.clock.time()
        return api.messages.NodeWatchResourcesResponse(
            devices=[
                device_health(d, self.pool, now, self.health_check_timeout, api)
                for d in self.inventory.devices()
            ]
        )

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        # Our own handler on the raw stream: it sends directly instead of through an async
        # generator, so waiting on changes and heartbeats can use a task group safely. The same
        # handler serves every API version; only the message classes differ.
        return {
            api.watch_path: grpclib.const.Handler(
                functools.partial(self._node_watch_resources, api),
                grpclib.const.Cardinality.UNARY_STREAM,
                api.messages.NodeWatchResourcesRequest,
                api.messages.NodeWatchResourcesResponse,
            )
            for api in self.apis
        }

    async def _node_watch_resources(self, api: HealthAPI, stream: grpclib.server.Stream[Any, Any]) -> None:
        try:
            request = await stream.recv_message()
        except _MALFORMED as exc:
            raise GRPCError(
                Status.INVALID_ARGUMENT,
                f"malformed {api.service} NodeWatchResourcesRequest: {exc}",
            ) from exc
        if request is None:
            raise GRPCError(
                Status.INVALID_ARGUMENT,
                f"{api.service}/NodeWatchResources expects one NodeWatchResourcesRequest, got none",
            )
        driver = self.inventory.driver
        self.watchers += 1
        if self._metrics is not None:
            self._metrics.health_watchers.labels(driver).inc()
        log.info(
            "kubelet health watcher connected",
            extra=log_fields(driver=driver, service=api.service, peer=str(stream.peer)),
        )
        try:
            while True:
                version = self.inventory.version
                if not self.inventory.discovered:
                    # An empty list before discovery would tell the kubelet we have no devices.
                    await self.inventory.wait_changed(version)
                    continue
                await stream.send_message(self.report(api))
                await self._wait_change_or_heartbeat(version)
        finally:
            self.watchers -= 1
            if self._metrics is not None:
                self._metrics.health_watchers.labels(driver).dec()
            log.info("kubelet health watcher gone", extra=log_fields(driver=driver, service=api.service))

    async def _wait_change_or_heartbeat(self, version: int) -> None:
        async with anyio.create_task_group() as tg:

            async def heartbeat() -> None:
                await self.clock.sleep(self.heartbeat_interval)
                tg.cancel_scope.cancel()

            async def change() -> None:
                await self.inventory.wait_changed(version)
                tg.cancel_scope.cancel()

            tg.start_soon(heartbeat)
            tg.start_soon(change)
