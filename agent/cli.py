"""The ``dra-agent`` command: run, devices, version, and backend-contributed subcommands.

Every `run` option is a flag and an environment variable (see `agent.config.OPTIONS`). A bad
option prints one line naming the flag, the value and what is accepted, and exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TextIO

import anyio

from agent import __version__
from agent.config import OPTIONS, AgentConfig, build_config
from agent.core.errors import AgentError, ConfigError
from agent.core.logs import setup_logging
from agent.core.model import Device
from agent.core.vendorcall import exit_if_vendor_calls_hung
from agent.explain import command as explain_command

if TYPE_CHECKING:
    from agent.health.taints import TaintPolicy

COMMAND_GROUP = "dra_agent.commands"
# Our own commands: with one of them first, the parser skips the entry-point scan of every
# installed distribution (3-6 ms here, more with more packages installed).
BUILTIN_COMMANDS = frozenset({"run", "devices", "slices", "demo", "explain", "version"})
EXIT_USAGE = 2
EXIT_FAILURE = 1

log = logging.getLogger("agent.cli")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(
            EXIT_USAGE, f"dra-agent: error: {message} (see 'dra-agent {self.prog.split()[-1]} --help')\n"
        )


def _add_config_flags(parser: argparse.ArgumentParser, only: Sequence[str] | None = None) -> None:
    for option in OPTIONS:
        if only is not None and option.field not in only:
            continue
        kwargs: dict[str, Any] = {
            "dest": option.field,
            "default": None,
            "metavar": option.field.upper(),
            "help": f"{option.help} [env {option.env}]",
        }
        if option.field == "backends":
            kwargs["action"] = "append"
        parser.add_argument(option.flag, **kwargs)


def build_parser(contributed: bool = True) -> argparse.ArgumentParser:
    """The argument parser; with `contributed`, also the subcommands backends add by entry point."""
    parser = _Parser(prog="dra-agent", description="Multi-vendor Kubernetes DRA node agent.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    run = sub.add_parser("run", help="run the agent")
    _add_config_flags(run)
    devices = sub.add_parser("devices", help="list the devices the backends discover")
    _add_config_flags(devices, only=("backends", "node_name", "log_level", "log_format"))
    devices.add_argument("-o", "--output", choices=("table", "yaml", "json"), default="table")
    slices = sub.add_parser("slices", help="print the ResourceSlices the agent would publish, then exit")
    _add_config_flags(
        slices, only=("backends", "node_name", "log_level", "log_format", "print_for", "taint_policy")
    )
    demo = sub.add_parser("demo", help="run the agent on the fake backend against an in-process API emulator")
    demo.add_argument("--profile", default="mixed", help="fake backend profile (default mixed)")
    demo.add_argument(
        "--kube-version",
        default=None,
        help="Kubernetes version the emulator plays (1.34; 1.36 with --sharing)",
    )
    demo.add_argument(
        "--sharing", action="store_true", help="also show two MPS claims sharing one GPU (consumable shares)"
    )
    demo.add_argument("--taint-hold", type=float, default=2.0, help="seconds before a taint is lifted")
    demo.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    explain = sub.add_parser("explain", help="why a ResourceClaim gets (or not) this node's devices")
    _add_config_flags(explain, only=explain_command.CONFIG_FIELDS)
    explain_command.add_arguments(explain)
    sub.add_parser("version", help="print the version")
    if contributed:
        from importlib.metadata import entry_points

        for ep in entry_points(group=COMMAND_GROUP):
            register = ep.load()
            register(sub)
    return parser


def device_rows(devices: Sequence[Device]) -> list[dict[str, Any]]:
    """Devices as plain data for yaml/json output."""
    from agent.kube.slices import attribute_to_api

    return [
        {
            "driver": d.driver,
            "name": d.name,
            "health": d.health.status.value,
            "attributes": {k: attribute_to_api(v) for k, v in sorted(d.attributes.items())},
            "capacity": {k: q.canonical() for k, q in sorted(d.capacity.items())},
        }
        for d in devices
    ]


def print_devices(devices: Sequence[Device], fmt: str, out: TextIO) -> None:
    """Print devices as a table, YAML or JSON."""
    if fmt == "json":
        json.dump(device_rows(devices), out, indent=2)
        out.write("\n")
        return
    if fmt == "yaml":
        import yaml

        yaml.safe_dump(device_rows(devices), out, sort_keys=False)
        return
    rows = [("DRIVER", "DEVICE", "HEALTH", "PRODUCT", "MEMORY", "TYPE")]
    for d in devices:
        memory = d.capacity.get("memory")
        rows.append(
            (
                d.driver,
                d.name,
                d.health.status.value,
                str(d.attributes.get("productName", d.product)),
                memory.canonical() if memory else "-",
                str(d.attributes.get("type", "-")),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        out.write("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() + "\n")
    if len(rows) == 1:
        out.write("no devices found\n")


async def _list_devices(config: AgentConfig) -> list[Device]:
    from agent.app import create_backends

    found: list[Device] = []
    for backend in create_backends(config):
        await backend.start()
        try:
            found.extend(await backend.discover())
        finally:
            await backend.stop()
    return found


async def _print_slices(config: AgentConfig, policy: TaintPolicy, out: TextIO) -> None:
    """``dra-agent slices``: discover each configured backend's devices once and print its pool."""
    from agent.app import create_backends
    from agent.kube.printer import pool_document

    for backend in create_backends(config):
        await backend.start()
        try:
            devices = list(await backend.discover())
        finally:
            await backend.stop()
        out.write(pool_document(config.node_name, config.print_for, backend.driver_name, devices, policy))
    out.flush()


