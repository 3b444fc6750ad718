"""Serving one driver to the kubelet: the DRA socket, then the registration socket.

The DRA socket (``<plugins_dir>/<driver>/dra.sock``) carries the v1 and v1beta1 DRA services and
the v1 and v1alpha1 resource-health streams on one grpclib server; it listens before the
registration socket (``<registry_dir>/<driver>-reg.sock``) appears, because the kubelet dials the
DRA endpoint as soon as it registers the plugin. With a pod UID (rolling updates, Kubernetes
1.33+) the names carry it, so a new agent pod can serve next to the old one. Stale socket files
are removed before binding and ours are removed on shutdown: the kubelet deregisters a plugin
when its registration socket disappears, and grpclib leaves the files behind on Python 3.11.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
import stat
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import grpclib.const
import grpclib.server
from anyio.abc import TaskStatus
from grpclib import GRPCError
from grpclib.const import Status
from grpclib.protocol import H2Protocol
from grpclib.server import Server

from agent.claims.preparer import ClaimPreparer
from agent.core.clock import Clock, SystemClock
from agent.core.errors import AgentError
from agent.core.inventory import Inventory
from agent.core.logs import log_fields
from agent.kubelet._protos import pluginregistration as pb_reg
from agent.kubelet.draservice import DRAPluginV1, DRAPluginV1Beta1, DRAService
from agent.kubelet.healthservice import (
    DEFAULT_HEALTH_CHECK_TIMEOUT,
    DEFAULT_HEARTBEAT_INTERVAL,
    HealthService,
)
from agent.kubelet.registration import ReadinessCallback, RegistrationService, served_services
from agent.observe.metrics import Metrics

log = logging.getLogger("agent.kubelet.plugin")

# Services a kubelet may call that we do not serve. Without a handler grpclib answers a
# trailers-only reply without content-type, which grpc-go (the kubelet) reports as Unknown
# instead of Unimplemented.
UNSERVED_METHODS = (
    "/v1alpha3.Node/NodePrepareResources",  # v1alpha4 API (1.31-1.33); we advertise v1beta1 and v1
    "/v1alpha3.Node/NodeUnprepareResources",
)
SHUTDOWN_TIMEOUT = 5.0
CLOSED_STREAMS_REMEMBERED = 1024
"""Closed HTTP/2 streams remembered per kubelet connection (see `_bound_closed_streams`)."""
MAX_SOCKET_PATH = 107  # sun_path is 108 bytes on Linux, including the terminating NUL


class _ClosingServer(Server):
    """A grpclib server that also closes its accepted connections when stopped.

    grpclib's `Server.close` cancels running requests but leaves client connections open (and
    Python 3.11 has no `close_clients`); a kubelet still connected to a stopped server would keep
    talking to it instead of reconnecting to the new one.
    """

    def __init__(self, handlers: Sequence[Any]) -> None:
        super().__init__(handlers)
        self._protocols: weakref.WeakSet[H2Protocol] = weakref.WeakSet()

    def _protocol_factory(self) -> H2Protocol:
        protocol = super()._protocol_factory()
        self._protocols.add(protocol)
        made = protocol.connection_made

        def connection_made(transport: asyncio.BaseTransport) -> None:
            made(_CoalescingTransport(transport, lambda: _streams(protocol) > 1))  # type: ignore[arg-type]
            _bound_closed_streams(protocol)

        protocol.connection_made = connection_made  # type: ignore[method-assign]
        return protocol

    def close_connections(self) -> None:
        for protocol in list(self._protocols):
            connection = getattr(protocol, "connection", None)
            if connection is not None:
                connection.close()


COALESCE_BUDGET_SECONDS = 0.001
"""How long a burst's answers may wait to share one send."""


