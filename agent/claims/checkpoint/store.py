"""`CheckpointStore`: the entries in memory plus their durable copy, changes written by group commit."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import anyio
import anyio.to_thread

from agent.claims.checkpoint.commit import PeerWatch, _Action, _Stage, _Write, _write_group
from agent.claims.checkpoint.file import LoadOutcome, _close, _OpenFile, _read_file, _still_open
from agent.claims.checkpoint.format import ClaimEntry, EntryTexts
from agent.core.errors import AgentError


class _InFlight:
    """The write in progress: the changes it carries and the events its end sets."""

    __slots__ = ("covers", "done", "ended")

    def __init__(self, covers: int) -> None:
        self.covers = covers
        """The changes numbered up to this one are in the write (made before it started)."""
        self.done = anyio.Event()
        """Waited on by the calls whose change it carries."""
        self.ended = anyio.Event()
        """Waited on by the calls whose change came after it started (set first: the next write)."""


class CheckpointWriteError(AgentError):
    """The checkpoint could not be written; the previous file is intact."""


class CheckpointStore:
    """The entries in memory plus their durable copy; every change is on disk when its call returns.

    The store keeps the file it wrote or read last open (`_OpenFile`): appends go there, and an
    agent that shares the file (rolling update) need not read it again while it is unchanged.
    """

    def __init__(self, path: Path, boot_id: str, *, peers: PeerWatch | None = None) -> None:
        self.path = path
        self.boot_id = boot_id
        self._peers = peers
        self._entries: dict[str, ClaimEntry] = {}
        self._texts = EntryTexts()
        self._by_device: dict[str, dict[str, None]] = {}
        """Device name -> UIDs of the entries naming it: a share's peers without a scan of all entries."""
        self._changed: dict[str, None] = {}
        """UIDs changed since the last write took its changes: the records of the next append."""
        self._touched: set[str] = set()
        """UIDs changed in memory since `take_touched` (what the gauges and listener must look at)."""
        self._compact = True
        """The next write writes a new snapshot (the file is not known to hold memory's entries)."""
        self._in_flight: _InFlight | None = None
        """The write in progress (one at a time), or None."""
        self._changes = 0
        self._written = 0
        self._synced = 0
        self._sync_wanted = 0
        """The last change waited for durably: a write that carries it fsyncs."""
        self._file: _OpenFile | None = None
        self._befores: list[_Action] = []
        self._afters: list[_Action] = []
        self._stages: list[_Stage] = []

    def load(self, entries: Mapping[str, ClaimEntry]) -> None:
        """Replace the in-memory entries (at start, or after reading the file another agent wrote)."""
        self._replace_all(entries)
        self.close()
        self._compact = True

    def is_current(self) -> bool:
        """Whether the file is still the one this store wrote or read last, i.e. the entries in memory.

        A ``stat`` of a file just written, answered from the kernel's inode cache: cheaper than
        the worker-thread hop that reading and verifying the whole file would take.
        """
        return self._file is not None and _still_open(self.path, self._file)

    async def reload(self, now: float) -> LoadOutcome:
        """Read the file another agent may have written: its entries replace memory unless unusable.

        A corrupt file is moved aside (`load_checkpoint`) and memory kept: the caller decides.
        """
        previous, self._file = self._file, None
        if self._peers is not None:
            self._peers.forget()  # another agent wrote the file: it may be one that reads no journal
        outcome, file = await anyio.to_thread.run_sync(_read_file, self.path, now, previous)
        if outcome.problem is None:
            self._replace_all(outcome.data.entries if outcome.data is not None else {})
            self._file = file
            self._compact = file is None or file.shape.torn_tail
        else:
            _close(file)
            self._compact = True
        return outcome

    def close(self) -> None:
        """Let go of the file written last."""
        _close(self._file)
        self._file = None

    def get(self, uid: str) -> ClaimEntry | None:
        """The entry of a claim."""
        return self._entries.get(uid)

    def entries(self) -> dict[str, ClaimEntry]:
        """A copy of all entries."""
        return dict(self._entries)

    def holders(self, device: str) -> list[ClaimEntry]:
        """The entries that name `device`."""
        return [self._entries[uid] for uid in self._by_device.get(device, ())]

    async def put(
        self, entry: ClaimEntry, *, durable: bool = True, before: Callable[[], None] | None = None
    ) -> None:
        """Add or replace an entry; raises `CheckpointWriteError` (memory reverted).

        `before` (blocking) runs in the worker thread of the write that first carries the entry,
        before that write; what it raises is raised here, and the entry is then left out
        of the file and memory (the other changes of the group are written).

        `durable=False` skips the fsyncs: the agent uses it for PrepareStarted, which guards state
        that a power loss erases anyway (CDI specs on a tmpfs, device preparation); a killed agent
        still finds the entry (the page cache survives it).
        """
        previous = self._entries.get(entry.uid)
        self._set(entry.uid, entry)
        if before is None:
            await self._commit(lambda: self._restore(entry.uid, previous), durable=durable)
            return
        # The action runs in the hop of the write that carries the entry (one hop for both).
        pending = _Action(entry.uid, previous, before)
        self._befores.append(pending)
        try:
            await self._commit(lambda: self._restore(entry.uid, previous), durable=durable)
        except CheckpointWriteError:
            if pending.error is None:
                raise  # else the action's failure is the one to report
        finally:
            if pending in self._befores:  # cancelled before a write took it: none may carry the entry
                self._befores.remove(pending)
                self._restore(entry.uid, previous)
        if pending.error is not None:
            raise pending.error

    async def put_staged(self, started: ClaimEntry, complete: Callable[[], ClaimEntry]) -> ClaimEntry:
        """Put `started`, run `complete` (blocking) and put what it returns, durably: one write, one hop.

        In the worker thread of one group commit: the record of `started` is written (not fsynced),
        then `complete` runs, then the entry it returns is written and fsynced. Returns that entry.
        On any failure, what `complete` raised or `CheckpointWriteError`, `started` stays in memory
        (and maybe on disk): the caller rolls back what `complete` may have done and removes it.
        """
        self._set(started.uid, started)
        stage = _Stage(started.uid, complete)
        self._stages.append(stage)
        try:
            await self._commit(lambda: None)
        finally:
            if stage in self._stages:  # cancelled before a write took it
                self._stages.remove(stage)
        if stage.error is not None:
            raise stage.error
        if stage.result is None:  # cancelled before a write took it
            raise CheckpointWriteError(f"the checkpoint write of claim {started.uid} was cancelled")
        return stage.result

    async def remove(
        self,
        uid: str,
        *,
        before: Callable[[], None] | None = None,
        after: Callable[[], None] | None = None,
    ) -> None:
        """Drop an entry durably (no-op when absent); raises `CheckpointWriteError` (memory reverted).

        `before` (blocking) runs in the worker thread of the write that first carries the removal,
        before that write; what it raises is raised here and the entry is kept (memory and file).
        `after` (blocking) runs in the worker thread of the durable write that drops the entry,
        once that write is on disk; what it raises is raised here (the entry stays dropped).
        """
        if uid not in self._entries:
            return
        previous = self._entries[uid]
        self._set(uid, None)
        first = _Action(uid, previous, before) if before is not None else None
        last = _Action(uid, previous, after) if after is not None else None
        if first is not None:
            self._befores.append(first)
        if last is not None:
            self._afters.append(last)
        try:
            await self._commit(lambda: self._restore(uid, previous))
        except CheckpointWriteError:
            if first is None or first.error is None:
                raise  # else the action's failure is the one to report
        finally:
            if first is not None and first in self._befores:  # cancelled before a write took it
                self._befores.remove(first)
                self._restore(uid, previous)
            if last is not None and last in self._afters:  # failed or cancelled before a write took it
                self._afters.remove(last)
        for action in (first, last):
            if action is not None and action.error is not None:
                raise action.error

    async def flush(self) -> None:
        """Write the current entries as a new snapshot (at start: records the new boot ID)."""
        self._compact = True
        await self._commit(lambda: None)

    def _restore(self, uid: str, previous: ClaimEntry | None) -> None:
        self._set(uid, previous)

    def take_touched(self) -> set[str]:
        """The UIDs whose entry changed (or was restored) since the last call."""
        touched, self._touched = self._touched, set()
        return touched

    def _set(self, uid: str, entry: ClaimEntry | None) -> None:
        """Add, replace (`entry`) or drop (None) the entry of `uid`, keeping the device index."""
        self._changed[uid] = None
        self._touched.add(uid)
        old = self._entries.get(uid)
        if old is not None:
            for device in old.devices:
                uids = self._by_device.get(device.device)
                if uids is not None:
                    uids.pop(uid, None)
                    if not uids:
                        del self._by_device[device.device]
        if entry is None:
            self._entries.pop(uid, None)
            return
        self._entries[uid] = entry
        for device in entry.devices:
            self._by_device.setdefault(device.device, {})[uid] = None

    def _replace_all(self, entries: Mapping[str, ClaimEntry]) -> None:
        self._touched.update(self._entries)  # the entries that go are changes too
        self._entries, self._by_device = {}, {}
        for uid, entry in entries.items():
            self._set(uid, entry)
        self._changed = {}

    async def _commit(self, undo: Callable[[], None], *, durable: bool = True) -> None:
        """Return once a write that started after this change is done (durable: and fsynced).

        Group commit: one write at a time carries every change made before it started. A write
        closes when it starts: a change made while it is in flight waits for it to end, then for
        the next one, which the first such caller to run starts with all changes made until then.
        A write's end wakes all its waiters at once, each answered as soon as its own change is
        on disk, never behind a later write nor behind the other waiters one by one.
        """
        self._changes += 1
        mine = self._changes
        if durable:
            self._sync_wanted = mine
        try:
            while (self._synced if durable else self._written) < mine:
                write = self._in_flight
                if write is None:
                    await self._write(durable)
                elif mine <= write.covers:
                    await write.done.wait()  # it carries our change (durably, when we wait so)
                else:
                    await write.ended.wait()  # made while it is in flight: for the next write
        except OSError as error:
            # No await between the failed write and the undo: no other write sees our change.
            undo()
            raise self._write_error(error) from error

    async def _write(self, durable: bool) -> None:
        """Write every change made until now, and the actions and stages waiting; raises OSError."""
        covered = self._changes
        write = self._in_flight = _InFlight(covered)
        try:
            befores, self._befores = self._befores, []
            stages, self._stages = self._stages, []
            # Durable when any change it carries is waited for durably: a write without fsync
            # would leave that waiter for the next write, and a stream of such writes starve it.
            durable = durable or bool(stages) or self._sync_wanted > self._synced
            afters: list[_Action] = []
            if durable:  # an after waits for its change to be durable
                afters, self._afters = self._afters, []
            job = _Write(
                self.boot_id,
                dict(self._entries),
                self._changed,
                befores,
                afters,
                stages,
                durable,
                self._compact,
                self._peers,
            )
            self._changed = {}
            failed: OSError | None = None
            try:
                self._file, failed = await anyio.to_thread.run_sync(
                    _write_group, self.path, job, self._file, self._texts
                )
            except BaseException:
                # Not written: cancelled before a worker thread took it (waiting for one), or a bug.
                # What it took goes back for the next write: the records (written twice is no
                # harm), the actions that did not run, the stages; a new snapshot to be sure.
                self._changed = {**dict.fromkeys(job.changed), **self._changed}
                self._befores[:0] = [before for before in befores if not before.done]
                self._stages[:0] = [s for s in stages if s.result is None and s.error is None]
                self._compact = True
                raise
            finally:
                for before in befores:
                    if before.error is not None:
                        self._restore(before.uid, before.previous)
                for stage in stages:
                    if failed is not None and stage.error is None:  # started stays; the owner rolls back
                        stage.error = self._write_error(failed)
                    elif stage.result is not None:
                        self._set(stage.uid, stage.result)
                        self._changed.pop(stage.uid, None)  # on disk already
                # The write failed: the afters wait for the next durable write (their owners retry).
                self._afters.extend(a for a in afters if not a.done)
            if failed is not None:
                self._compact = True  # memory is undone below: only a new snapshot is sure to match
                raise failed
            self._compact = False
            self._written = covered
            if durable:
                self._synced = covered
        finally:
            self._in_flight = None
            # Its waiters run on the loop's next pass (a failed write's owner has undone its change
            # by then): first those for the next write, whose first starts it; then the others,
            # answered while it is written.
            write.ended.set()
            write.done.set()

    def _write_error(self, error: OSError) -> CheckpointWriteError:
        return CheckpointWriteError(
            f"cannot write the checkpoint {self.path}: {error.strerror or error}; "
            "free space on the node's disk (the previous checkpoint is intact)"
        )
