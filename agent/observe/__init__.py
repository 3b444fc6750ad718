"""Observability: Prometheus metrics, readiness checks, the /metrics /healthz /readyz server, telemetry.

Imports `agent.core` only.
"""
