"""Composition root of `dra-agent run`: builds the agent's parts from the config and runs them.

(Skeleton: publishing and the kubelet services are wired in as their modules land.)
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import anyio
import yaml
from anyio.abc import TaskGroup

from agent.app import Agent, run_until_signal
from agent.config import AgentConfig
from agent.slices import build_pool
from agent.taints import ClusterTaintSupport, TaintPolicy

log = logging.getLogger("agent.runner")


def slice_printer(out: TextIO, policy: TaintPolicy, support: ClusterTaintSupport):  # type: ignore[no-untyped-def]
    """With ``--kube none``: print the slices the agent would publish, on every change."""

    async def hook(agent: Agent, tg: TaskGroup) -> None:
        async def printer() -> None:
            seen: dict[str, int] = {}
            while True:
                for driver, runtime in agent.drivers.items():
                    version = runtime.inventory.version
                    if seen.get(driver) == version:
                        continue
                    seen[driver] = version
                    devices = runtime.inventory.devices()
                    slices = build_pool(
                        driver=driver,
                        node_name=agent.config.node_name,
                        node_uid="",
                        devices=devices,
                        taints=policy.taint_map(devices, support),
                    )
                    out.write(
                        "---\n"
                        + yaml.safe_dump(
                            {"apiVersion": "v1", "kind": "List", "items": slices}, sort_keys=False
                        )
                    )
                    out.flush()
                await anyio.sleep(0.1)

        tg.start_soon(printer)

    return hook


async def run_agent(config: AgentConfig) -> None:
    """Run the agent described by `config` until SIGTERM/SIGINT."""
    policy = TaintPolicy.load(config.taint_policy) if config.taint_policy else TaintPolicy.default()
    hooks = []
    if config.kube_mode == "none":
        hooks.append(slice_printer(sys.stdout, policy, ClusterTaintSupport(16, True)))
    await run_until_signal(Agent(config, hooks=hooks))
