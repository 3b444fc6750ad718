"""Device health: the tracker that turns backend health events into conditions, and the taint policy.

Imports `agent.core` and `agent.observe`.
"""
