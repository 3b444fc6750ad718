"""Registration first: the sockets answer before the claim state is loaded; claims wait for it.

After a restart the kubelet waits for the registration socket and then retries its prepares
(pkg/kubelet/cm/dra/manager.go retries NodePrepareResources until the pod's start times out), so
the sockets come up before the checkpoint load and the start-up reconcile's API reads, and
prepare/unprepare calls wait for those instead of failing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from agent.claims.preparer import PrepareResult
from agent.observe.metrics import Metrics
from tests.kubelet.grpc_support import (
    DRIVER,
    GET_INFO,
    V1,
    FakePreparer,
    grpcio_protos,
    grpcio_unary,
    make_plugin,
    serving,
    short_tmp_dir,
)
from tests.kubelet.test_healthservice import wait_until


@pytest.fixture
def root() -> Iterator[Path]:
    yield from short_tmp_dir()


async def test_claims_wait_for_the_preparer_while_registration_answers(root: Path) -> None:
    protos = grpcio_protos()
    ready = anyio.Event()
    preparer = FakePreparer(results={"uid-1": PrepareResult()})
    claims = [protos.v1.Claim(namespace="default", name="c", uid="uid-1")]
    metrics = Metrics()
    async with serving(make_plugin(root, preparer, preparer_ready=ready, metrics=metrics)) as plugin:
        info = await grpcio_unary(
            plugin.registration_socket,
            GET_INFO,
            protos.registration.InfoRequest(),
            protos.registration.PluginInfo,
        )
        assert info.endpoint == str(plugin.dra_socket)
        # The kubelet's empty liveness call does not wait either.
        empty = await grpcio_unary(
            plugin.dra_socket,
            V1 + "NodePrepareResources",
            protos.v1.NodePrepareResourcesRequest(),
            protos.v1.NodePrepareResourcesResponse,
        )
        assert not empty.claims
        answers: list[object] = []

        async def prepare() -> None:
            answers.append(
                await grpcio_unary(
                    plugin.dra_socket,
                    V1 + "NodePrepareResources",
                    protos.v1.NodePrepareResourcesRequest(claims=claims),
                    protos.v1.NodePrepareResourcesResponse,
                )
            )

        async with anyio.create_task_group() as tg:
            tg.start_soon(prepare)
            in_flight = metrics.grpc_in_flight.labels(DRIVER, "v1.NodePrepareResources")
            await wait_until(lambda: in_flight._value.get() == 1)  # the call reached the service...
            assert preparer.prepared == [] and answers == []  # ...and waits for the preparer
            ready.set()
        assert [c.uid for c in preparer.prepared[0]] == ["uid-1"]
        assert len(answers) == 1
