"""The ``dra-agent explain claim`` subcommand: arguments, sources and output (text, YAML, JSON).

``dra-agent explain claim NAMESPACE/NAME`` reads the API server (``--kube``, ``--node-name``);
``dra-agent explain claim --file claim.yaml --slices slices.yaml`` works offline against what
``dra-agent run --kube none`` prints. Bad input is one line and a non-zero exit.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import anyio

from agent.config import OPTIONS, AgentConfig, build_config
from agent.core.errors import ConfigError
from agent.core.logs import setup_logging

if TYPE_CHECKING:
    from agent.explain.evaluate import Report
    from agent.explain.sources import Inputs

# The evaluation (agent.core.cel and RE2) is imported when explain runs, not by every
# `dra-agent run`, whose parser this module helps build.

CONFIG_FIELDS = ("node_name", "kube_mode", "kubeconfig", "state_dir", "cdi_root", "log_level", "log_format")
"""The `dra-agent run` options explain takes (`agent.cli` adds them as flags)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The explain-specific arguments; the handler is `run`."""
    parser.add_argument("what", choices=("claim",), help="what to explain")
    parser.add_argument("target", nargs="?", help="NAMESPACE/NAME of the ResourceClaim (API mode)")
    parser.add_argument(
        "--file", type=Path, help="offline: the ResourceClaim (and its DeviceClasses) as YAML"
    )
    parser.add_argument("--slices", type=Path, help="offline: the slices 'dra-agent run --kube none' printed")
    parser.add_argument("-o", "--output", choices=("text", "yaml", "json"), default="text")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Explain the claim and print the report; raises `ConfigError` or `ExplainError` (one line)."""
    config = build_config({o.field: getattr(args, o.field, None) for o in OPTIONS})
    setup_logging(config.log_format, "warning" if config.log_level == "info" else config.log_level)
    report = anyio.run(_report, args, config)
    print_report(report, args.output, out or sys.stdout)
    return 0


async def _report(args: argparse.Namespace, config: AgentConfig) -> Report:
    from agent.explain.sources import from_api, from_files, node_of
    from agent.kube.client import KubeClient

    node = config.node_name
    if args.file is not None or args.slices is not None:
        if args.file is None or args.slices is None or args.target:
            raise ConfigError(
                "--file", str(args.file), "--file CLAIM.yaml together with --slices FILE, no NAMESPACE/NAME"
            )
        inputs = from_files(args.file, args.slices)
        if getattr(args, "node_name", None) is None:  # no --node-name: the node the slices name
            node = node_of(inputs.slices) or node
    else:
        namespace, sep, name = (args.target or "").partition("/")
        if not sep or not namespace or not name:
            raise ConfigError("claim", args.target or "", "NAMESPACE/NAME, or --file and --slices offline")
        if config.kube_mode == "none":
            raise ConfigError(
                "--kube",
                "none",
                "an API server (auto, in-cluster, kubeconfig); offline use --file and --slices",
            )
        kube = await KubeClient.connect(config.kube_mode, config.kubeconfig)
        try:
            inputs = await from_api(kube, namespace, name, node)
        finally:
            await kube.close()
    return _evaluate(inputs, node, config)


def _evaluate(inputs: Inputs, node: str, config: AgentConfig) -> Report:
    from agent.explain.evaluate import ExplainError, allocated_node, claim_key, explain
    from agent.explain.sources import placement
    from agent.explain.taintrules import apply_rules

    claim = inputs.claim
    elsewhere = allocated_node(claim)
    if elsewhere is not None and elsewhere != node:
        raise ExplainError(
            f"claim {claim_key(claim)} is allocated on node {elsewhere}, not on this node {node}: "
            f"run explain there (or with --node-name {elsewhere})"
        )
    return explain(
        claim,
        node=node,
        classes=inputs.classes,
        slices=apply_rules(inputs.slices, inputs.taint_rules),
        other_claims=inputs.other_claims,
        placement=placement(claim, node, config.state_dir, config.cdi_root),
        notes=inputs.notes,
    )


def print_report(report: Report, fmt: str, out: TextIO) -> None:
    """Print `report` as text, YAML or JSON."""
    if fmt == "json":
        json.dump(report.to_dict(), out, indent=2)
        out.write("\n")
        return
    if fmt == "yaml":
        import yaml  # imported when used: ~12 ms at the start of every dra-agent command

        yaml.safe_dump(report.to_dict(), out, sort_keys=False)
        return
    state = "allocated" if report.allocated else "not allocated"
    out.write(f"claim {report.claim} on node {report.node}: {state}\n")
    for request in report.requests:
        amount = f"{request.count}" if request.mode == "ExactCount" else "all"
        out.write(f"request {request.name} (class {request.device_class}, {amount}): {request.summary}\n")
        for device in request.devices:
            if device.matched:
                out.write(f"  matched   {device.device}\n")
            else:
                out.write(f"  excluded  {device.device}: {'; '.join(device.reasons)}\n")
    for constraint in report.constraints:
        out.write(f"{constraint}\n")
    for note in report.notes:
        out.write(f"note: {note}\n")
    if report.placement is not None:
        p = report.placement
        out.write(
            f"on this node: {', '.join(p.devices)}; prepared: {p.prepared}; "
            f"CDI spec: {', '.join(p.cdi_spec) or 'none'}; pods: {', '.join(p.pods) or 'none'}\n"
        )