class _CoalescingTransport:
    """A transport whose writes leave in one send per event-loop iteration while calls overlap.

    grpclib writes each HTTP/2 step of an answer (headers, data, trailers) at once: three sends,
    each waking the kubelet. In a burst (several streams open) the writes of one iteration are
    collected and sent once its callbacks are done (a burst's answers share sends). A lone call
    is written through: held to the end of the iteration, its trailers waited for grpclib's
    clean-up of the stream (+0.05-0.15 ms per call measured).
    """

    def __init__(self, transport: asyncio.BaseTransport, overlapping: Callable[[], bool]) -> None:
        self._transport = transport
        self._overlapping = overlapping
        self._pending: list[bytes] = []
        self._since = 0.0

    def write(self, data: bytes) -> None:
        if not data:
            return
        loop = asyncio.get_running_loop()
        if not self._pending:
            if not self._overlapping():
                self._transport.write(data)  # type: ignore[attr-defined]
                return
            loop.call_soon(self._flush)
            self._since = loop.time()
        self._pending.append(data)
        if loop.time() - self._since > COALESCE_BUDGET_SECONDS:
            # One loop iteration of a large burst can answer for tens of ms: what is ready goes
            # out instead of waiting for the whole iteration (each answer as soon as it is ready).
            self._flush()

    def _flush(self) -> None:
        data, self._pending = b"".join(self._pending), []
        if data and not self._transport.is_closing():
            self._transport.write(data)  # type: ignore[attr-defined]

    def close(self) -> None:
        self._flush()  # a GOAWAY written just before closing still goes out
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def _h2_connection(protocol: H2Protocol) -> Any:
    """The h2 ``H2Connection`` behind grpclib's protocol (None before the connection is made)."""
    return getattr(getattr(protocol, "connection", None), "_connection", None)


def _streams(protocol: H2Protocol) -> int:
    """The HTTP/2 streams h2 holds for the connection (its open ones, and closed ones until it
    next counts them): more than one means calls overlap."""
    return len(getattr(_h2_connection(protocol), "streams", ()))


def _bound_closed_streams(protocol: H2Protocol) -> None:
    """Remember the last `CLOSED_STREAMS_REMEMBERED` closed streams of a connection, not 65,536.

    h2 keeps every closed stream ID of a connection (``H2Connection.MAX_CLOSED_STREAMS``, ~115
    bytes each) to tell late frames from protocol errors; the kubelet keeps one connection and
    makes one stream per call, so memory grew with every prepare up to ~7 MB. A frame for a stream
    closed longer ago is answered with RST_STREAM(STREAM_CLOSED), which RFC 9113 allows.
    """
    closed = getattr(_h2_connection(protocol), "_closed_streams", None)
    if closed is not None and hasattr(closed, "_size_limit"):  # h2's private layout (4.x)
        closed._size_limit = CLOSED_STREAMS_REMEMBERED


class SocketError(AgentError):
    """A socket path cannot be used."""


class UnservedMethods:
    """Answers UNIMPLEMENTED (with a proper gRPC reply) on methods we know but do not serve."""

    def __init__(self, paths: Sequence[str] = UNSERVED_METHODS) -> None:
        self.paths = tuple(paths)

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        return {
            path: grpclib.const.Handler(
                functools.partial(_unimplemented, path),
                grpclib.const.Cardinality.UNARY_UNARY,
                pb_reg.InfoRequest,
                pb_reg.InfoRequest,
            )
            for path in self.paths
        }


async def _unimplemented(path: str, stream: grpclib.server.Stream[object, object]) -> None:
    raise GRPCError(Status.UNIMPLEMENTED, f"{path} is not served by this plugin")


def socket_paths(driver: str, plugins_dir: Path, registry_dir: Path, pod_uid: str = "") -> tuple[Path, Path]:
    """``(dra_socket, registration_socket)`` of a driver, as the kubelet's Go helper names them."""
    data_dir = plugins_dir / driver
    if pod_uid:
        return data_dir / f"dra-{pod_uid}.sock", registry_dir / f"{driver}-{pod_uid}-reg.sock"
    return data_dir / "dra.sock", registry_dir / f"{driver}-reg.sock"


def another_pod_serving(own_socket: Path) -> bool:
    """Whether the DRA socket of another agent pod of this driver accepts connections (blocking).

    During a rolling update two pods serve a driver, each on ``dra-<pod UID>.sock`` in the same
    directory; the socket of a pod that died stays behind but refuses connections.
    """
    try:
        names = os.listdir(own_socket.parent)
    except FileNotFoundError:
        return False
    for name in names:
        if name == own_socket.name or not (name.startswith("dra") and name.endswith(".sock")):
            continue
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(0.1)
            try:
                probe.connect(str(own_socket.parent / name))
            except (ConnectionRefusedError, FileNotFoundError):
                continue  # left behind by a pod that is gone
            except OSError:
                pass  # there, but busy (a full backlog): serving
            return True
    return False


