"""The kubelet's resource-health stream (``v1alpha1.DRAResourceHealth/NodeWatchResources``).

Each watcher gets the complete list of the driver's devices on connect, a new complete list on
every inventory change, and the same list again every `heartbeat_interval` so the kubelet never
lets a device go stale (its default staleness timeout is 30 s; we also send
``health_check_timeout_seconds``). Every stream builds its message from the inventory's current
state when it is ready to send: a slow watcher only delays itself and never queues anything.
"""

from __future__ import annotations

import logging

import anyio
import grpclib.const
import grpclib.server

from agent.core.clock import Clock, SystemClock
from agent.core.inventory import Inventory
from agent.core.logs import log_fields
from agent.core.model import Device, HealthStatus
from agent.kubelet._protos import v1alpha1 as pb
from agent.observe.metrics import Metrics

log = logging.getLogger("agent.kubelet.healthservice")

WATCH_PATH = "/v1alpha1.DRAResourceHealth/NodeWatchResources"
DEFAULT_HEARTBEAT_INTERVAL = 10.0
DEFAULT_HEALTH_CHECK_TIMEOUT = 60
MAX_MESSAGE_LENGTH = 1024

_STATUS = {
    HealthStatus.HEALTHY: pb.HealthStatus(pb.HealthStatus.HEALTHY),
    HealthStatus.UNHEALTHY: pb.HealthStatus(pb.HealthStatus.UNHEALTHY),
    HealthStatus.UNKNOWN: pb.HealthStatus(pb.HealthStatus.UNKNOWN),
}


def truncate_message(message: str, limit: int = MAX_MESSAGE_LENGTH) -> str:
    """Cut `message` to `limit` characters the way the kubelet does (1021 + ``...``)."""
    return message if len(message) <= limit else message[: limit - 3] + "..."


def device_health(device: Device, pool: str, now: float, timeout_seconds: int) -> pb.DeviceHealth:
    """The health stream entry of one device."""
    return pb.DeviceHealth(
        device=pb.DeviceIdentifier(pool_name=pool, device_name=device.name),
        health=_STATUS[device.health.status],
        last_updated_time=int(now),
        health_check_timeout_seconds=timeout_seconds,
        message=truncate_message(device.health.message),
    )


class HealthService(pb.DraResourceHealthBase):
    """Serves `NodeWatchResources` from an `Inventory` to any number of watchers."""

    def __init__(
        self,
        inventory: Inventory,
        *,
        pool: str,
        clock: Clock | None = None,
        metrics: Metrics | None = None,
        heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
        health_check_timeout: int = DEFAULT_HEALTH_CHECK_TIMEOUT,
    ) -> None:
        if heartbeat_interval <= 0 or heartbeat_interval >= health_check_timeout:
            raise ValueError(
                f"heartbeat interval {heartbeat_interval}s must be positive and below the "
                f"health check timeout {health_check_timeout}s"
            )
        self.inventory = inventory
        self.pool = pool
        self.clock: Clock = clock if clock is not None else SystemClock()
        self.heartbeat_interval = heartbeat_interval
        self.health_check_timeout = health_check_timeout
        self._metrics = metrics
        self.watchers = 0

    def report(self) -> pb.NodeWatchResourcesResponse:
        """The complete list of the driver's devices with their current health."""
        now = self.clock.time()
        return pb.NodeWatchResourcesResponse(
            devices=[
                device_health(d, self.pool, now, self.health_check_timeout) for d in self.inventory.devices()
            ]
        )

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        # Our own handler on the raw stream: it sends directly instead of through an async
        # generator, so waiting on changes and heartbeats can use a task group safely.
        return {
            WATCH_PATH: grpclib.const.Handler(
                self._node_watch_resources,
                grpclib.const.Cardinality.UNARY_STREAM,
                pb.NodeWatchResourcesRequest,
                pb.NodeWatchResourcesResponse,
            )
        }

    async def _node_watch_resources(
        self, stream: grpclib.server.Stream[pb.NodeWatchResourcesRequest, pb.NodeWatchResourcesResponse]
    ) -> None:
        await stream.recv_message()
        driver = self.inventory.driver
        self.watchers += 1
        if self._metrics is not None:
            self._metrics.health_watchers.labels(driver).inc()
        log.info("kubelet health watcher connected", extra=log_fields(driver=driver, peer=str(stream.peer)))
        try:
            while True:
                version = self.inventory.version
                if not self.inventory.discovered:
                    # An empty list before discovery would tell the kubelet we have no devices.
                    await self.inventory.wait_changed(version)
                    continue
                await stream.send_message(self.report())
                await self._wait_change_or_heartbeat(version)
        finally:
            self.watchers -= 1
            if self._metrics is not None:
                self._metrics.health_watchers.labels(driver).dec()
            log.info("kubelet health watcher gone", extra=log_fields(driver=driver))

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
