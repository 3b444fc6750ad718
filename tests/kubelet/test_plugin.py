"""Socket serving: paths, start order, stale files, cleanup, unserved methods, a kubelet-like flow."""

from __future__ import annotations

import socket
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import grpc
import pytest
from grpclib.client import Channel
from grpclib.server import Server

from agent.claims.preparer import PreparedDevice, PrepareResult
from agent.core.inventory import Inventory
from agent.core.model import Device
from agent.kubelet._protos import v1alpha1 as pb_health
from agent.kubelet.plugin import (
    CLOSED_STREAMS_REMEMBERED,
    UNSERVED_METHODS,
    KubeletPlugin,
    SocketError,
    UnservedMethods,
    _ClosingServer,
    _CoalescingTransport,
    _h2_connection,
    _streams,
    another_pod_serving,
    socket_paths,
)
from tests.kubelet.grpc_support import (
    DRIVER,
    GET_INFO,
    V1,
    V1BETA1,
    FakePreparer,
    grpcio_protos,
    grpcio_unary,
    make_plugin,
    serving,
    short_tmp_dir,
)


@pytest.fixture
def root() -> Iterator[Path]:
    yield from short_tmp_dir()


def is_socket(path: Path) -> bool:
    return path.exists() and stat.S_ISSOCK(path.lstat().st_mode)


def test_socket_paths() -> None:
    plugins, registry = Path("/var/lib/kubelet/plugins"), Path("/var/lib/kubelet/plugins_registry")
    assert socket_paths(DRIVER, plugins, registry) == (
        plugins / DRIVER / "dra.sock",
        registry / f"{DRIVER}-reg.sock",
    )
    assert socket_paths(DRIVER, plugins, registry, pod_uid="1234-ab") == (
        plugins / DRIVER / "dra-1234-ab.sock",
        registry / f"{DRIVER}-1234-ab-reg.sock",
    )


def test_another_pod_serving_is_a_live_dra_socket_of_another_pod(root: Path) -> None:
    """A rolling update's other pod (its ``dra-<uid>.sock`` accepts); a dead pod's file refuses."""
    folder = root / "plugins" / DRIVER
    folder.mkdir(parents=True)
    mine = folder / "dra-aaaa.sock"
    assert not another_pod_serving(mine)
    assert not another_pod_serving(root / "missing" / "dra-aaaa.sock")
    with socket.socket(socket.AF_UNIX) as own, socket.socket(socket.AF_UNIX) as dead:
        own.bind(str(mine))
        own.listen()
        dead.bind(str(folder / "dra-bbbb.sock"))  # bound, never listening: as a killed pod's leftover
        (folder / "serialize.lock").touch()
        assert not another_pod_serving(mine)
        with socket.socket(socket.AF_UNIX) as other:
            other.bind(str(folder / "dra-cccc.sock"))
            other.listen()
            assert another_pod_serving(mine)
        # Closed: the file stays behind and refuses connections.
        assert not another_pod_serving(mine)


async def test_serves_both_sockets_and_removes_them_on_shutdown(root: Path) -> None:
    plugin = make_plugin(root)
    assert plugin.dra_socket == root / "plugins" / DRIVER / "dra.sock"
    assert plugin.registration_socket == root / "registry" / f"{DRIVER}-reg.sock"
    async with serving(plugin):
        assert is_socket(plugin.dra_socket) and is_socket(plugin.registration_socket)
    assert not plugin.dra_socket.exists()
    assert not plugin.registration_socket.exists()
    assert (root / "plugins" / DRIVER).is_dir()  # the plugin data dir stays


async def test_dra_socket_listens_before_registration(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []
    real_start = Server.start

    async def start(self: Server, *args: Any, **kwargs: Any) -> None:
        await real_start(self, *args, **kwargs)
        order.append(Path(kwargs["path"]).name)

    monkeypatch.setattr(Server, "start", start)
    async with serving(make_plugin(root)):
        pass
    assert order == ["dra.sock", f"{DRIVER}-reg.sock"]


async def test_rolling_update_socket_names(root: Path) -> None:
    protos = grpcio_protos()
    plugin = make_plugin(root, pod_uid="0c5e-77")
    async with serving(plugin):
        assert is_socket(root / "plugins" / DRIVER / "dra-0c5e-77.sock")
        assert is_socket(root / "registry" / f"{DRIVER}-0c5e-77-reg.sock")
        info = await grpcio_unary(
            plugin.registration_socket,
            GET_INFO,
            protos.registration.InfoRequest(),
            protos.registration.PluginInfo,
        )
        assert info.endpoint == str(root / "plugins" / DRIVER / "dra-0c5e-77.sock")
    assert list((root / "registry").iterdir()) == []


async def test_two_pods_serve_side_by_side(root: Path) -> None:
    old, new = make_plugin(root, pod_uid="old"), make_plugin(root, pod_uid="new")
    async with serving(old):
        async with serving(new):
            assert len(list((root / "registry").iterdir())) == 2
        # The new pod's shutdown never touches the old pod's sockets.
        assert is_socket(old.dra_socket) and is_socket(old.registration_socket)


async def test_stale_socket_files_are_replaced(root: Path) -> None:
    plugin = make_plugin(root)
    plugin.dra_socket.parent.mkdir(parents=True)
    plugin.registration_socket.parent.mkdir(parents=True)
    # A socket left by a killed agent (bound, never unlinked) and a plain leftover file.
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(plugin.dra_socket))
    stale.close()
    plugin.registration_socket.write_text("junk")
    protos = grpcio_protos()
    async with serving(plugin):
        assert is_socket(plugin.registration_socket)
        info = await grpcio_unary(
            plugin.registration_socket,
            GET_INFO,
            protos.registration.InfoRequest(),
            protos.registration.PluginInfo,
        )
        assert info.name == DRIVER
        answer = await grpcio_unary(
            plugin.dra_socket,
            V1 + "NodePrepareResources",
            protos.v1.NodePrepareResourcesRequest(),
            protos.v1.NodePrepareResourcesResponse,
        )
        assert len(answer.claims) == 0


