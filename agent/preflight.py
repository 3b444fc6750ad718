"""Start-up checks of the node environment, before the agent writes anything.

A fresh node has none of the agent's directories; a broken one may have a regular file where a
directory should be, a read-only mount, a metrics port already taken or a metrics host that does
not resolve. Retrying cannot fix any of these, so they are found here, all before the first
write, and reported as one `ConfigError` line naming the flag, the path and the fix (exit 2).
Only when every check passes are the missing directories created.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

from agent.config import OPTIONS, AgentConfig
from agent.core.errors import ConfigError
from agent.observe.address import parse_address


@dataclass(frozen=True)
class AgentDir:
    """A directory the agent writes: the flag that sets it and its path."""

    flag: str
    path: Path


def option_name(flag: str) -> str:
    """``--state-dir ($DRA_AGENT_STATE_DIR)``: in a pod the value comes from the environment."""
    env = next(o.env for o in OPTIONS if o.flag == flag)
    return f"{flag} (${env})"


def agent_dirs(config: AgentConfig) -> tuple[AgentDir, ...]:
    """Every directory `config` makes the agent write."""
    dirs = [("--cdi-root", config.cdi_root), ("--state-dir", config.state_dir)]
    if config.serve_kubelet:
        dirs += [("--registry-dir", config.registry_dir), ("--plugins-dir", config.plugins_dir)]
    return tuple(AgentDir(option_name(flag), path) for flag, path in dirs)


def check_dir(entry: AgentDir) -> None:
    """Raise `ConfigError` unless `entry.path` is, or can be created as, a writable directory."""
    path = entry.path.absolute()
    existing = path
    while not existing.exists() and existing != existing.parent:
        if existing.is_symlink():  # a dangling link: mkdir would fail on it
            break
        existing = existing.parent
    if not existing.is_dir():
        what = "a regular file" if existing.is_file() else "not a directory"
        where = "it is" if existing == path else f"{existing} is"
        raise ConfigError(
            entry.flag,
            str(entry.path),
            f"a directory the agent can create or write ({where} {what}; remove it or point "
            f"{entry.flag} elsewhere)",
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            entry.flag,
            str(entry.path),
            f"a writable directory ({existing} is not writable by this process: mount it read-write "
            f"or point {entry.flag} elsewhere)",
        )


def create_dir(entry: AgentDir) -> None:
    """Create `entry.path` (and its parents); a failure is a `ConfigError` naming the flag."""
    try:
        entry.path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(
            entry.flag,
            str(entry.path),
            f"a directory the agent can create ({error.strerror or error}; point {entry.flag} elsewhere)",
        ) from None


def check_metrics_address(address: str) -> None:
    """Raise `ConfigError` unless `address` resolves and every address it names can be bound now."""
    host, port = parse_address(address)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise ConfigError(
            option_name("--metrics-address"),
            address,
            f"HOST:PORT with a host this node resolves ({error.strerror}); 0.0.0.0 listens everywhere",
        ) from None
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            # As aiohttp binds it; a port in TIME_WAIT is free, one with a listener is not.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(sockaddr)
            except OSError as error:
                raise ConfigError(
                    option_name("--metrics-address"),
                    address,
                    f"a free HOST:PORT ({sockaddr[0]} port {port}: {error.strerror or error}; another "
                    "process listens there: pick another port)",
                ) from None


def preflight(config: AgentConfig) -> None:
    """Check the node environment, then create the missing directories (nothing before all pass)."""
    dirs = agent_dirs(config)
    for entry in dirs:
        check_dir(entry)
    check_metrics_address(config.metrics_address)
    for entry in dirs:
        create_dir(entry)
