"""The rolling-update file lock and the atomic file helpers."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import anyio
import pytest

from agent.claims.filelock import FileLock, FileLockError
from agent.core.atomicfile import remove_durably, write_atomic


async def test_lock_excludes_other_holders_and_tasks(tmp_path: Path) -> None:
    path = tmp_path / "serialize.lock"
    mine, theirs = FileLock(path, poll_interval=0.001), FileLock(path, poll_interval=0.001)
    order: list[str] = []

    async def take(lock: FileLock, name: str) -> None:
        async with lock:
            order.append(f"{name}+")
            await anyio.sleep(0.01)
            order.append(f"{name}-")

    async with anyio.create_task_group() as tg:
        tg.start_soon(take, mine, "a")
        tg.start_soon(take, mine, "b")  # same object: the in-process lock orders them
        tg.start_soon(take, theirs, "c")  # another open file: flock orders them
    assert [order[i][0] for i in range(0, 6, 2)] == [order[i][0] for i in range(1, 6, 2)]
    mine.close()
    theirs.close()
    mine.close()


async def test_cancelled_waiter_leaves_lock_usable(tmp_path: Path) -> None:
    path = tmp_path / "serialize.lock"
    holder, waiter = FileLock(path), FileLock(path, poll_interval=0.001)
    await holder.acquire()
    with anyio.move_on_after(0.02):
        await waiter.acquire()
    holder.release()
    with anyio.fail_after(5):
        async with waiter:
            pass
    holder.close()
    waiter.close()


async def test_missing_directory_is_created_on_a_fresh_node(tmp_path: Path) -> None:
    """Issue 12: with POD_UID the lock was opened before the plugin directory existed."""
    lock = FileLock(tmp_path / "plugins" / "gpu.example.com" / "serialize.lock")
    with anyio.fail_after(5):
        async with lock:
            assert lock.path.exists()
    lock.close()


async def test_unusable_directory_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "plugins").write_text("a regular file where the directory should be")
    lock = FileLock(tmp_path / "plugins" / "serialize.lock")
    with pytest.raises(FileLockError, match="plugin data directory exists"):
        await lock.acquire()
    # The in-process lock was released: a later try fails the same way instead of hanging.
    with anyio.fail_after(5), pytest.raises(FileLockError):
        await lock.acquire()


async def test_try_acquire_does_not_wait(tmp_path: Path) -> None:
    holder, other = FileLock(tmp_path / "publish.lock"), FileLock(tmp_path / "publish.lock")
    assert await holder.try_acquire()
    assert not await other.try_acquire()
    holder.release()
    assert await other.try_acquire()
    other.release()
    holder.close()
    other.close()


async def test_flock_failure_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lock = FileLock(tmp_path / "serialize.lock")

    def broken(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr("agent.claims.filelock.fcntl.flock", broken)
    with pytest.raises(FileLockError, match="No locks available"):
        await lock.acquire()


def test_write_atomic_and_remove(tmp_path: Path) -> None:
    path = tmp_path / "f"
    write_atomic(path, b"one")
    write_atomic(path, b"two", durable=False)
    assert path.read_bytes() == b"two"
    assert remove_durably(path)
    assert not remove_durably(path)


def test_short_writes_are_completed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.write

    def one_byte(fd: int, data: bytes | memoryview) -> int:
        return real(fd, bytes(data[:1]))

    monkeypatch.setattr(os, "write", one_byte)
    write_atomic(tmp_path / "f", b"hello")
    monkeypatch.undo()
    assert (tmp_path / "f").read_bytes() == b"hello"


async def test_lock_taken_by_one_task_may_be_released_by_another(tmp_path: Path) -> None:
    path = tmp_path / "serialize.lock"
    lock, other = FileLock(path), FileLock(path, poll_interval=0.001)
    taken = anyio.Event()

    async def take() -> None:
        await lock.acquire()
        taken.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(take)
        await taken.wait()
    lock.release()  # this task did not take it
    with anyio.fail_after(5):
        async with other:
            pass
    lock.close()
    other.close()