def config_from_args(args: argparse.Namespace) -> AgentConfig:
    """Build the config from parsed flags and the environment."""
    return build_config({o.field: getattr(args, o.field, None) for o in OPTIONS})


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dra-agent`` console script."""
    code = _main(argv)
    exit_if_vendor_calls_hung(code)  # else the interpreter waits forever for a wedged driver call
    return code


def _main(argv: Sequence[str] | None) -> int:
    words = sys.argv[1:] if argv is None else argv
    parser = build_parser(contributed=not words or words[0] not in BUILTIN_COMMANDS)
    args = parser.parse_args(argv)
    try:
        if args.command == "version":
            print(f"dra-agent {__version__}")
            return 0
        if args.command == "devices":
            config = config_from_args(args)
            setup_logging(config.log_format, config.log_level)
            print_devices(anyio.run(_list_devices, config), args.output, sys.stdout)
            return 0
        if args.command == "slices":
            config = config_from_args(args)
            setup_logging(config.log_format, config.log_level)
            from agent.runner import load_policy

            anyio.run(_print_slices, config, load_policy(config.taint_policy), sys.stdout)
            return 0
        if args.command == "demo":
            setup_logging("keyvalue", args.log_level)
            from agent.demo import DemoOptions, run_demo

            options = DemoOptions(
                profile=args.profile,
                kube_version=args.kube_version or ("1.36" if args.sharing else "1.34"),
                hold_seconds=args.taint_hold,
                sharing=args.sharing,
            )
            anyio.run(run_demo, sys.stdout, options)
            return 0
        if args.command == "run":
            config = config_from_args(args)
            setup_logging(config.log_format, config.log_level)
            from agent.runner import run_agent

            anyio.run(run_agent, config)
            return 0
        handler = getattr(args, "handler", None)
        if handler is None:
            parser.error(f"unknown command {args.command}")
        result: int = handler(args)
        return result
    except AgentError as error:
        return _report(error)
    except BaseExceptionGroup as group:
        # A task group wraps what its body raised: a start-up error still gets its one line.
        first = _only_agent_error(group)
        if first is None:
            raise
        return _report(first)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`dra-agent explain ... | head`): not an error of ours. Point
        # stdout at /dev/null so the interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


def _report(error: AgentError) -> int:
    print(f"dra-agent: error: {error}", file=sys.stderr)
    return EXIT_USAGE if isinstance(error, ConfigError) else EXIT_FAILURE


def _only_agent_error(group: BaseExceptionGroup[BaseException]) -> AgentError | None:
    """The first `AgentError` of `group` when every exception in it is one, else None."""
    matched, rest = group.split(AgentError)
    if matched is None or rest is not None:
        return None
    leaf: BaseException = matched
    while isinstance(leaf, BaseExceptionGroup):
        leaf = leaf.exceptions[0]
    return leaf if isinstance(leaf, AgentError) else None


if __name__ == "__main__":
    sys.exit(main())