async def test_directory_at_dra_socket_path_fails_clearly(root: Path) -> None:
    plugin = make_plugin(root)
    plugin.dra_socket.mkdir(parents=True)
    with pytest.raises(SocketError, match="is a directory"):
        await plugin.run()
    assert not plugin.registration_socket.exists()


async def test_failed_registration_socket_removes_the_dra_socket(root: Path) -> None:
    plugin = make_plugin(root)
    plugin.registration_socket.mkdir(parents=True)
    with pytest.raises(SocketError, match="is a directory"):
        await plugin.run()
    assert not plugin.dra_socket.exists()


def test_too_long_socket_path_is_refused() -> None:
    with pytest.raises(SocketError, match="longer than 107 bytes"):
        make_plugin(Path("/tmp") / ("d" * 100))


def test_pool_defaults_to_the_host_name(root: Path) -> None:
    plugin = make_plugin(root, pool="")
    assert plugin.health.pool == socket.gethostname().lower()


async def test_sockets_removed_with_a_watcher_connected(root: Path) -> None:
    inventory = Inventory(DRIVER)
    inventory.set_devices([Device(name="gpu-0", driver=DRIVER)])
    plugin = make_plugin(root, inventory=inventory)
    async with anyio.create_task_group() as tg:
        await tg.start(plugin.run)
        async with Channel(path=str(plugin.dra_socket)) as channel:
            stream = pb_health.DraResourceHealthStub(channel).node_watch_resources(
                pb_health.NodeWatchResourcesRequest()
            )
            with anyio.fail_after(10):
                await anext(stream)
                tg.cancel_scope.cancel()  # SIGTERM while the kubelet is watching
    assert not plugin.dra_socket.exists() and not plugin.registration_socket.exists()
    assert plugin.health.watchers == 0


@pytest.mark.parametrize(
    "path", [*UNSERVED_METHODS, "/no.Such/Method", "/pluginregistration.Registration/Nope"]
)
async def test_unserved_methods_answer_unimplemented(root: Path, path: str) -> None:
    protos = grpcio_protos()
    async with serving(make_plugin(root)) as plugin:
        for sock in (plugin.dra_socket, plugin.registration_socket):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await grpcio_unary(sock, path, protos.v1.NodePrepareResourcesRequest(), protos.v1.Claim)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_kubelet_like_flow(root: Path) -> None:
    """Find the registration socket, GetInfo, pick a service as a 1.34+ kubelet does, prepare, unprepare."""
    protos = grpcio_protos()
    cdi_id = f"k8s.{DRIVER}/claim=uid-1-gpu-0"
    device = PreparedDevice(requests=("gpu",), pool="node-1", device="gpu-0", cdi_device_ids=(cdi_id,))
    preparer = FakePreparer(results={"uid-1": PrepareResult(devices=(device,))})
    async with serving(make_plugin(root, preparer)):
        (reg_socket,) = [p for p in (root / "registry").iterdir() if not p.name.startswith(".")]
        info = await grpcio_unary(
            reg_socket,
            GET_INFO,
            protos.registration.InfoRequest(),
            protos.registration.PluginInfo,
            seconds=1.0,
        )
        assert info.type == "DRAPlugin" and info.name == DRIVER
        kubelet_supports = {"v1.DRAPlugin": (protos.v1, V1), "v1beta1.DRAPlugin": (protos.v1beta1, V1BETA1)}
        chosen = next(v for v in info.supported_versions if v in kubelet_supports)
        assert chosen == "v1.DRAPlugin"
        pb2, prefix = kubelet_supports[chosen]
        claims = [pb2.Claim(namespace="default", name="gpu-claim", uid="uid-1")]
        prepared = await grpcio_unary(
            Path(info.endpoint),
            prefix + "NodePrepareResources",
            pb2.NodePrepareResourcesRequest(claims=claims),
            pb2.NodePrepareResourcesResponse,
        )
        assert list(prepared.claims["uid-1"].devices[0].cdi_device_ids) == [cdi_id]
        unprepared = await grpcio_unary(
            Path(info.endpoint),
            prefix + "NodeUnprepareResources",
            pb2.NodeUnprepareResourcesRequest(claims=claims),
            pb2.NodeUnprepareResourcesResponse,
        )
        assert unprepared.claims["uid-1"].error == ""


