"""One group commit, in its worker thread: the changes' actions, their records, the stages.

Also `PeerWatch`, asked by each commit: whether another agent shares the file now (a rolling
update's other pod), which makes every write a snapshot.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from agent.claims.checkpoint.file import _OpenFile, _write_changes
from agent.claims.checkpoint.format import ClaimEntry, EntryTexts
from agent.core.logs import log_fields

log = logging.getLogger("agent.claims.checkpoint")


PEER_CHECK_SECONDS = 1.0
"""How long the answer of the peer check is kept (it runs in the write's worker thread)."""


class PeerWatch:
    """Whether another agent shares the checkpoint now (a rolling update's other pod), asked at most
    once every `PEER_CHECK_SECONDS`.

    While one does, every write is a whole snapshot: an agent of a release before the journal
    reads only that, and one that finds journal records moves the file aside and writes what its
    memory holds, losing the claims the other pod prepared. Used by one write at a time.
    """

    def __init__(self, check: Callable[[], bool], clock: Callable[[], float] = time.monotonic) -> None:
        self._check = check
        self._clock = clock
        self._answer = True
        self._asked: float | None = None

    def forget(self) -> None:
        """Ask again at the next write: another agent just wrote the file."""
        self._asked = None

    def present(self) -> bool:
        """The check's answer, asked again once it is older than `PEER_CHECK_SECONDS` (blocking)."""
        now = self._clock()
        if self._asked is None or now - self._asked >= PEER_CHECK_SECONDS:
            try:
                self._answer = self._check()
            except OSError as error:  # unknown: shared, the safe answer
                log.warning(
                    "cannot tell whether another agent shares the checkpoint",
                    extra=log_fields(error=str(error)),
                )
                self._answer = True
            self._asked = now
        return self._answer


class _Action:
    """A blocking action tied to the change of `uid`, run in the worker thread of a checkpoint write.

    Before: run first by the write that first carries the change (its failure leaves the change
    out). After: run by the durable write that carries the change, once it is on disk.
    """

    def __init__(self, uid: str, previous: ClaimEntry | None, action: Callable[[], None]) -> None:
        self.uid = uid
        self.previous = previous
        self.action = action
        self.done = False
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            self.action()
        except Exception as error:  # the owner of the change gets it; the others' changes go on
            self.error = error
        self.done = True


class _Stage:
    """A change made in two records within one write: `started` first, then what `complete` returns.

    `complete` (blocking) runs in the write's worker thread once `started` is written.
    """

    def __init__(self, uid: str, complete: Callable[[], ClaimEntry]) -> None:
        self.uid = uid
        self.complete = complete
        self.result: ClaimEntry | None = None
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            self.result = self.complete()
        except Exception as error:  # the owner of the change gets it; the others' changes go on
            self.error = error


@dataclass(frozen=True)
class _Write:
    """One group commit: the entries at its start, the UIDs changed since the last write, the actions."""

    boot_id: str
    entries: dict[str, ClaimEntry]
    changed: Collection[str]
    befores: list[_Action]
    afters: list[_Action]
    stages: list[_Stage]
    durable: bool
    compact: bool
    """Write a new snapshot, whatever the journal's size (at start, after a failed write)."""
    peers: PeerWatch | None = None
    """Asked in the worker thread: while another agent shares the file, snapshots only."""


def _write_group(
    path: Path, job: _Write, file: _OpenFile | None, texts: EntryTexts
) -> tuple[_OpenFile | None, OSError | None]:
    """Run the befores of a group, write its changes less those whose before failed, run the afters.

    The stages' first records go with the changes (not fsynced), then their `complete` runs and
    what it returns is written (durably when the group is). Returns the file now open and the
    write's failure: none of the group's changes is then sure to be on disk (a stage's first
    record may be), and no after has run.
    """
    entries = job.entries
    for before in job.befores:
        before.run()
        if before.error is not None:
            if before.previous is None:
                entries.pop(before.uid, None)
            else:
                entries[before.uid] = before.previous
    shared = job.peers is not None and job.peers.present()
    try:
        file = _write_changes(
            path,
            job.boot_id,
            entries=entries,
            changed=job.changed,
            file=file,
            durable=job.durable and not job.stages,
            compact=job.compact or shared,
            texts=texts,
        )
        if job.stages:
            for stage in job.stages:
                stage.run()
                if stage.result is not None:
                    entries[stage.uid] = stage.result
            done = [stage.uid for stage in job.stages if stage.result is not None]
            file = _write_changes(
                path,
                job.boot_id,
                entries=entries,
                changed=done,
                file=file,
                durable=job.durable,
                compact=shared,
                texts=texts,
            )
    except OSError as error:
        return file, error
    undone = {before.uid for before in job.befores if before.error is not None}
    for after in job.afters:
        if after.uid in undone:  # its change was left out: nothing to follow it
            after.done = True
        else:
            after.run()
    return file, None
