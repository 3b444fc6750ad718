"""Fleet benchmark: what N agents cost one API server, and whether their periodic work comes in bursts.

Starts N real ``dra-agent run`` processes (fake backend, profile ``mixed``: two drivers each), each
with its own node and its own bearer token, against one in-process API emulator that records
every request with its time and client (`agent.emulator.requestlog`). Phases:

1. **start**: all agents started in the same second, until each has published both pools;
2. **idle**: a few resync periods (``--resync`` and ``--watch-timeout``: 300 s as deployed, or
   shorter; counts are per resync period, i.e. per 5 minutes at the defaults); the burst measure
   is the largest share of one period's requests that falls in any one-second window, after the
   first period;
3. **fault**: one fault injected on every agent (fake control socket), until every taint is published;
4. **restart**: the emulator goes down for ``--outage`` seconds and comes back with its history
   compacted (old resourceVersions get 410, as after a kube-apiserver restart);
5. **rollout**: every agent is stopped and started again on the same node (a DaemonSet rollout).

Prints per-agent request counts by verb and resource for each phase, the LISTs per agent after
the restart and how they spread, the writes of the rollout, and the burst measure.

Run: ``python -m benchmarks.fleet_bench`` (``--agents 20``; ``--quick``: 4 agents, short idle).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import yaml

from agent.emulator import KubeApiEmulator
from agent.emulator.requestlog import LoggedRequest
from backends.fake.control import request as control_request

DRIVERS = 2
DISCOVERY = {"get version", "get discovery"}


@dataclass
class Agent:
    node: str
    root: Path
    kubeconfig: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def control(self) -> str:
        return str(self.root / "fake.sock")


def agent_command(agent: Agent, *, resync: float, watch_timeout: float) -> list[str]:
    """``dra-agent run`` for `agent` against the emulator (fake backend, profile mixed)."""
    root = agent.root
    return [
        sys.executable, "-m", "agent.cli", "run",
        "--kube", "kubeconfig", "--kubeconfig", str(agent.kubeconfig), "--node-name", agent.node,
        "--backend", f"fake:profile=mixed,control={agent.control}",
        "--registry-dir", str(root / "registry"), "--plugins-dir", str(root / "plugins"),
        "--cdi-root", str(root / "cdi"), "--state-dir", str(root / "state"),
        "--metrics-address", "127.0.0.1:0", "--log-level", "warning",
        "--resync", str(resync), "--watch-timeout", str(watch_timeout),
    ]  # fmt: skip


def make_agents(emu: KubeApiEmulator, base: Path, count: int) -> list[Agent]:
    """`count` nodes in the emulator, each with a directory and a kubeconfig with its own token."""
    agents = []
    for i in range(count):
        node = f"node-{i:03d}"
        emu.add_node(node)
        root = base / node
        root.mkdir(parents=True)
        kubeconfig = emu.write_kubeconfig(root / "kubeconfig")
        config = yaml.safe_load(kubeconfig.read_text())
        config["users"][0]["user"] = {"token": node}  # the emulator's request log tells agents apart by it
        kubeconfig.write_text(yaml.safe_dump(config))
        agents.append(Agent(node, root, kubeconfig))
    return agents


def start(agents: Sequence[Agent], *, resync: float, watch_timeout: float) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for agent in agents:
        log = (agent.root / "agent.log").open("ab")
        agent.proc = subprocess.Popen(
            agent_command(agent, resync=resync, watch_timeout=watch_timeout), stdout=log, stderr=log, env=env
        )


def stop(agents: Sequence[Agent]) -> None:
    for agent in agents:
        if agent.proc is not None and agent.proc.poll() is None:
            agent.proc.send_signal(signal.SIGTERM)
    for agent in agents:
        if agent.proc is not None:
            try:
                agent.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                agent.proc.kill()
                agent.proc.wait()
            agent.proc = None


async def wait_for(check: Callable[[], bool], within: float, what: str) -> None:
    with anyio.fail_after(within):
        while not check():  # noqa: ASYNC110 (the emulator's store has no event to wait on)
            await anyio.sleep(0.1)


def published_drivers(emu: KubeApiEmulator, node: str) -> set[str]:
    return {s["spec"]["driver"] for s in emu.list("resourceslices", field_selector=f"spec.nodeName={node}")}


def tainted(emu: KubeApiEmulator, node: str) -> bool:
    for item in emu.list("resourceslices", field_selector=f"spec.nodeName={node}"):
        for device in item["spec"].get("devices") or []:
            if device.get("taints"):
                return True
    return False


def per_agent(entries: Sequence[LoggedRequest], agents: Sequence[Agent]) -> dict[str, float]:
    """Mean requests per agent by label."""
    nodes = {a.node for a in agents}
    counts = Counter(e.label for e in entries if e.client in nodes)
    return {label: n / len(agents) for label, n in sorted(counts.items())}


def burst_share(
    entries: Sequence[LoggedRequest], period: float, start: float, end: float
) -> tuple[float, int]:
    """The largest share of one period's requests in any one-second window of [start, end)."""
    times = sorted(e.at for e in entries if start <= e.at < end)
    if not times:
        return 0.0, 0
    per_period = len(times) * period / (end - start)
    most, j = 0, 0
    for i, t in enumerate(times):
        while times[j] < t - 1.0:
            j += 1
        most = max(most, i - j + 1)
    return most / per_period, most


