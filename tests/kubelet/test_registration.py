"""Registration service: GetInfo and NotifyRegistrationStatus, over grpclib and grpcio.

GetInfo lists exactly the services the DRA socket serves. The health entries follow upstream
kubernetes/kubernetes: staging/src/k8s.io/kubelet/pkg/apis/dra-health/v1/types.go and
.../dra-health/v1alpha1/types.go (``DRAResourceHealthService`` is the gRPC service name,
"v1.DRAResourceHealth" / "v1alpha1.DRAResourceHealth"), and
pkg/kubelet/cm/dra/plugin/dra_plugin_manager_test.go (``TestPickHealthService``: a 1.37 kubelet
picks v1 when both are offered, in either order, and v1alpha1 when only it is).
"""

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

from agent.core.inventory import Inventory
from agent.kubelet._protos import pluginregistration as pb
from agent.kubelet.draservice import DRAPluginV1, DRAPluginV1Beta1, DRAService
from agent.kubelet.healthservice import HEALTH_APIS, V1ALPHA1, HealthService
from agent.kubelet.plugin import UnservedMethods
from agent.kubelet.registration import (
    GRPC_SERVICES,
    SUPPORTED_SERVICES,
    RegistrationService,
    served_services,
)
from agent.observe.metrics import Metrics
from tests.kubelet.grpc_support import (
    DRIVER,
    GET_INFO,
    NOTIFY,
    FakePreparer,
    grpcio_protos,
    grpcio_unary,
    make_plugin,
    serving,
    short_tmp_dir,
)

EXPECTED_VERSIONS = [
    "v1.DRAPlugin",
    "v1beta1.DRAPlugin",
    "v1.DRAResourceHealth",
    "v1alpha1.DRAResourceHealth",
]
HEALTH_SERVICES = ("v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")
"""What a 1.37 kubelet's health choice walks, newest first (dra_plugin_manager_test.go)."""


@pytest.fixture
def root() -> Iterator[Path]:
    yield from short_tmp_dir()


def test_supported_services_order() -> None:
    # A 1.34+ kubelet takes the first DRA entry it supports: v1 must come first.
    assert list(SUPPORTED_SERVICES) == EXPECTED_VERSIONS


def kubelet_1_37_health_choice(supported_versions: list[str]) -> str:
    """The health service a 1.37 kubelet streams from: the newest one offered, whatever the order."""
    return next((name for name in HEALTH_SERVICES if name in supported_versions), "")


def test_a_1_37_kubelet_picks_health_v1() -> None:
    assert kubelet_1_37_health_choice(EXPECTED_VERSIONS) == "v1.DRAResourceHealth"
    assert kubelet_1_37_health_choice(["v1beta1.DRAPlugin"]) == ""
    assert kubelet_1_37_health_choice(["v1alpha1.DRAResourceHealth"]) == "v1alpha1.DRAResourceHealth"


def test_health_service_names_are_the_grpc_service_names() -> None:
    # Upstream's DRAResourceHealthService must equal DRAResourceHealth_ServiceDesc.ServiceName.
    service = HealthService(Inventory(DRIVER), pool="n")
    for api in HEALTH_APIS:
        assert GRPC_SERVICES[api.service] == api.service
        assert api.watch_path in service.__mapping__()


def test_served_services_lists_what_has_handlers_in_our_order() -> None:
    dra = DRAService(DRIVER, FakePreparer())
    health = HealthService(Inventory(DRIVER), pool="n")
    mappings = [DRAPluginV1(dra).__mapping__(), DRAPluginV1Beta1(dra).__mapping__(), health.__mapping__()]
    paths = [path for mapping in reversed(mappings) for path in mapping]
    assert list(served_services(paths)) == EXPECTED_VERSIONS
    only_alpha = HealthService(Inventory(DRIVER), pool="n", apis=(V1ALPHA1,))
    paths = [*DRAPluginV1Beta1(dra).__mapping__(), *only_alpha.__mapping__()]
    assert served_services(paths) == ("v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth")
    # Methods answered with UNIMPLEMENTED are known, not served.
    assert served_services(UnservedMethods().__mapping__()) == ()
    assert served_services([]) == ()


def test_plugin_refuses_to_advertise_what_it_does_not_serve(root: Path) -> None:
    with pytest.raises(ValueError, match=r"v1beta1\.DRAResourceHealth") as err:
        make_plugin(root, supported_services=["v1.DRAPlugin", "v1beta1.DRAResourceHealth"])
    assert "not served" in str(err.value)
    with pytest.raises(ValueError, match=r"1\.0\.0"):
        make_plugin(root, supported_services=["1.0.0"])


async def test_get_info_with_fewer_services(root: Path) -> None:
    plugin = make_plugin(root, supported_services=["v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth"])
    async with serving(plugin), Channel(path=str(plugin.registration_socket)) as channel:
        info = await pb.RegistrationStub(channel).get_info(pb.InfoRequest(), timeout=1.0)
    assert info.supported_versions == ["v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth"]


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
