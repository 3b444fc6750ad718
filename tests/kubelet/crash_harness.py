"""Crash-test harness: runs one DeviceState operation in its own process and SIGKILLs it at a step.

    python tests/kubelet/crash_harness.py ROOT OP [--crash-at STEP | --crash-in-group-write K]
        [--boot-id ID] [UID ...]

ROOT holds ``claims.json`` (the API server's claims, a list of v1 dicts), ``backend.json`` (the
file-backed fake backend's prepared devices; ``--planned``: a backend that plans, whose prepare
runs in the checkpoint's hop), ``state/`` and ``cdi/``. ``--sharing`` uses the real
fake backend instead (profile nvidia-a100-8x, consumable-shares=memory, driver gpu.nvidia.com):
its time-slicing record and MPS daemons live under ``state/``. OP is ``start`` (start-up
reconcile only), ``prepare`` or ``unprepare`` (after start) of the given claim UIDs. When a claim
reaches STEP the process kills itself with SIGKILL, as ``kill -9`` would; otherwise it prints the
results as JSON on stdout. With ``--crash-in-group-write K`` it kills itself in the middle of the
K-th checkpoint write that carries the changes of more than one claim (a group commit): half of
its journal records appended, the last one cut short.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

# Run as a script: make the repository importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


class CrashAt:
    """The test hook: kill this process the first time any claim reaches `step`."""

    def __init__(self, step: str) -> None:
        self.step = step

    def reached(self, step: Any, claim_uid: str) -> None:
        if step.value == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class CrashInGroupWrite:
    """Wraps the checkpoint's journal append: SIGKILL mid-append at the K-th group commit."""

    def __init__(self, k: int, append: Any) -> None:
        self.k = k
        self.append = append

    def __call__(self, path: Path, records: bytes, file: Any, durable: bool) -> Any:
        if records.count(b"\n") > 1:
            self.k -= 1
            if self.k == 0:
                os.write(file.fd, records[: len(records) // 2])
                os.kill(os.getpid(), signal.SIGKILL)
        return self.append(path, records, file, durable)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from agent.claims.state.machine import DeviceState
    from agent.core.backend import ClaimRef
    from tests.kubelet.fakes import DRIVER, NODE, FakeClaimSource, FileBackend, PlanningFileBackend

    if args.crash_in_group_write:
        import agent.claims.checkpoint.file

        vars(agent.claims.checkpoint.file)["_append"] = CrashInGroupWrite(
            args.crash_in_group_write, agent.claims.checkpoint.file._append
        )
    root = Path(args.root)
    claims = json.loads((root / "claims.json").read_text())
    backend_class = PlanningFileBackend if args.planned else FileBackend
    driver, backend = DRIVER, backend_class(root / "backend.json")
    if args.sharing:
        from agent.core.backend import BackendOptions
        from backends.fake import create_backend

        options = BackendOptions(
            NODE,
            settings={"profile": "nvidia-a100-8x", "control": "off", "consumable-shares": "memory"},
            state_dir=root / "state",
        )
        (shared,) = create_backend(options)
        driver, backend = shared.driver_name, shared  # type: ignore[assignment]
    state = DeviceState(
        driver,
        backend,
        FakeClaimSource(claims),
        node_name=NODE,
        cdi_root=root / "cdi",
        state_dir=root / "state",
        boot_id=args.boot_id,
        hooks=CrashAt(args.crash_at) if args.crash_at else None,
    )
    await state.start()
    by_uid = {c["metadata"]["uid"]: c["metadata"] for c in claims}
    refs = [ClaimRef(by_uid[u]["namespace"], by_uid[u]["name"], u) for u in args.uids]
    if args.op == "prepare":
        results = await state.prepare(refs)
        return {
            uid: {"error": r.error, "devices": [d.device for d in r.devices]} for uid, r in results.items()
        }
    if args.op == "unprepare":
        return dict(await state.unprepare(refs))
    return {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root")
    parser.add_argument("op", choices=("start", "prepare", "unprepare"))
    parser.add_argument("uids", nargs="*")
    parser.add_argument("--crash-at", default="")
    parser.add_argument("--crash-in-group-write", type=int, default=0)
    parser.add_argument("--boot-id", default="boot-1")
    parser.add_argument("--sharing", action="store_true")
    parser.add_argument("--planned", action="store_true", help="a backend that plans (one-hop prepare)")
    args = parser.parse_args()

    import anyio

    print(json.dumps(anyio.run(run, args)))


if __name__ == "__main__":
    main()
