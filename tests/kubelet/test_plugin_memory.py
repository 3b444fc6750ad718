"""The kubelet's one long-lived connection does not grow the agent's memory with every call.

h2 (h2/connection.py, ``H2Connection.MAX_CLOSED_STREAMS = 2**16``) remembers every closed stream
of a connection; the kubelet (grpc-go, one connection per plugin socket) opens one stream per
NodePrepareResources call, so each prepare left ~115 bytes behind, up to ~7 MB per connection.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from agent.kubelet.draservice import DRAPluginV1, DRAService
from agent.kubelet.plugin import CLOSED_STREAMS_REMEMBERED, _ClosingServer
from tests.kubelet.grpc_support import DRIVER, V1, FakePreparer, grpcio_protos, short_tmp_dir

CALLS = CLOSED_STREAMS_REMEMBERED + 200


@pytest.fixture
def root() -> Iterator[Path]:
    yield from short_tmp_dir()


async def test_closed_streams_of_a_connection_are_bounded(root: Path) -> None:
    pb = grpcio_protos().v1
    server = _ClosingServer([DRAPluginV1(DRAService(DRIVER, FakePreparer()))])
    path = root / "dra.sock"
    await server.start(path=str(path))
    try:
        async with grpc.aio.insecure_channel(f"unix://{path}") as channel:
            call = channel.unary_unary(
                V1 + "NodePrepareResources",
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=pb.NodePrepareResourcesResponse.FromString,
            )
            claim = pb.Claim(namespace="default", name="c", uid="u")
            for _ in range(CALLS):
                await call(pb.NodePrepareResourcesRequest(claims=[claim]))
        (protocol,) = list(server._protocols)
        closed = protocol.connection._connection._closed_streams  # h2's record of closed streams
        assert len(closed) <= CLOSED_STREAMS_REMEMBERED < CALLS
    finally:
        server.close()
        server.close_connections()
        await server.wait_closed()
