"""Crash-safe file replacement: write a temp file, fsync it, rename it over the target, fsync the dir.

After a crash at any point the target holds either the old or the new content, never a mix. A
failed write (disk full) removes its temp file and leaves the target untouched. These functions
block: call them through `anyio.to_thread.run_sync`.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

TEMP_SUFFIX = ".tmp"


def write_all(fd: int, data: bytes) -> None:
    """Write every byte of `data` (a seam for tests that simulate a full disk)."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def temp_path_for(path: Path) -> Path:
    """A unique hidden temp name next to `path` (hidden and ``.tmp`` so CDI runtimes skip it)."""
    return path.with_name(f".{path.name}.{secrets.token_hex(4)}{TEMP_SUFFIX}")


def fsync_dir(directory: Path) -> None:
    """Make a rename or unlink in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, *, mode: int = 0o644, durable: bool = True) -> None:
    """Replace `path` with `data` atomically; raises OSError (temp file removed).

    `durable=False` skips both fsyncs: the replacement is still atomic for a killed process
    (the page cache survives it), but a power loss may bring back the old content.
    """
    temp = temp_path_for(path)
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        try:
            write_all(fd, data)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def remove_durably(path: Path) -> bool:
    """Delete `path` and fsync its directory; False when it did not exist."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    fsync_dir(path.parent)
    return True


def quarantine(path: Path, stamp: int) -> Path:
    """Rename `path` to a ``.corrupt-<stamp>`` name no earlier quarantine holds (the first free ``-<n>``)."""
    base = f"{path.name}.corrupt-{stamp}"
    aside = path.with_name(base)
    n = 0
    while aside.exists() or aside.is_symlink():
        n += 1
        aside = path.with_name(f"{base}-{n}")
    path.replace(aside)
    return aside
