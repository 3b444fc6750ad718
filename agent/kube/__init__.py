"""Everything that talks to the API server: the client, the slice publisher and builder, validation, Events.

Imports `agent.core`, `agent.observe` and `agent.health`; never `claims` or `kubelet`.
"""
