"""Prepare and unprepare: claim state, the ResourceClaim reader, CDI specs, the checkpoint, the prepare lock.

Imports `agent.core` and `agent.observe`; the kubelet layer reaches it only through `claims.preparer`.
"""