async def test_constructor_arguments(root: Path) -> None:
    plugin = KubeletPlugin(
        DRIVER,
        FakePreparer(),
        make_plugin(root).health.inventory,
        plugins_dir=root / "p",
        registry_dir=root / "r",
        pool="node-9",
        heartbeat_interval=5,
        health_check_timeout=30,
    )
    assert plugin.health.heartbeat_interval == 5 and plugin.health.health_check_timeout == 30
    assert plugin.registered is None


async def test_restart_closes_old_connections(root: Path) -> None:
    """A kubelet connected across an agent restart reaches the new server, not the stopped one."""
    protos = grpcio_protos()
    old_preparer, new_preparer = FakePreparer(), FakePreparer()
    first = make_plugin(root, old_preparer)
    request = protos.v1.NodePrepareResourcesRequest(
        claims=[protos.v1.Claim(namespace="d", name="c", uid="u")]
    )
    async with grpc.aio.insecure_channel(f"unix://{first.dra_socket}") as channel:
        prepare = channel.unary_unary(
            V1 + "NodePrepareResources",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=protos.v1.NodePrepareResourcesResponse.FromString,
        )
        async with serving(first):
            await prepare(request, timeout=5)
        async with serving(make_plugin(root, new_preparer)):
            with anyio.fail_after(10):
                while True:
                    try:
                        await prepare(request, timeout=5, wait_for_ready=True)
                        break
                    except grpc.aio.AioRpcError as exc:
                        # The first call may race the closed connection; it must not hang.
                        assert exc.code() == grpc.StatusCode.UNAVAILABLE
    assert len(old_preparer.prepared) == 1
    assert len(new_preparer.prepared) == 1


class _RecordingTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str) -> str:
        return f"info:{name}"


async def test_writes_of_overlapping_calls_leave_in_one_send_per_loop_iteration() -> None:
    real = _RecordingTransport()
    transport = _CoalescingTransport(real, lambda: True)  # type: ignore[arg-type]
    for part in (b"headers", b"", b"data", b"trailers"):
        transport.write(part)
    assert real.writes == []  # nothing until the iteration's callbacks are done
    await anyio.wait_all_tasks_blocked()
    assert real.writes == [b"headersdatatrailers"]
    assert transport.get_extra_info("peername") == "info:peername"  # the rest is the real transport's


async def test_a_lone_call_is_written_through() -> None:
    real = _RecordingTransport()
    overlapping = False
    transport = _CoalescingTransport(real, lambda: overlapping)  # type: ignore[arg-type]
    transport.write(b"headers")
    transport.write(b"data")
    assert real.writes == [b"headers", b"data"]  # at once: nothing waits for the iteration's end
    overlapping = True
    transport.write(b"other")
    overlapping = False
    transport.write(b"trailers")  # after a held write: held too, to keep the order
    assert real.writes == [b"headers", b"data"]
    await anyio.wait_all_tasks_blocked()
    assert real.writes == [b"headers", b"data", b"othertrailers"]


async def test_closing_sends_what_is_pending_first() -> None:
    real = _RecordingTransport()
    transport = _CoalescingTransport(real, lambda: True)  # type: ignore[arg-type]
    transport.write(b"goaway")
    transport.close()
    assert real.writes == [b"goaway"] and real.closed
    await anyio.wait_all_tasks_blocked()
    assert real.writes == [b"goaway"]  # the scheduled flush finds nothing more to send


async def test_the_h2_connection_the_plugin_reaches_into_is_where_it_looks(tmp_path: Path) -> None:
    """`_streams` (coalescing) and `_bound_closed_streams` read h2's private layout through grpclib.

    Should grpclib or h2 move it, both fall back (no coalescing, h2's default memory): this
    test says so instead of a silent slowdown.
    """
    server = _ClosingServer([UnservedMethods()])
    path = tmp_path / "s.sock"
    await server.start(path=str(path))
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await grpcio_unary(
                path, UNSERVED_METHODS[0], b"", grpcio_protos().v1.NodePrepareResourcesResponse
            )
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        (protocol,) = list(server._protocols)
        h2_connection = _h2_connection(protocol)
        assert isinstance(h2_connection.streams, dict) and _streams(protocol) == len(h2_connection.streams)
        assert h2_connection._closed_streams._size_limit == CLOSED_STREAMS_REMEMBERED
    finally:
        server.close()
        server.close_connections()
        await server.wait_closed()
