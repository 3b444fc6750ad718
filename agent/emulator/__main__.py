"""Run the emulator standalone (see `main`): ``python -m agent.emulator --port 8001 --kubeconfig kc``."""

from __future__ import annotations

import argparse
import logging
import signal

import anyio

from agent.emulator.registry import check_gate
from agent.emulator.resources import SUPPORTED_RELEASES
from agent.emulator.server import KubeApiEmulator

log = logging.getLogger("agent.emulator")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m agent.emulator", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--version", default="1.34", choices=[*SUPPORTED_RELEASES, "none"])
    parser.add_argument("--kubeconfig", help="write a kubeconfig for the emulator to this path")
    parser.add_argument(
        "--node", action="append", default=[], help="create a Node with this name (repeatable)"
    )
    parser.add_argument(
        "--feature-gate",
        action="append",
        default=[],
        metavar="NAME=true|false",
        help="set a simulated feature gate (repeatable), e.g. DRADeviceTaints=false",
    )
    return parser.parse_args(argv)


def _gates(items: list[str]) -> dict[str, bool]:
    gates: dict[str, bool] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or value.lower() not in ("true", "false"):
            raise SystemExit(f"--feature-gate {item!r}: expected NAME=true or NAME=false")
        gates[name] = value.lower() == "true"
    return gates


async def _serve(args: argparse.Namespace) -> None:
    async with KubeApiEmulator(
        version=args.version, feature_gates=_gates(args.feature_gate), host=args.host, port=args.port
    ) as emu:
        for node in args.node:
            emu.add_node(node)
        if args.kubeconfig:
            emu.write_kubeconfig(args.kubeconfig)
        print(f"Kubernetes API emulator {args.version} serving on {emu.url}", flush=True)
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                return


def main(argv: list[str] | None = None) -> None:
    """Entry point."""
    logging.basicConfig(level=logging.INFO)
    args = _parse(argv)
    for name, enabled in _gates(args.feature_gate).items():
        try:
            check_gate(args.version if args.version != "none" else "1.34", name, enabled)
        except ValueError as error:  # kube-apiserver refuses to start with a locked gate changed
            raise SystemExit(f"--feature-gate {name}: {error}") from None
    anyio.run(_serve, args)


if __name__ == "__main__":
    main()
