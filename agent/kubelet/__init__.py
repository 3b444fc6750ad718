"""The kubelet's gRPC side: plugin registration, the DRA service, the health stream, the generated protos.

Imports `agent.core`, `agent.observe`, `agent.health` and `agent.claims.preparer` only.
"""
