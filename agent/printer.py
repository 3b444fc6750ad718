"""The slices the agent would publish, as YAML: ``dra-agent slices`` and ``run --kube none``.

Exactly what the publisher would create on an up-to-date cluster of release ``--print-for``
(its chunking, shared counters and taints), with the Node's uid left as a placeholder. The
printing command reads the backends once and exits; ``run --kube none`` prints again on every
change, for as long as it serves the kubelet.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TextIO

from agent.config import AgentConfig
from agent.core.model import Device
from agent.health.taints import TaintPolicy


def pool_document(config: AgentConfig, driver: str, devices: Sequence[Device], policy: TaintPolicy) -> str:
    """One driver's pool as a YAML ``List`` document, as published to release ``config.print_for``."""
    import yaml

    from agent.kube.capabilities import guess
    from agent.kube.client import ServerInfo
    from agent.kube.pool import build_pool

    minor = int(config.print_for.split(".")[1])
    # What the publisher assumes of that release until its probe has run.
    capabilities = guess(ServerInfo(1, minor, f"v{config.print_for}.0", "v1"))
    support = capabilities.taint_support
    slices = build_pool(
        driver=driver,
        node_name=config.node_name,
        node_uid=f"<uid of Node {config.node_name}>",
        devices=devices,
        taints=policy.taint_map(devices, support),
        support=support,
        max_devices=capabilities.max_devices_per_slice,
        minor=minor,
    )
    return "---\n" + yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": slices}, sort_keys=False)


async def print_slices_once(config: AgentConfig, policy: TaintPolicy, out: TextIO) -> None:
    """Discover each configured backend's devices once and print its pool (``dra-agent slices``)."""
    from agent.app import create_backends

    for backend in create_backends(config):
        await backend.start()
        try:
            devices = list(await backend.discover())
        finally:
            await backend.stop()
        out.write(pool_document(config, backend.driver_name, devices, policy))
    out.flush()
