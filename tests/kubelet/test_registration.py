"""Registration service: GetInfo and NotifyRegistrationStatus, over grpclib and grpcio."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpclib import GRPCError
from grpclib.client import Channel
from grpclib.const import Status
from prometheus_client import CollectorRegistry

from agent.kubelet._protos import pluginregistration as pb
from agent.kubelet.registration import SUPPORTED_SERVICES, RegistrationService
from agent.observe.metrics import Metrics
from tests.kubelet.grpc_support import (
    DRIVER,
    GET_INFO,
    NOTIFY,
    grpcio_protos,
    grpcio_unary,
    make_plugin,
    serving,
    short_tmp_dir,
)

EXPECTED_VERSIONS = ["v1.DRAPlugin", "v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth"]


@pytest.fixture
def root() -> Iterator[Path]:
    yield from short_tmp_dir()


def test_supported_services_order() -> None:
    # A 1.34+ kubelet takes the first entry it supports: v1 must come first.
    assert list(SUPPORTED_SERVICES) == EXPECTED_VERSIONS


async def test_get_info_grpcio(root: Path) -> None:
    protos = grpcio_protos()
    async with serving(make_plugin(root)) as plugin:
        info = await grpcio_unary(
            plugin.registration_socket,
            GET_INFO,
            protos.registration.InfoRequest(),
            protos.registration.PluginInfo,
        )
    assert info.type == "DRAPlugin"
    assert info.name == DRIVER
    assert info.endpoint == str(plugin.dra_socket)
    assert Path(info.endpoint).is_absolute()
    assert list(info.supported_versions) == EXPECTED_VERSIONS


async def test_get_info_grpclib(root: Path) -> None:
    plugin = make_plugin(root)
    async with serving(plugin), Channel(path=str(plugin.registration_socket)) as channel:
        info = await pb.RegistrationStub(channel).get_info(pb.InfoRequest(), timeout=1.0)
    assert (info.type, info.name, info.endpoint) == ("DRAPlugin", DRIVER, str(plugin.dra_socket))
    assert info.supported_versions == EXPECTED_VERSIONS


async def test_notify_accepted_sets_ready_and_metrics(root: Path) -> None:
    metrics = Metrics(CollectorRegistry())
    calls: list[tuple[bool, str]] = []
    protos = grpcio_protos()
    plugin = make_plugin(root, metrics=metrics, readiness_callback=lambda ok, msg: calls.append((ok, msg)))
    assert plugin.registered is None
    async with serving(plugin):
        await grpcio_unary(
            plugin.registration_socket,
            NOTIFY,
            protos.registration.RegistrationStatus(plugin_registered=True),
            protos.registration.RegistrationStatusResponse,
        )
    assert plugin.registered is True
    assert calls == [(True, "")]
    reg = metrics.registry
    assert reg.get_sample_value("dra_agent_kubelet_registration_status", {"driver": DRIVER}) == 1
    assert (
        reg.get_sample_value(
            "dra_agent_kubelet_registration_notifications_total", {"driver": DRIVER, "result": "accepted"}
        )
        == 1
    )


async def test_notify_refused_is_visible(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    metrics = Metrics(CollectorRegistry())
    calls: list[tuple[bool, str]] = []
    protos = grpcio_protos()
    plugin = make_plugin(root, metrics=metrics, readiness_callback=lambda ok, msg: calls.append((ok, msg)))
    kubelet_error = 'none of services supported by the plugin ("x") are supported by the kubelet'
    async with serving(plugin):
        # Accepted first, so the refusal visibly flips the gauge back to 0.
        await grpcio_unary(
            plugin.registration_socket,
            NOTIFY,
            protos.registration.RegistrationStatus(plugin_registered=True),
            protos.registration.RegistrationStatusResponse,
        )
        with (
            caplog.at_level(logging.ERROR, logger="agent.kubelet.registration"),
            pytest.raises(grpc.aio.AioRpcError) as err,
        ):
            await grpcio_unary(
                plugin.registration_socket,
                NOTIFY,
                protos.registration.RegistrationStatus(plugin_registered=False, error=kubelet_error),
                protos.registration.RegistrationStatusResponse,
            )
    assert err.value.code() == grpc.StatusCode.UNKNOWN
    assert err.value.details() == f"failed registration process: {kubelet_error}"
    assert plugin.registered is False
    assert plugin.registration.last_error == kubelet_error
    assert calls == [(True, ""), (False, kubelet_error)]
    assert metrics.registry.get_sample_value("dra_agent_kubelet_registration_status", {"driver": DRIVER}) == 0
    assert (
        metrics.registry.get_sample_value(
            "dra_agent_kubelet_registration_notifications_total", {"driver": DRIVER, "result": "refused"}
        )
        == 1
    )
    refusals = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert refusals and refusals[0].fields["kubelet_error"] == kubelet_error  # type: ignore[attr-defined]


async def test_notify_refused_grpclib_error() -> None:
    service = RegistrationService(DRIVER, "/x/dra.sock")
    with pytest.raises(GRPCError) as err:
        await service.notify_registration_status(pb.RegistrationStatus(plugin_registered=False, error="nope"))
    assert err.value.status is Status.UNKNOWN
    assert err.value.message == "failed registration process: nope"


async def test_broken_readiness_callback_does_not_fail_the_rpc() -> None:
    def broken(ok: bool, message: str) -> None:
        raise RuntimeError("callback bug")

    service = RegistrationService(DRIVER, "/x/dra.sock", readiness_callback=broken)
    answer = await service.notify_registration_status(pb.RegistrationStatus(plugin_registered=True))
    assert answer == pb.RegistrationStatusResponse()
    assert service.registered is True


async def test_registration_gauge_starts_at_zero() -> None:
    metrics = Metrics(CollectorRegistry())
    RegistrationService(DRIVER, "/x/dra.sock", metrics=metrics)
    assert metrics.registry.get_sample_value("dra_agent_kubelet_registration_status", {"driver": DRIVER}) == 0
