"""The kubelet plugin-watcher registration service (``pluginregistration.Registration``).

The kubelet finds our registration socket, calls `GetInfo` (with a 1 s timeout) and then tells us
through `NotifyRegistrationStatus` whether it accepted the plugin. A refusal must be visible: it
is logged as an error with the kubelet's message, sets the registration gauge to 0 and reports
not-ready through the readiness callback.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

from grpclib import GRPCError
from grpclib.const import Status

from agent.core.logs import log_fields
from agent.kubelet._protos import pluginregistration as pb
from agent.observe.metrics import Metrics

log = logging.getLogger("agent.kubelet.registration")

PLUGIN_TYPE = "DRAPlugin"
DRA_V1 = "v1.DRAPlugin"
DRA_V1BETA1 = "v1beta1.DRAPlugin"
HEALTH_V1 = "v1.DRAResourceHealth"
HEALTH_V1ALPHA1 = "v1alpha1.DRAResourceHealth"
SUPPORTED_SERVICES = (DRA_V1, DRA_V1BETA1, HEALTH_V1, HEALTH_V1ALPHA1)
"""Every service we can advertise, in the order we advertise them. Order matters for the DRA
services: a 1.34+ kubelet takes the first one it supports, so v1 comes before v1beta1. For health
a 1.37 kubelet takes v1 whenever it is offered and v1alpha1 otherwise; 1.34-1.36 kubelets ignore
the health entries and always call v1alpha1."""

GRPC_SERVICES = {
    DRA_V1: "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin",
    DRA_V1BETA1: "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin",
    HEALTH_V1: HEALTH_V1,
    HEALTH_V1ALPHA1: HEALTH_V1ALPHA1,
}
"""Advertised name -> full gRPC service name (the DRA ones carry the long proto package)."""


def served_services(method_paths: Iterable[str]) -> tuple[str, ...]:
    """The entries of `SUPPORTED_SERVICES`, in order, whose gRPC service has a method among
    `method_paths` (``/<service>/<method>``, as in a grpclib ``__mapping__``)."""
    served = {path.lstrip("/").rpartition("/")[0] for path in method_paths}
    return tuple(name for name in SUPPORTED_SERVICES if GRPC_SERVICES[name] in served)


ReadinessCallback = Callable[[bool, str], None]
"""Called with ``(True, "")`` when the kubelet accepts us, ``(False, message)`` when it refuses."""


class RegistrationService(pb.RegistrationBase):
    """Answers the kubelet's `GetInfo` and records its registration verdict."""

    def __init__(
        self,
        driver: str,
        endpoint: str,
        *,
        supported_services: Sequence[str] = SUPPORTED_SERVICES,
        metrics: Metrics | None = None,
        readiness_callback: ReadinessCallback | None = None,
    ) -> None:
        self.driver = driver
        self.endpoint = endpoint
        self.supported_services = tuple(supported_services)
        self._metrics = metrics
        self._readiness_callback = readiness_callback
        self.registered: bool | None = None
        """None until the kubelet answers, then whether it accepted the plugin."""
        self.last_error = ""
        if metrics is not None:
            metrics.registration_status.labels(driver).set(0)

    async def get_info(self, info_request: pb.InfoRequest) -> pb.PluginInfo:
        """Who we are: answered from memory, well inside the kubelet's 1 s timeout."""
        return pb.PluginInfo(
            type=PLUGIN_TYPE,
            name=self.driver,
            endpoint=self.endpoint,
            supported_versions=list(self.supported_services),
        )

    async def notify_registration_status(
        self, registration_status: pb.RegistrationStatus
    ) -> pb.RegistrationStatusResponse:
        """Record the kubelet's verdict; a refusal answers an error, as the Go helper does."""
        accepted = registration_status.plugin_registered
        message = registration_status.error
        self.registered = accepted
        self.last_error = "" if accepted else message
        if self._metrics is not None:
            self._metrics.registration_notifications.labels(
                self.driver, "accepted" if accepted else "refused"
            ).inc()
            self._metrics.registration_status.labels(self.driver).set(1 if accepted else 0)
        if accepted:
            log.info(
                "kubelet accepted the plugin registration",
                extra=log_fields(driver=self.driver, endpoint=self.endpoint),
            )
        else:
            log.error(
                "kubelet refused the plugin registration; check the kubelet version and its log",
                extra=log_fields(driver=self.driver, endpoint=self.endpoint, kubelet_error=message),
            )
        if self._readiness_callback is not None:
            try:
                self._readiness_callback(accepted, self.last_error)
            except Exception:
                # A broken callback must not turn the kubelet's notification into a failed RPC.
                log.exception("readiness callback failed", extra=log_fields(driver=self.driver))
        if not accepted:
            # The Go helper returns a plain error here, which reaches the kubelet as Unknown.
            raise GRPCError(Status.UNKNOWN, f"failed registration process: {message}")
        return pb.RegistrationStatusResponse()
