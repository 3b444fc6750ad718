"""DRA node service v1 + v1beta1: validation, preparer calls, answers and errors on the wire."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import grpc
import pytest
from grpclib import GRPCError
from grpclib.client import Channel
from grpclib.const import Status
from prometheus_client import CollectorRegistry

from agent.claims.preparer import PreparedDevice, PrepareResult
from agent.core.backend import ClaimRef
from agent.core.errors import ClaimRequestError
from agent.kubelet._protos.k8s.io.kubelet.pkg.apis.dra import v1 as pb_v1
from agent.kubelet._protos.k8s.io.kubelet.pkg.apis.dra import v1beta1 as pb_v1beta1
from agent.kubelet.draservice import (
    MAX_CLAIMS_PER_REQUEST,
    NO_RESULT,
    DRAService,
    base_request_names,
    validate_claims,
)
from agent.observe.metrics import Metrics
from tests.kubelet.grpc_support import (
    DRIVER,
    V1,
    V1BETA1,
    FakePreparer,
    grpcio_protos,
    grpcio_unary,
    make_plugin,
    serving,
    short_tmp_dir,
)

GPU0 = PreparedDevice(
    requests=("gpu",),
    pool="node-1",
    device="gpu-0",
    cdi_device_ids=(f"k8s.{DRIVER}/claim=uid-a-gpu-0",),
    share_id="share-1",
)
GPU1 = PreparedDevice(requests=("gpu/small",), pool="node-1", device="gpu-1", cdi_device_ids=())


@pytest.fixture
def root() -> Iterator[Path]:
    yield from short_tmp_dir()


def claim(pb: Any, uid: str, namespace: str = "default", name: str = "") -> Any:
    return pb.Claim(namespace=namespace, uid=uid, name=name or f"claim-{uid}")


# --- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"namespace": ""}, "claims[1].namespace: must not be empty"),
        ({"uid": ""}, "claims[1].uid: must not be empty"),
        ({"name": ""}, "claims[1].name: must not be empty"),
        ({"namespace": "Bad_NS"}, "claims[1].namespace:"),
        ({"name": "no spaces"}, "claims[1].name:"),
        ({"name": "x" * 254}, "claims[1].name:"),
        ({"uid": "u" * 129}, "claims[1].uid:"),
        ({"uid": "with\nnewline"}, "claims[1].uid:"),
        ({"uid": " padded "}, "claims[1].uid:"),
    ],
)
def test_validate_rejects_malformed_claims(bad: dict[str, str], field: str) -> None:
    fields = {"namespace": "default", "uid": "uid-b", "name": "b"} | bad
    claims = [pb_v1.Claim(namespace="default", uid="uid-a", name="a"), pb_v1.Claim(**fields)]
    with pytest.raises(GRPCError) as err:
        validate_claims(claims)
    assert err.value.status is Status.INVALID_ARGUMENT
    assert err.value.message is not None and err.value.message.startswith(field)


def test_validate_rejects_too_many_claims() -> None:
    claims = [claim(pb_v1, f"uid-{i}") for i in range(MAX_CLAIMS_PER_REQUEST + 1)]
    with pytest.raises(GRPCError) as err:
        validate_claims(claims)
    assert err.value.status is Status.INVALID_ARGUMENT
    assert err.value.message is not None and "at most 256" in err.value.message
    assert len(validate_claims(claims[:MAX_CLAIMS_PER_REQUEST])) == MAX_CLAIMS_PER_REQUEST


def test_validate_duplicate_uids() -> None:
    same = [claim(pb_v1, "uid-a", name="a"), claim(pb_v1, "uid-b"), claim(pb_v1, "uid-a", name="a")]
    assert [r.uid for r in validate_claims(same)] == ["uid-a", "uid-b"]
    clash = [claim(pb_v1, "uid-a", name="a"), claim(pb_v1, "uid-a", name="other")]
    with pytest.raises(GRPCError) as err:
        validate_claims(clash)
    assert err.value.status is Status.INVALID_ARGUMENT
    assert err.value.message == "claims[1].uid: 'uid-a' is also used by default/a"


def test_base_request_names() -> None:
    assert base_request_names(("gpu/small", "gpu/large", "nic", "gpu")) == ["gpu", "nic"]


# --- service logic (no sockets) --------------------------------------------------------------


async def test_missing_results_are_filled_in() -> None:
    preparer = FakePreparer(omit=frozenset({"uid-b"}))
    service = DRAService(DRIVER, preparer)
    results = await service.prepare("v1", [claim(pb_v1, "uid-a"), claim(pb_v1, "uid-b")])
    assert results == {"uid-a": PrepareResult(), "uid-b": PrepareResult(error=NO_RESULT)}
    errors = await service.unprepare("v1", [claim(pb_v1, "uid-a"), claim(pb_v1, "uid-b")])
    assert errors == {"uid-a": "", "uid-b": NO_RESULT}


async def test_empty_request_does_not_call_the_preparer() -> None:
    preparer = FakePreparer()
    service = DRAService(DRIVER, preparer)
    assert await service.prepare("v1", []) == {}
    assert await service.unprepare("v1beta1", []) == {}
    assert preparer.prepared == [] and preparer.unprepared == []


async def test_metrics_count_calls_and_results() -> None:
    metrics = Metrics(CollectorRegistry())
    preparer = FakePreparer()
    service = DRAService(DRIVER, preparer, metrics=metrics)
    await service.prepare("v1", [claim(pb_v1, "uid-a")])
    preparer.error = ClaimRequestError("claim default/x not allocated")
    with pytest.raises(GRPCError):
        await service.prepare("v1", [claim(pb_v1, "uid-a")])
    with pytest.raises(GRPCError):
        await service.unprepare("v1beta1", [claim(pb_v1, "")])

    def sample(method: str, result: str) -> float | None:
        return metrics.registry.get_sample_value(
            "dra_agent_grpc_requests_total", {"driver": DRIVER, "method": method, "result": result}
        )

    assert sample("v1.NodePrepareResources", "ok") == 1
    assert sample("v1.NodePrepareResources", "failed_precondition") == 1
    assert sample("v1beta1.NodeUnprepareResources", "invalid_argument") == 1
    in_flight = {"driver": DRIVER, "method": "v1.NodePrepareResources"}
    assert metrics.registry.get_sample_value("dra_agent_grpc_in_flight_requests", in_flight) == 0


async def test_in_flight_gauge_and_cancellation() -> None:
    metrics = Metrics(CollectorRegistry())
    preparer = FakePreparer(gate=anyio.Event(), entered=anyio.Event())
    service = DRAService(DRIVER, preparer, metrics=metrics)
    labels = {"driver": DRIVER, "method": "v1.NodePrepareResources"}
    async with anyio.create_task_group() as tg:
        tg.start_soon(service.prepare, "v1", [claim(pb_v1, "uid-a")])
        assert preparer.entered is not None
        await preparer.entered.wait()
        assert metrics.registry.get_sample_value("dra_agent_grpc_in_flight_requests", labels) == 1
        tg.cancel_scope.cancel()  # the kubelet's deadline expired
    assert metrics.registry.get_sample_value("dra_agent_grpc_in_flight_requests", labels) == 0
    assert (
        metrics.registry.get_sample_value("dra_agent_grpc_requests_total", labels | {"result": "cancelled"})
        == 1
    )


# --- on the wire: grpcio (C-core) client -----------------------------------------------------


async def test_prepare_v1_grpcio_with_share_id(root: Path) -> None:
    pb2 = grpcio_protos().v1
    preparer = FakePreparer(
        results={"uid-a": PrepareResult(devices=(GPU0, GPU1)), "uid-b": PrepareResult(error="device gone")}
    )
    async with serving(make_plugin(root, preparer)) as plugin:
        request = pb2.NodePrepareResourcesRequest(
            claims=[claim(pb2, "uid-a", "ns1", "a"), claim(pb2, "uid-b"), claim(pb2, "uid-c")]
        )
        answer = await grpcio_unary(
            plugin.dra_socket, V1 + "NodePrepareResources", request, pb2.NodePrepareResourcesResponse
        )
    assert set(answer.claims) == {"uid-a", "uid-b", "uid-c"}
    a = answer.claims["uid-a"]
    assert a.error == ""
    d0, d1 = a.devices
    assert list(d0.request_names) == ["gpu"]
    assert (d0.pool_name, d0.device_name) == ("node-1", "gpu-0")
    assert list(d0.cdi_device_ids) == [f"k8s.{DRIVER}/claim=uid-a-gpu-0"]
    assert d0.HasField("share_id") and d0.share_id == "share-1"
    assert not d1.HasField("share_id")
    assert list(d1.request_names) == ["gpu"]  # subrequest stripped
    assert answer.claims["uid-b"].error == "device gone"
    assert list(answer.claims["uid-b"].devices) == []
    assert answer.claims["uid-c"].error == "" and list(answer.claims["uid-c"].devices) == []
    assert preparer.prepared == [
        [
            ClaimRef(namespace="ns1", name="a", uid="uid-a"),
            ClaimRef(namespace="default", name="claim-uid-b", uid="uid-b"),
            ClaimRef(namespace="default", name="claim-uid-c", uid="uid-c"),
        ]
    ]


async def test_prepare_v1beta1_grpcio_has_no_share_id(root: Path) -> None:
    pb2 = grpcio_protos().v1beta1
    preparer = FakePreparer(results={"uid-a": PrepareResult(devices=(GPU0,))})
    async with serving(make_plugin(root, preparer)) as plugin:
        request = pb2.NodePrepareResourcesRequest(claims=[claim(pb2, "uid-a")])
        raw = await grpcio_unary(
            plugin.dra_socket,
            V1BETA1 + "NodePrepareResources",
            request,
            type("Raw", (), {"FromString": staticmethod(lambda b: b)}),
        )
    answer = pb2.NodePrepareResourcesResponse.FromString(raw)
    (device,) = answer.claims["uid-a"].devices
    assert device.device_name == "gpu-0"
    assert list(device.cdi_device_ids) == [f"k8s.{DRIVER}/claim=uid-a-gpu-0"]
    # Field 5 never goes on the v1beta1 wire.
    assert b"share-1" not in raw


async def test_unprepare_both_versions_grpcio(root: Path) -> None:
    protos = grpcio_protos()
    preparer = FakePreparer(unprepare_errors={"uid-b": "backend refused"})
    async with serving(make_plugin(root, preparer)) as plugin:
        for pb2, prefix in ((protos.v1, V1), (protos.v1beta1, V1BETA1)):
            request = pb2.NodeUnprepareResourcesRequest(claims=[claim(pb2, "uid-a"), claim(pb2, "uid-b")])
            answer = await grpcio_unary(
                plugin.dra_socket,
                prefix + "NodeUnprepareResources",
                request,
                pb2.NodeUnprepareResourcesResponse,
            )
            assert {k: v.error for k, v in answer.claims.items()} == {"uid-a": "", "uid-b": "backend refused"}
    assert len(preparer.unprepared) == 2


async def test_empty_request_grpcio(root: Path) -> None:
    protos = grpcio_protos()
    preparer = FakePreparer()
    async with serving(make_plugin(root, preparer)) as plugin:
        for pb2, prefix in ((protos.v1, V1), (protos.v1beta1, V1BETA1)):
            answer = await grpcio_unary(
                plugin.dra_socket,
                prefix + "NodePrepareResources",
                pb2.NodePrepareResourcesRequest(),
                pb2.NodePrepareResourcesResponse,
            )
            assert len(answer.claims) == 0
    assert preparer.prepared == []


async def test_malformed_request_grpcio(root: Path) -> None:
    pb2 = grpcio_protos().v1
    async with serving(make_plugin(root)) as plugin:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await grpcio_unary(
                plugin.dra_socket,
                V1 + "NodePrepareResources",
                pb2.NodePrepareResourcesRequest(claims=[claim(pb2, "uid-a", namespace="")]),
                pb2.NodePrepareResourcesResponse,
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == "claims[0].namespace: must not be empty"
        # Bytes that are not a valid message: truncated, a field cut short, invalid UTF-8 in a
        # string field, a wire type that is not the field's (betterproto's Rust codec refuses them all).
        for raw in (b"\n\x64ab", b"\n\x02\n\xff", b"\n\x03\x12\x01\xff", b"\x08\x01"):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await grpcio_unary(
                    plugin.dra_socket, V1 + "NodePrepareResources", raw, pb2.NodePrepareResourcesResponse
                )
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            details = "cannot decode the request: RuntimeError: The given binary data"
            assert (err.value.details() or "").startswith(details)


async def test_fields_of_a_newer_kubelet_are_ignored(root: Path) -> None:
    """Protobuf's rule: a field this build does not know is skipped, in the request and in a claim.

    A newer kubelet may add fields to ``NodePrepareResourcesRequest`` or ``Claim`` (field numbers
    of k8s.io/kubelet/pkg/apis/dra/v1/api.proto); they must not make its requests undecodable.
    """
    pb2 = grpcio_protos().v1
    known = pb2.NodePrepareResourcesRequest(claims=[claim(pb2, "uid-a")]).SerializeToString()
    inner = pb2.Claim(namespace="default", uid="uid-a", name="claim-uid-a").SerializeToString()
    inner += b"\x78\x05" + b"\x82\x01\x03abc"  # field 15 (varint), field 16 (bytes)
    nested = b"\x0a" + bytes([len(inner)]) + inner
    async with serving(make_plugin(root)) as plugin:
        for raw in (known + b"\x78\x01", nested):
            response = await grpcio_unary(
                plugin.dra_socket, V1 + "NodePrepareResources", raw, pb2.NodePrepareResourcesResponse
            )
            assert list(response.claims) == ["uid-a"]


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (ClaimRequestError("claim default/a not allocated"), grpc.StatusCode.FAILED_PRECONDITION),
        (
            ClaimRequestError("retrieve claim default/a: not found", code="NOT_FOUND"),
            grpc.StatusCode.NOT_FOUND,
        ),
        (ClaimRequestError("API server down", code="unavailable"), grpc.StatusCode.UNAVAILABLE),
        (ClaimRequestError("odd", code="NOT_A_CODE"), grpc.StatusCode.FAILED_PRECONDITION),
        (RuntimeError("bug in the preparer"), grpc.StatusCode.INTERNAL),
    ],
)
async def test_preparer_errors_become_grpc_codes(root: Path, error: Exception, code: grpc.StatusCode) -> None:
    pb2 = grpcio_protos().v1
    preparer = FakePreparer(error=error)
    async with serving(make_plugin(root, preparer)) as plugin:
        for method, req, resp in (
            ("NodePrepareResources", pb2.NodePrepareResourcesRequest, pb2.NodePrepareResourcesResponse),
            ("NodeUnprepareResources", pb2.NodeUnprepareResourcesRequest, pb2.NodeUnprepareResourcesResponse),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await grpcio_unary(plugin.dra_socket, V1 + method, req(claims=[claim(pb2, "uid-a")]), resp)
            assert err.value.code() == code
            assert str(error) in (err.value.details() or "")
        # The server survives and serves the next call.
        preparer.error = None
        answer = await grpcio_unary(
            plugin.dra_socket,
            V1 + "NodePrepareResources",
            pb2.NodePrepareResourcesRequest(claims=[claim(pb2, "uid-a")]),
            pb2.NodePrepareResourcesResponse,
        )
        assert list(answer.claims) == ["uid-a"]


async def test_internal_error_message_points_to_the_log(root: Path) -> None:
    pb2 = grpcio_protos().v1
    async with serving(make_plugin(root, FakePreparer(error=KeyError("x")))) as plugin:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await grpcio_unary(
                plugin.dra_socket,
                V1 + "NodePrepareResources",
                pb2.NodePrepareResourcesRequest(claims=[claim(pb2, "uid-a")]),
                pb2.NodePrepareResourcesResponse,
            )
    assert (
        err.value.details()
        == "NodePrepareResources failed inside the agent (KeyError: 'x'); see the agent log"
    )


# --- on the wire: grpclib client (generated stubs) -------------------------------------------


async def test_prepare_and_unprepare_grpclib(root: Path) -> None:
    preparer = FakePreparer(results={"uid-a": PrepareResult(devices=(GPU0,))})
    plugin = make_plugin(root, preparer)
    async with serving(plugin), Channel(path=str(plugin.dra_socket)) as channel:
        v1 = await pb_v1.DraPluginStub(channel).node_prepare_resources(
            pb_v1.NodePrepareResourcesRequest(claims=[claim(pb_v1, "uid-a"), claim(pb_v1, "uid-b")])
        )
        beta = await pb_v1beta1.DraPluginStub(channel).node_prepare_resources(
            pb_v1beta1.NodePrepareResourcesRequest(claims=[claim(pb_v1beta1, "uid-a")])
        )
        un = await pb_v1.DraPluginStub(channel).node_unprepare_resources(
            pb_v1.NodeUnprepareResourcesRequest(claims=[claim(pb_v1, "uid-a")])
        )
        with pytest.raises(GRPCError) as err:
            await pb_v1beta1.DraPluginStub(channel).node_unprepare_resources(
                pb_v1beta1.NodeUnprepareResourcesRequest(claims=[claim(pb_v1beta1, "uid-a", name="Bad")])
            )
    assert set(v1.claims) == {"uid-a", "uid-b"}
    assert v1.claims["uid-a"].devices[0].share_id == "share-1"
    assert v1.claims["uid-b"].devices == []
    assert beta.claims["uid-a"].devices[0].device_name == "gpu-0"
    assert un.claims["uid-a"].error == ""
    assert err.value.status is Status.INVALID_ARGUMENT