def remove_stale_socket(path: Path) -> None:
    """Remove a leftover file at `path` before binding; refuse to delete a directory."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        raise SocketError(f"{path} is a directory; remove it so the agent can create its socket there")
    log.info("removing stale socket file", extra=log_fields(path=str(path)))
    path.unlink(missing_ok=True)


def _prepare_socket_path(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_socket(path)


class KubeletPlugin:
    """One driver's kubelet-facing gRPC endpoints; `run` serves them until cancelled.

    GetInfo advertises exactly the services the DRA socket serves (`served_services`); an explicit
    `supported_services` may leave some out but may not name one that is not served.

    With `preparer_ready`, prepare and unprepare calls wait for that event (the preparer's
    checkpoint loaded) while registration, ``GetInfo`` and the health stream are served at once.
    """

    def __init__(
        self,
        driver: str,
        preparer: ClaimPreparer,
        inventory: Inventory,
        *,
        plugins_dir: Path,
        registry_dir: Path,
        pod_uid: str = "",
        pool: str = "",
        metrics: Metrics | None = None,
        readiness_callback: ReadinessCallback | None = None,
        clock: Clock | None = None,
        heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL,
        health_check_timeout: int = DEFAULT_HEALTH_CHECK_TIMEOUT,
        supported_services: Sequence[str] | None = None,
        preparer_ready: anyio.Event | None = None,
    ) -> None:
        self.driver = driver
        self.dra_socket, self.registration_socket = socket_paths(
            driver, plugins_dir.absolute(), registry_dir.absolute(), pod_uid
        )
        for path in (self.dra_socket, self.registration_socket):
            if len(str(path).encode()) > MAX_SOCKET_PATH:
                raise SocketError(
                    f"socket path {path} is longer than {MAX_SOCKET_PATH} bytes; use shorter directories"
                )
        if not pool:
            # The pool is the node name by convention; the host name is the usual node name.
            pool = socket.gethostname().lower()
            log.warning(
                "no pool name given; using the host name for the health stream",
                extra=log_fields(driver=driver, pool=pool),
            )
        self.dra = DRAService(driver, preparer, metrics=metrics, preparer_ready=preparer_ready)
        self.health = HealthService(
            inventory,
            pool=pool,
            clock=clock if clock is not None else SystemClock(),
            metrics=metrics,
            heartbeat_interval=heartbeat_interval,
            health_check_timeout=health_check_timeout,
        )
        self.services: tuple[Any, ...] = (DRAPluginV1(self.dra), DRAPluginV1Beta1(self.dra), self.health)
        """What the DRA socket serves (besides `UnservedMethods`)."""
        served = served_services(path for service in self.services for path in service.__mapping__())
        if supported_services is None:
            supported_services = served
        elif unserved := [name for name in supported_services if name not in served]:
            raise ValueError(
                f"cannot advertise {', '.join(unserved)} to the kubelet: not served "
                f"(served: {', '.join(served)})"
            )
        self.registration = RegistrationService(
            driver,
            str(self.dra_socket),
            supported_services=supported_services,
            metrics=metrics,
            readiness_callback=readiness_callback,
        )

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve the DRA socket, then the registration socket; clean both up when cancelled."""
        dra_server = _ClosingServer([*self.services, UnservedMethods()])
        reg_server = _ClosingServer([self.registration])
        started: list[tuple[_ClosingServer, Path]] = []
        try:
            for server, path in ((dra_server, self.dra_socket), (reg_server, self.registration_socket)):
                await anyio.to_thread.run_sync(_prepare_socket_path, path)
                await server.start(path=str(path))
                started.append((server, path))
                log.info("serving kubelet socket", extra=log_fields(driver=self.driver, path=str(path)))
            task_status.started()
            await anyio.sleep_forever()
        finally:
            with anyio.CancelScope(shield=True):
                # Registration first: the kubelet deregisters before the DRA socket goes away.
                for server, path in reversed(started):
                    await _stop(server, path)

    @property
    def registered(self) -> bool | None:
        """None until the kubelet answered, then whether it accepted the registration."""
        return self.registration.registered


async def _stop(server: _ClosingServer, path: Path) -> None:
    server.close()  # stops listening and cancels running requests
    # Close the connections too: on Python 3.12+ `wait_closed` waits for them.
    server.close_connections()
    with anyio.move_on_after(SHUTDOWN_TIMEOUT) as scope:
        await server.wait_closed()
    if scope.cancelled_caught:
        log.warning("gRPC server did not close in time", extra=log_fields(path=str(path)))
    await anyio.Path(path).unlink(missing_ok=True)
    log.info("removed kubelet socket", extra=log_fields(path=str(path)))
