"""A child process for the dynamic-MIG crash tests: an NVIDIA backend on a fake A100 whose MIG
state outlives the process (a JSON file stands for the driver), killed with SIGKILL at one step.

``python -m tests.nvidia.dynmig_crash_child HARDWARE JOURNAL_DIR KILL_AT ACTION...``: KILL_AT is
``-``, ``before:<nvml call>``, ``after:<nvml call>`` or ``journal:<step>`` (right after the journal
records that step); ACTIONs (``prepare``, ``unprepare``) run after start and discovery, and one
JSON line reports the MIG devices and the journal after each.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import anyio

from agent.core.backend import BackendOptions, ClaimRef
from backends.nvidia import NvidiaBackend
from backends.nvidia.migjournal import MigEntry, MigJournal
from tests.fakes.libnvml import FakeMig, MigLibNvml, dynamic_gpu

DEVICE = "gpu-0-mig-3g40gb-9-4"
CLAIM = ClaimRef("default", "claim-1", "uid-1")


def main(hardware: Path, journal_dir: Path, kill_at: str, actions: list[str]) -> None:
    root = journal_dir.parent
    (root / "dev").mkdir(parents=True, exist_ok=True)
    for node in ("nvidiactl", "nvidia0"):
        (root / "dev" / node).touch()
    fake = MigLibNvml(
        [dynamic_gpu("NVIDIA A100-SXM4-80GB", 0)], proc_root=root / "proc", dev_root=root / "dev"
    )
    gpu = fake.gpus[0]
    if hardware.exists():
        gpu.migs = [FakeMig(**item) for item in json.loads(hardware.read_text())]

    def persist() -> None:
        hardware.write_text(json.dumps([dataclasses.asdict(m) for m in gpu.migs]))

    def hook(phase: str, call: str) -> None:
        if phase == "after":
            persist()
        if kill_at == f"{phase}:{call}":
            os.kill(os.getpid(), signal.SIGKILL)

    fake.mig_hook = hook
    put = MigJournal.put

    def put_then_maybe_die(self: MigJournal, entry: MigEntry) -> None:
        put(self, entry)
        if kill_at == f"journal:{entry.step}":
            os.kill(os.getpid(), signal.SIGKILL)

    MigJournal.put = put_then_maybe_die  # type: ignore[method-assign]
    backend = NvidiaBackend(
        BackendOptions(
            "node-1",
            None,
            {
                "cdi-mode": "own",
                "host-root": str(root / "host"),
                "dynamic-mig": "true",
                "dynamic-mig-dir": str(journal_dir),
            },
        ),
        nvml_module=fake.module,
        sysfs_root=root / "sys",
        proc_root=root / "proc",
        dev_root=root / "dev",
    )

    def report(step: str, extra: dict[str, Any]) -> None:
        persist()
        journal = MigJournal(journal_dir / "dynamic-mig-gpu.nvidia.com.json")
        journal.load()
        line = {
            "step": step,
            "migs": [dataclasses.asdict(m) for m in gpu.migs],
            "journal": [e.step for e in journal.entries()],
        }
        print(json.dumps({**line, **extra}), flush=True)

    async def run() -> None:
        await backend.start()
        await backend.discover()
        report("start", {})
        for action in actions:
            if action == "prepare":
                edits = await backend.prepare(DEVICE, CLAIM)
                caps = sorted(n.path for n in edits.device_nodes if "nvidia-caps" in n.path)
                report(action, {"caps": caps})
            else:
                await backend.unprepare(DEVICE, CLAIM)
                report(action, {})
        await backend.stop()

    anyio.run(run)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4:])
