"""``dra-agent fake ...``: inject faults into a running agent's fake backend through its control socket.

    dra-agent fake inject --device gpu-3 --condition xid --value 79 [--driver D] [--socket PATH]
    dra-agent fake recover --device gpu-3 [--condition xid]
    dra-agent fake lose --device gpu-3
    dra-agent fake list [-o table|json]
    dra-agent fake scenario FILE|NAME     # NAME: a shipped scenario such as xid-storm

The socket defaults to the one the agent uses for its node (``--node-name``, else ``$NODE_NAME``,
else ``demo-node``): ``/tmp/dra-agent-fake-<node>.sock``; ``$DRA_AGENT_FAKE_SOCKET`` overrides
it. Errors print one line and exit 1 (usage errors exit 2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import anyio

from backends.fake import default_control_path
from backends.fake.control import request
from backends.fake.scenario import load_scenario, scenario_to_data

SEVERITIES = ("info", "warning", "critical")
KINDS = ("event", "state")


def _socket(args: argparse.Namespace) -> str:
    if args.socket:
        return str(args.socket)
    node = args.node_name or os.environ.get("NODE_NAME", "demo-node")
    return os.environ.get("DRA_AGENT_FAKE_SOCKET") or default_control_path(node)


def _call(args: argparse.Namespace, payload: dict[str, Any], wait: float | None = 10.0) -> Any:
    async def go() -> Any:
        return await request(_socket(args), payload, wait=wait)

    return anyio.run(go)


def _print_affected(verb: str, affected: list[str]) -> int:
    print(f"{verb}: {', '.join(affected) if affected else 'nothing to do'}")
    return 0


def _inject(args: argparse.Namespace) -> int:
    payload = {
        "op": "inject",
        "device": args.device,
        "condition": args.condition,
        "value": args.value or "",
        "driver": args.driver,
        "severity": args.severity,
        "kind": args.kind,
        "message": args.message or "",
    }
    return _print_affected("injected", _call(args, payload))


def _recover(args: argparse.Namespace) -> int:
    payload = {"op": "recover", "device": args.device, "condition": args.condition, "driver": args.driver}
    return _print_affected("recovered", _call(args, payload))


def _lose(args: argparse.Namespace) -> int:
    return _print_affected("lost", _call(args, {"op": "lose", "device": args.device, "driver": args.driver}))


def _list(args: argparse.Namespace) -> int:
    rows = _call(args, {"op": "list"})
    if args.output == "json":
        json.dump(rows, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    table = [("DRIVER", "DEVICE", "STATE", "FAULTS")]
    for row in rows:
        faults = ", ".join(
            f"{f['condition']}{'=' + f['value'] if f['value'] else ''}({f['severity']}, x{f['count']})"
            for f in row["faults"]
        )
        table.append((row["driver"], row["device"], "lost" if row["lost"] else "present", faults or "-"))
    widths = [max(len(r[i]) for r in table) for i in range(4)]
    for r in table:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    return 0


def _scenario(args: argparse.Namespace) -> int:
    scenario = load_scenario(args.file)  # validate here: errors name the local file
    result = _call(args, {"op": "scenario", "scenario": scenario_to_data(scenario)}, wait=None)
    print(f"scenario {args.file}: {result['actions']} actions, {result['events']} events")
    for error in result["errors"]:
        print(f"  failed: {error}", file=sys.stderr)
    return 1 if result["errors"] else 0


def register(subparsers: Any) -> None:
    """Add the ``fake`` command to the ``dra-agent`` parser (entry point ``dra_agent.commands``)."""
    fake = subparsers.add_parser("fake", help="inject faults into a running agent's fake backend")
    commands = fake.add_subparsers(dest="fake_command", required=True)

    def command(
        name: str, help_text: str, handler: Callable[[argparse.Namespace], int]
    ) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = commands.add_parser(name, help=help_text)
        parser.add_argument("--socket", help="control socket (default /tmp/dra-agent-fake-<node>.sock)")
        parser.add_argument("--node-name", help="the agent's node name, for the default socket [NODE_NAME]")
        parser.set_defaults(handler=handler)
        return parser

    def device_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--device", required=True, help="device name, e.g. gpu-3")
        parser.add_argument("--driver", help="driver name, when several drivers have the device")

    inject = command("inject", "report a health condition on a device", _inject)
    device_args(inject)
    inject.add_argument("--condition", required=True, help="xid, gpu-lost, ecc-uncorrectable, gpu-reset, ...")
    inject.add_argument("--value", help="condition value, e.g. the XID or the ECC block")
    inject.add_argument("--severity", choices=SEVERITIES, help="override the condition's default severity")
    inject.add_argument("--kind", choices=KINDS, help="override the condition's default kind")
    inject.add_argument("--message", help="free text shown in the device's health message")

    recover = command("recover", "clear a condition (or all) of a device; a lost GPU comes back", _recover)
    device_args(recover)
    recover.add_argument("--condition", help="only this condition (default: all)")

    lose = command("lose", "make a device's GPU fall off the bus", _lose)
    device_args(lose)

    listing = command("list", "list the fake devices and their injected faults", _list)
    listing.add_argument("-o", "--output", choices=("table", "json"), default="table")

    scenario = command("scenario", "run a scenario file in the agent and wait for its end", _scenario)
    scenario.add_argument("file", help="scenario YAML (see backends/fake/scenarios/)")
