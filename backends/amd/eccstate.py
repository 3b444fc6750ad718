"""The uncorrectable ECC counts the AMD backend last read, kept across agent restarts.

amdsmi counts ECC errors since boot, so the backend takes its first reading as a baseline:
errors from before the agent started were already acted on. An agent restarted in the same boot
(crash, upgrade) would thereby hide errors that happened while it was down; with the counts of
the previous process (same ``boot_id``) as the baseline, those errors are reported as new.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from agent.core.logs import log_fields
from backends.amd.health import EccCounts

log = logging.getLogger("agent.backends.amd")

ECC_STATE_FILE = "amd-ecc-counts.json"
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def boot_id(path: Path = BOOT_ID) -> str:
    """This boot's id ("" when unknown: then nothing is carried over)."""
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def load_ecc_counts(path: Path, boot: str) -> EccCounts:
    """The counts saved during boot `boot`, or none (another boot, no file, a damaged file)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        log.warning("ignoring the saved ECC counts", extra=log_fields(path=str(path), error=str(error)))
        return {}
    if not boot or not isinstance(data, dict) or data.get("boot_id") != boot:
        return {}
    gpus = data.get("gpus")
    if not isinstance(gpus, dict):
        return {}
    return {
        str(gpu): {str(b): c for b, c in blocks.items() if isinstance(c, int)}
        for gpu, blocks in gpus.items()
        if isinstance(blocks, dict)
    }


def save_ecc_counts(path: Path, boot: str, counts: EccCounts) -> None:
    """Write the counts atomically (a crash leaves the old file or the new one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.tmp")
    temp.write_text(json.dumps({"boot_id": boot, "gpus": counts}, sort_keys=True))
    os.replace(temp, path)
