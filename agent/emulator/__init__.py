"""A strict Kubernetes API emulator for tests and demos (never imported by the agent's runtime).

It serves core/v1 nodes, namespaces and events, events.k8s.io/v1 events and resource.k8s.io
resourceslices, resourceclaims (with ``status``), resourceclaimtemplates, deviceclasses and
devicetaintrules over real HTTP, with the versions a chosen Kubernetes release (1.32 to 1.37)
serves, the apiserver's validation rules and messages, strict decoding, dry runs, server-side apply,
resourceVersions, watches, feature gates (with each release's defaults), bearer-token identities
held to RBAC-like rules with the per-driver check of claim device status (`agent.emulator.authz`)
and fault injection::

    async with KubeApiEmulator(version="1.34") as emu:
        uid = emu.add_node("node-a")
        ...
"""

from agent.emulator.errors import ApiError, Cause
from agent.emulator.faults import Faults
from agent.emulator.server import KubeApiEmulator

__all__ = ["ApiError", "Cause", "Faults", "KubeApiEmulator"]