async def inject(agent: Agent) -> None:
    """One XID 79 on the agent's first NVIDIA device (fake control socket)."""
    devices = await control_request(agent.control, {"op": "list"})
    device = next(d for d in devices if "nvidia" in str(d.get("driver", "")))
    await control_request(
        agent.control,
        {
            "op": "inject",
            "device": device["device"],
            "driver": device["driver"],
            "condition": "xid",
            "value": "79",
        },
    )


async def bench(args: argparse.Namespace) -> None:
    rows: list[tuple[str, dict[str, float]]] = []
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="fleet-bench-", dir="/tmp") as tmp:
        async with KubeApiEmulator(version=args.version) as emu:
            log = emu.request_log
            agents = make_agents(emu, Path(tmp), args.agents)
            try:
                # 1. start
                t0 = time.monotonic()
                start(agents, resync=args.resync, watch_timeout=args.watch_timeout)
                await wait_for(
                    lambda: all(len(published_drivers(emu, a.node)) == DRIVERS for a in agents), 120, "start"
                )
                started = time.monotonic()
                await anyio.sleep(1.0)
                entries = log.since(t0)
                rows.append(("start", per_agent(entries, agents)))
                notes.append(
                    f"start: all {len(agents)} agents published both pools {started - t0:.1f} s after launch"
                )
                # 2. idle
                idle_from = time.monotonic()
                await anyio.sleep(args.idle)
                idle_to = time.monotonic()
                idle = log.since(idle_from, idle_to)
                # Per resync period: per 5 minutes at the default --resync 300 and --watch-timeout 300.
                scale = args.resync / (idle_to - idle_from)
                idle_counts = {k: v * scale for k, v in per_agent(idle, agents).items()}
                rows.append((f"idle, per resync ({args.resync:g} s)", idle_counts))
                # After the first period: every agent's first resync (at most 1.5 periods) is done.
                after_first = t0 + 1.5 * args.resync + 5.0
                share, most = burst_share(idle, args.resync, max(idle_from, after_first), idle_to)
                notes.append(
                    f"idle burst: at most {most} requests in one second = {share * 100:.1f} % of a period's "
                    f"requests (after the first period; {len(idle)} requests in {idle_to - idle_from:.0f} s)"
                )
                # 3. fault on every agent
                fault_from = time.monotonic()
                async with anyio.create_task_group() as tg:
                    for agent in agents:
                        tg.start_soon(inject, agent)
                await wait_for(lambda: all(tainted(emu, a.node) for a in agents), 60, "fault")
                await anyio.sleep(1.0)
                rows.append(("fault on every agent", per_agent(log.since(fault_from), agents)))
                # 4. emulator restart
                emu.faults.outage(True)
                down_at = time.monotonic()
                await anyio.sleep(args.outage)
                emu.compact()
                emu.faults.outage(False)
                up_at = time.monotonic()

                def relisted() -> bool:
                    lists = Counter(e.client for e in log.since(up_at) if e.label == "list resourceslices")
                    return all(lists[a.node] >= 1 for a in agents)

                await wait_for(relisted, 120, "restart")
                await anyio.sleep(args.settle)
                after = log.since(up_at)
                rows.append((f"restart ({args.outage:g} s down)", per_agent(after, agents)))
                lists = [e.at - up_at for e in after if e.label == "list resourceslices"]
                per = Counter(e.client for e in after if e.label == "list resourceslices")
                notes.append(
                    f"restart: down {up_at - down_at:.1f} s; LISTs per agent max {max(per.values())}, "
                    f"spread over {min(lists):.2f}..{max(lists):.2f} s after the server came back"
                )
                # 5. rollout: every agent restarted on its node
                before_writes = sum(emu.writes[k] for k in emu.writes if k[1] == "resourceslices")
                roll_from = time.monotonic()
                stop(agents)
                start(agents, resync=args.resync, watch_timeout=args.watch_timeout)
                await wait_for(
                    lambda: all(
                        sum(1 for e in log.since(roll_from) if e.client == a.node and e.verb == "watch") >= 1
                        for a in agents
                    ),
                    120,
                    "rollout",
                )
                await anyio.sleep(args.settle)
                rows.append(("rollout (restart on the node)", per_agent(log.since(roll_from), agents)))
                writes = sum(emu.writes[k] for k in emu.writes if k[1] == "resourceslices") - before_writes
                notes.append(f"rollout: {writes} ResourceSlice writes for {len(agents)} agents")
            finally:
                stop(agents)
    print_table(rows, notes, args)


