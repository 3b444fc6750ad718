"""The metrics server's listen address: its default port and the ``HOST:PORT`` parser.

Apart from `agent.observe.httpserver` so that the config and the preflight check read it without
importing aiohttp (~0.1 s), which the agent imports only after the kubelet sockets serve.
Default port 9478: it clashes neither with dcgm-exporter (9400) nor with AMD's device metrics
exporter (5000), which often run on the same nodes.
"""

from __future__ import annotations

from agent.core.errors import ConfigError

DEFAULT_METRICS_PORT = 9478


def parse_address(address: str) -> tuple[str | None, int]:
    """``HOST:PORT`` (``[::]:9478`` for IPv6; empty host = all interfaces) -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(
            "--metrics-address",
            address,
            f"HOST:PORT such as 0.0.0.0:{DEFAULT_METRICS_PORT} (port 0 picks one)",
        )
    host = host.strip("[]")
    return (host or None), int(port)
