"""Group commit in a burst: each call is answered once the write that carries its change ends.

The checkpoint's writes are held in their worker thread (`HeldWrites`) until the test lets each
go, so what is answered while a later write is still in progress is seen without any timing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
import pytest

import agent.claims.checkpoint.commit
import agent.claims.checkpoint.store
from agent.claims.checkpoint.commit import _Write
from agent.claims.checkpoint.format import ClaimEntry, ClaimPhase, decode
from agent.claims.checkpoint.store import CheckpointStore


class HeldWrites:
    """Every checkpoint write waits in its worker thread, before touching the file, for `release`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.jobs: list[_Write] = []
        self._gates: list[threading.Event] = []
        self._started = anyio.Event()
        self._open = False
        real = agent.claims.checkpoint.commit._write_group

        def held(path: Path, job: _Write, *rest: Any) -> Any:
            gate = threading.Event()
            if self._open:
                gate.set()
            self.jobs.append(job)
            self._gates.append(gate)
            anyio.from_thread.run_sync(self._started.set)
            gate.wait()
            return real(path, job, *rest)

        monkeypatch.setattr(agent.claims.checkpoint.store, "_write_group", held)

    async def started(self, count: int) -> _Write:
        """The `count`-th write (from 1), once its worker thread holds it."""
        while len(self.jobs) < count:
            await self._started.wait()
            self._started = anyio.Event()
        return self.jobs[count - 1]

    def release(self, count: int) -> None:
        """Let the `count`-th write (from 1) go on."""
        self._gates[count - 1].set()

    def release_all(self) -> None:
        """Let every write go on, and those to come."""
        self._open = True
        for gate in self._gates:
            gate.set()


@contextmanager
def held_writes(monkeypatch: pytest.MonkeyPatch) -> Iterator[HeldWrites]:
    """`HeldWrites`, all let go on leaving (inside the task group of the calls: a failed
    assertion must not leave the group waiting for a worker thread that waits for the test)."""
    writes = HeldWrites(monkeypatch)
    try:
        yield writes
    finally:
        writes.release_all()


def entry(uid: str, phase: ClaimPhase = ClaimPhase.COMPLETED) -> ClaimEntry:
    return ClaimEntry(uid, "ns", f"claim-{uid}", phase)


async def test_a_call_is_answered_when_the_write_carrying_its_change_ends_not_after_a_later_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A burst's calls mix PrepareStarted (written, not fsynced) and PrepareCompleted (fsynced).

    The write after the first carries both kinds: it is fsynced, and its durable call is answered
    as it ends, while the next write (a later arrival's) is still held. Before, a write led by a
    PrepareStarted went without fsync and its PrepareCompleted calls waited for a later write.
    """
    path = tmp_path / "checkpoint.json"
    store = CheckpointStore(path, "boot-1")
    answered: list[str] = []

    async def put(uid: str, *, durable: bool = True) -> None:
        phase = ClaimPhase.COMPLETED if durable else ClaimPhase.STARTED
        await store.put(entry(uid, phase), durable=durable)
        answered.append(uid)

    async with anyio.create_task_group() as tg:
        with held_writes(monkeypatch) as writes:
            tg.start_soon(put, "x")
            await writes.started(1)
            # While the first write is in progress: a claim's PrepareStarted, another's PrepareCompleted.
            tg.start_soon(lambda: put("started", durable=False))
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(put, "completed")
            await anyio.wait_all_tasks_blocked()
            writes.release(1)

            second = await writes.started(2)
            assert set(second.changed) == {"started", "completed"}
            assert second.durable  # it carries a change waited for durably
            tg.start_soon(put, "later")  # arrives while the second write is in progress
            await anyio.wait_all_tasks_blocked()
            writes.release(2)

            third = await writes.started(3)
            assert set(third.changed) == {"later"}
            await anyio.wait_all_tasks_blocked()
            # The third write is held: what the second carried is answered already, the rest waits.
            assert answered == ["x", "started", "completed"]
            writes.release(3)
    assert answered == ["x", "started", "completed", "later"]
    assert set(decode(path.read_bytes()).entries) == {"x", "started", "completed", "later"}


async def test_the_calls_of_a_write_are_answered_together_as_it_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When a write ends, all the calls whose changes it carries go on in one pass of the event
    loop, while the next write (of a call that came meanwhile) is written.

    Before, they went on one per pass (a lock handed from one waiter to the next) and the next
    write started after the last of them: in a burst of 100, every hand-over waited for the
    loop to serve everything else once, and the answers trickled out behind one another.
    """
    store = CheckpointStore(tmp_path / "checkpoint.json", "boot-1")
    passes = 0
    answered_at: dict[str, int] = {}
    counting = True

    async def count_passes() -> None:
        nonlocal passes
        while counting:
            passes += 1
            await anyio.lowlevel.checkpoint()  # once per pass of the loop

    async def put(uid: str) -> None:
        await store.put(entry(uid))
        answered_at[uid] = passes

    group = [f"a{i}" for i in range(10)]
    async with anyio.create_task_group() as tg:
        with held_writes(monkeypatch) as writes:
            tg.start_soon(put, "x")
            await writes.started(1)
            for uid in group:
                tg.start_soon(put, uid)
            await anyio.wait_all_tasks_blocked()
            writes.release(1)

            second = await writes.started(2)
            assert set(second.changed) == set(group)
            tg.start_soon(put, "later")
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(count_passes)
            writes.release(2)
            while not set(group) <= set(answered_at):
                await anyio.lowlevel.checkpoint()
            third = await writes.started(3)
            counting = False
            assert set(third.changed) == {"later"}
            assert "later" not in answered_at
            answered = [answered_at[uid] for uid in group]
            assert max(answered) - min(answered) <= 1
            writes.release(3)
    assert set(answered_at) == {"x", *group, "later"}


async def test_a_write_cancelled_while_waiting_for_a_thread_gives_back_what_it_took(tmp_path: Path) -> None:
    """In a burst the worker threads can all be busy: a call that leads a write and is cancelled
    (the kubelet's deadline) while the write waits for one must not take the other calls' changes
    and actions with it; its own change is undone."""
    path = tmp_path / "checkpoint.json"
    store = CheckpointStore(path, "boot-1")
    await store.flush()
    limiter = anyio.to_thread.current_default_thread_limiter()
    tokens = limiter.total_tokens
    busy = threading.Event()
    ran: list[str] = []
    first = anyio.CancelScope()

    async def put(uid: str) -> None:
        await store.put(entry(uid), before=lambda: ran.append(uid))

    async def cancelled_put(uid: str) -> None:
        with first:
            await put(uid)

    limiter.total_tokens = 1
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: anyio.to_thread.run_sync(busy.wait))  # the only worker thread, busy
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(cancelled_put, "a")  # leads a write, which waits for a thread
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(put, "b")  # waits for that write to end
            await anyio.wait_all_tasks_blocked()
            first.cancel()
            await anyio.wait_all_tasks_blocked()
            busy.set()
    finally:
        busy.set()
        limiter.total_tokens = tokens
    assert ran == ["b"]
    assert set(decode(path.read_bytes()).entries) == {"b"}
    assert set(store.entries()) == {"b"}
