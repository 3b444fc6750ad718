"""Rebuilding the checkpoint's entries from the CDI specs that survive it.

When the checkpoint is corrupt, the kubelet still believes its claims prepared. Every spec we
write carries its claim's completed entry (`agent.claims.cdi.RECORD_PREFIX`), so the entries
come back from the specs; the state then checks each against the API server as at any start.
A spec without a usable record (an older agent's, or damaged) cannot be rebuilt: it is reported
and left to the start-up reconcile, which removes specs no entry owns.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.claims.cdi import CdiSpecWriter
from agent.claims.checkpoint import ClaimEntry, ClaimPhase, entry_from_json
from agent.core.boundedfile import BoundedFileError


@dataclass(frozen=True)
class Rebuilt:
    """The entries rebuilt from spec files, and the specs that could not be used (UID -> why)."""

    entries: dict[str, ClaimEntry]
    unusable: dict[str, str]


def _entry_of(cdi: CdiSpecWriter, uid: str) -> ClaimEntry:
    """The completed entry a spec records; raises ValueError saying why there is none."""
    try:
        record = cdi.read_claim_record(uid)
    except BoundedFileError as error:
        raise ValueError(str(error)) from None
    if record is None:
        raise ValueError("the spec has no claim record (written by an older agent)")
    if not isinstance(record, dict) or record.get("uid") != uid:
        raise ValueError("the claim record does not name the claim of the spec file")
    try:
        entry = entry_from_json(uid, record)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise ValueError(f"malformed claim record: {error!r}") from None
    if entry.phase is not ClaimPhase.COMPLETED or not entry.devices:
        raise ValueError("the claim record is not a prepared claim")
    return entry


def rebuild_from_specs(cdi: CdiSpecWriter) -> Rebuilt:
    """Entries for every spec of `cdi`'s driver that records its claim (blocking)."""
    entries: dict[str, ClaimEntry] = {}
    unusable: dict[str, str] = {}
    for uid in sorted(cdi.claim_spec_uids()):
        try:
            entries[uid] = _entry_of(cdi, uid)
        except ValueError as error:
            unusable[uid] = str(error)
    return Rebuilt(entries, unusable)