def print_table(rows: list[tuple[str, dict[str, float]]], notes: list[str], args: argparse.Namespace) -> None:
    labels = sorted({label for _, counts in rows for label in counts})
    print(
        f"fleet_bench: {args.agents} agents (fake mixed, {DRIVERS} drivers each), "
        f"API emulator {args.version}; requests per agent"
    )
    width = max(len(label) for label in [*labels, "counted (no discovery, no /version)"]) + 2
    print(f"{'request':<{width}}" + "".join(f"{name[:26]:>28}" for name, _ in rows))
    for label in labels:
        print(f"{label:<{width}}" + "".join(f"{counts.get(label, 0.0):>28.2f}" for _, counts in rows))
    counted = [sum(v for k, v in counts.items() if k not in DISCOVERY) for _, counts in rows]
    discovery = [sum(v for k, v in counts.items() if k in DISCOVERY) for _, counts in rows]
    print(f"{'counted (no discovery, no /version)':<{width}}" + "".join(f"{n:>28.2f}" for n in counted))
    print(f"{'discovery + /version':<{width}}" + "".join(f"{n:>28.2f}" for n in discovery))
    print(
        f"{'all requests':<{width}}"
        + "".join(f"{a + b:>28.2f}" for a, b in zip(counted, discovery, strict=True))
    )
    for note in notes:
        print(note)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fleet_bench", description=__doc__)
    parser.add_argument("--agents", type=int, default=20)
    parser.add_argument("--version", default="1.36")
    parser.add_argument("--resync", type=float, default=30.0, help="agents' --resync in the idle phase")
    parser.add_argument("--watch-timeout", type=float, default=30.0, help="agents' --watch-timeout")
    parser.add_argument("--idle", type=float, default=120.0, help="seconds of the idle phase")
    parser.add_argument("--outage", type=float, default=5.0, help="seconds the emulator is down")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds counted after a phase's goal")
    parser.add_argument("--quick", action="store_true", help="4 agents, a short idle phase")
    args: Any = parser.parse_args(argv)
    if args.quick:
        args.agents, args.resync, args.watch_timeout, args.idle = 4, 10.0, 10.0, 30.0
    anyio.run(bench, args)


if __name__ == "__main__":
    main()
