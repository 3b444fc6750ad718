"""A client of the kubelet's PodResources API (v1 ``List``): which containers use which DRA devices.

The kubelet serves ``v1.PodResourcesLister`` on ``<kubelet root>/pod-resources/kubelet.sock``. Since
1.27 (on by default since 1.34, gate ``KubeletPodResourcesDynamicResources``) each container lists
its ``dynamic_resources``: the claim (namespace, name) and, per device, the driver, pool and
device name. A socket that is absent, refuses the call or does not implement it raises
`PodResourcesUnavailable`; the caller falls back to the claim's ``reservedFor``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError, StreamTerminatedError

from agent.core.errors import AgentError
from agent.kubelet._protos.v1 import ListPodResourcesRequest, PodResourcesListerStub

log = logging.getLogger("agent.kubelet.podresources")

SOCKET_NAME = "pod-resources/kubelet.sock"
"""Relative to the kubelet's root directory (``/var/lib/kubelet``)."""
LIST_TIMEOUT = 5.0


class PodResourcesUnavailable(AgentError):
    """The PodResources API cannot answer (no socket, older kubelet, call failed)."""


@dataclass(frozen=True)
class ContainerDevice:
    """One DRA device a container uses, as the kubelet reports it."""

    pod_namespace: str
    pod: str
    container: str
    claim_namespace: str
    claim: str
    driver: str
    pool: str
    device: str


def default_socket(plugins_dir: Path) -> Path:
    """The PodResources socket next to the kubelet's plugins directory (``<root>/plugins``)."""
    return plugins_dir.parent / SOCKET_NAME


class PodResourcesClient:
    """Lists the DRA devices of the running containers over the kubelet's unix socket."""

    def __init__(self, socket_path: Path, *, timeout: float = LIST_TIMEOUT) -> None:
        self.socket_path = socket_path
        self.timeout = timeout

    async def list_devices(self) -> list[ContainerDevice]:
        """Every (container, DRA device) pair the kubelet reports; raises `PodResourcesUnavailable`."""
        if not self.socket_path.exists():
            raise PodResourcesUnavailable(f"no PodResources socket at {self.socket_path}")
        channel = Channel(path=str(self.socket_path))
        try:
            stub = PodResourcesListerStub(channel, timeout=self.timeout)
            response = await stub.list(ListPodResourcesRequest())
        except GRPCError as error:
            if error.status is Status.UNIMPLEMENTED:
                raise PodResourcesUnavailable(
                    f"the kubelet at {self.socket_path} does not serve PodResources v1 List"
                ) from error
            raise PodResourcesUnavailable(
                f"PodResources List at {self.socket_path} failed: {error.status.name} {error.message}"
            ) from error
        except (OSError, TimeoutError, StreamTerminatedError) as error:
            raise PodResourcesUnavailable(
                f"PodResources List at {self.socket_path} failed: {error}"
            ) from error
        finally:
            channel.close()
        return [
            ContainerDevice(
                pod_namespace=pod.namespace,
                pod=pod.name,
                container=container.name,
                claim_namespace=dynamic.claim_namespace,
                claim=dynamic.claim_name,
                driver=resource.driver_name,
                pool=resource.pool_name,
                device=resource.device_name,
            )
            for pod in response.pod_resources
            for container in pod.containers
            for dynamic in container.dynamic_resources
            for resource in dynamic.claim_resources
        ]
