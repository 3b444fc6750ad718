"""The slices the agent would publish, as YAML: ``dra-agent slices`` and ``run --kube none``.

Exactly what the publisher would create on an up-to-date cluster of release ``--print-for``
(its chunking, shared counters and taints), with the Node's uid left as a placeholder. The
printing command reads the backends once and exits; ``run --kube none`` prints again on every
change, for as long as it serves the kubelet.
"""

from __future__ import annotations

from collections.abc import Sequence

from agent.core.model import Device
from agent.health.taints import TaintPolicy


def pool_document(
    node_name: str, release: str, driver: str, devices: Sequence[Device], policy: TaintPolicy
) -> str:
    """One driver's pool on `node_name` as a YAML ``List`` document, as published to `release` (``1.36``)."""
    import yaml

    from agent.kube.capabilities import guess
    from agent.kube.client import ServerInfo
    from agent.kube.pool import build_pool

    minor = int(release.split(".")[1])
    # What the publisher assumes of that release until its probe has run.
    capabilities = guess(ServerInfo(1, minor, f"v{release}.0", "v1"))
    support = capabilities.taint_support
    slices = build_pool(
        driver=driver,
        node_name=node_name,
        node_uid=f"<uid of Node {node_name}>",
        devices=devices,
        taints=policy.taint_map(devices, support),
        support=support,
        max_devices=capabilities.max_devices_per_slice,
        minor=minor,
    )
    return "---\n" + yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": slices}, sort_keys=False)
