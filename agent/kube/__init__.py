"""Everything that talks to the API server: client, slice publisher, pool reconciler, builder, probe, Events.

Imports `agent.core`, `agent.observe` and `agent.health`; never `claims` or `kubelet`.
"""
