"""Everything that talks to the API server: client, slice publisher, pool reconciler, builder, probe, Events.

The client's HTTP is aiohttp (`transport`: one session, one bounded pool, and our thin layer of
Go's stale-connection resend, body bounds and the watch's lines); credentials are
kubernetes-asyncio's loaders (`credentials`). Imports `agent.core`, `agent.observe` and
`agent.health`; never `claims` or `kubelet`.
"""
