"""Where the wall time of a prepare and an unprepare goes inside the agent: a timeline of marks.

``python -m benchmarks.kubelet_e2e_bench --timeline`` starts the agent through this module
(``python -m benchmarks.prepare_timeline AGENT-ARGS...``): it wraps the functions in `POINTS` with
``time.perf_counter()`` marks, then runs ``agent.cli.main``; the agent's code is not changed.
Each kubelet call that is alone in the agent (no other call in flight from its start to its end)
is one row: the time of each mark from the handler's start. Every `DUMP_EVERY` rows the median
of each mark per kind of call (a prepare with a claim, an unprepare with a claim, an empty call)
goes to the JSON file named by ``DRA_BENCH_TIMELINE``, which the benchmark prints as a table of
steps: each step is the time from the previous mark to its own.

What a step measures is named by its mark: "answer arrived" is the wait for the API server;
"in the worker thread" the thread hand-off; "fsync" the disk; the others are Python and system
calls of ours. Marks cost ~1 µs each (about 20 per call).
"""

from __future__ import annotations

import functools
import gc
import importlib
import json
import os
import statistics
import sys
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

DUMP_EVERY = 100
ROWS_KEPT = 400
"""The medians are over the last `ROWS_KEPT` rows of each kind (the sequential phase's end)."""

# (module, attribute, mark at entry or None, mark at return or None). A mark already set in the
# row is kept: the first time counts.
POINTS: tuple[tuple[str, str, str | None, str | None], ...] = (
    ("agent.kubelet.draservice", "validate_claims", None, "request decoded and checked"),
    ("agent.claims.state.machine", "DeviceState.prepare", "in the claim state", "claim state done"),
    ("agent.claims.state.machine", "DeviceState.unprepare", "in the claim state", "claim state done"),
    ("agent.kube.client", "KubeClient.get_resource_claim", "claim GET asked", "claim GET parsed"),
    ("aiohttp.client_reqrep", "ClientRequest.send", None, "GET request sent"),
    ("aiohttp.client_proto", "ResponseHandler.data_received", "GET answer arrived", None),
    (
        "agent.claims.checkpoint.store",
        "CheckpointStore.put_staged",
        "claim checked, entry and plan made",
        "back on the loop",
    ),
    (
        "agent.claims.checkpoint.store",
        "CheckpointStore.remove",
        "entry looked up, plan made",
        "back on the loop",
    ),
    ("agent.claims.checkpoint.store", "_write_group", "in the worker thread", "worker thread done"),
    ("backends.fake.devicefile", "write_device_file", "device file asked", "device file written"),
    ("backends.fake.devicefile", "remove_device_file", "device file asked", "device file removed"),
    ("agent.claims.cdi", "CdiSpecWriter.write_claim_spec", "CDI spec asked", "CDI spec written"),
    ("agent.claims.cdi", "CdiSpecWriter.remove_claim_spec", "CDI spec asked", "CDI spec removed"),
    ("grpclib.server", "Stream.send_message", "result and answer built", "answer sent"),
    # The claim status write (a server-side apply) runs in its own task: a mark in the table
    # would mean it ran inside a kubelet call.
    ("agent.kube.claimstatus", "ClaimStatusWriter.write", "claim status write started", None),
)
HANDLERS = (
    ("agent.kubelet.draservice", "_DRAPlugin._prepare"),
    ("agent.kubelet.draservice", "_DRAPlugin._unprepare"),
)


class Timeline:
    """The marks of the call in flight, and the rows of the calls that ran alone."""

    def __init__(self, output: Path) -> None:
        self.output = output
        self._row: dict[str, float] | None = None
        self._start = 0.0
        self._alone = True
        self._in_flight = 0
        self._rows: dict[str, list[dict[str, float]]] = {}
        self._gcs: dict[str, list[dict[str, float]]] = {}
        self._count = 0
        self._lock = threading.Lock()  # marks come from the worker thread too
        self._gc_started = 0.0
        self._gc: dict[str, float] = {}  # the call in flight's garbage collections: count, seconds

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        with self._lock:
            row = self._row
            if row is None:
                return
            row.setdefault(name, now - self._start)

    def on_gc(self, phase: str, info: dict[str, int]) -> None:
        """A `gc.callbacks` hook: the collections during the call in flight (any thread's)."""
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._row is not None:
            self._gc["collections"] = self._gc.get("collections", 0) + 1
            self._gc["seconds"] = self._gc.get("seconds", 0.0) + time.perf_counter() - self._gc_started

    def begin(self) -> None:
        with self._lock:
            self._in_flight += 1
            if self._in_flight > 1:
                self._alone = False
                return
            self._row, self._start, self._alone, self._gc = {}, time.perf_counter(), True, {}

    def end(self, method: str) -> None:
        now = time.perf_counter()
        with self._lock:
            self._in_flight -= 1
            row, self._row = self._row, None
            if row is None or not self._alone or self._in_flight:
                return
            row["handler returned"] = now - self._start
            claims = "in the claim state" in row
            kind = f"{method}, 1 claim" if claims else "empty call"
            self._rows.setdefault(kind, []).append(row)
            self._gcs.setdefault(kind, []).append(dict(self._gc))
            self._count += 1
            if self._count % DUMP_EVERY == 0:
                self._dump()

    def _dump(self) -> None:
        table = {}
        for kind, rows in self._rows.items():
            recent = rows[-ROWS_KEPT:]
            seen: dict[str, int] = {}
            for row in recent:
                for name in row:
                    seen[name] = seen.get(name, 0) + 1
            # A mark in fewer than half the calls is another connection's or task's: left out.
            names = [name for name, count in seen.items() if 2 * count > len(recent)]
            medians = {n: statistics.median(r[n] for r in recent if n in r) * 1000 for n in names}
            gcs = self._gcs[kind][-ROWS_KEPT:]
            table[kind] = {
                "rows": len(recent),
                "calls_with_gc": sum(1 for g in gcs if g),
                "gc_ms_per_call": sum(g.get("seconds", 0.0) for g in gcs) * 1000 / len(gcs),
                "marks_ms": dict(sorted(medians.items(), key=lambda kv: kv[1])),
                "rare_marks": {n: c for n, c in sorted(seen.items()) if n not in medians},
            }
        temp = self.output.with_suffix(".tmp")
        temp.write_text(json.dumps(table))
        temp.replace(self.output)  # the benchmark may read it at any time


def _resolve(module: str, dotted: str) -> tuple[Any, str]:
    owner: Any = importlib.import_module(module)
    *path, attribute = dotted.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, attribute


def _wrap_point(timeline: Timeline, owner: Any, attribute: str, entry: str | None, exit: str | None) -> None:
    original = getattr(owner, attribute)
    if hasattr(original, "__code__") and original.__code__.co_flags & 0x80:  # a coroutine function

        @functools.wraps(original)
        async def traced_async(*args: Any, **kwargs: Any) -> Any:
            if entry:
                timeline.mark(entry)
            result = await original(*args, **kwargs)
            if exit:
                timeline.mark(exit)
            return result

        setattr(owner, attribute, traced_async)
        return

    @functools.wraps(original)
    def traced(*args: Any, **kwargs: Any) -> Any:
        if entry:
            timeline.mark(entry)
        result = original(*args, **kwargs)
        if exit:
            timeline.mark(exit)
        return result

    setattr(owner, attribute, traced)


def _wrap_handler(timeline: Timeline, owner: Any, attribute: str) -> None:
    original: Callable[..., Any] = getattr(owner, attribute)
    method = "prepare" if "unprepare" not in attribute else "unprepare"

    @functools.wraps(original)
    async def traced(*args: Any, **kwargs: Any) -> Any:
        timeline.begin()
        try:
            return await original(*args, **kwargs)
        finally:
            timeline.end(method)

    setattr(owner, attribute, traced)


def _wrap_checkpoint_writes(timeline: Timeline) -> None:
    """The checkpoint's appends, told apart by durability, and its own fsyncs (not the CDI's)."""
    checkpoint = importlib.import_module("agent.claims.checkpoint.file")
    append = checkpoint._append

    @functools.wraps(append)
    def traced_append(path: Path, records: bytes, file: Any, durable: bool) -> Any:
        which = "durable" if durable else "not durable"
        timeline.mark(f"record encoded ({which})")
        result = append(path, records, file, durable)
        timeline.mark(f"record appended ({which})")
        return result

    def traced_fsync(fd: int) -> None:
        timeline.mark("record written (durable)")
        os.fsync(fd)
        timeline.mark("record fsynced (durable)")

    # A copy of `os` for the checkpoint module alone: the other modules' fsyncs stay unmarked.
    checkpoint_os = types.ModuleType("os")
    checkpoint_os.__dict__.update(os.__dict__)
    setattr(checkpoint_os, "fsync", traced_fsync)  # noqa: B010 - set on purpose, for mypy
    setattr(checkpoint, "_append", traced_append)  # noqa: B010
    setattr(checkpoint, "os", checkpoint_os)  # noqa: B010


def install(output: Path) -> Timeline:
    """Wrap every point; call before the agent builds its servers."""
    timeline = Timeline(output)
    gc.callbacks.append(timeline.on_gc)
    for module, dotted, entry, exit in POINTS:
        owner, attribute = _resolve(module, dotted)
        _wrap_point(timeline, owner, attribute, entry, exit)
    _wrap_checkpoint_writes(timeline)
    for module, dotted in HANDLERS:
        owner, attribute = _resolve(module, dotted)
        _wrap_handler(timeline, owner, attribute)
    return timeline


def format_table(path: Path) -> str:
    """The timeline file as a table: each step's median time from the previous mark."""
    table = json.loads(path.read_text())
    lines = []
    for kind, data in table.items():
        lines.append(
            f"{kind} (median of the last {data['rows']} calls that ran alone; a garbage collection "
            f"in {data['calls_with_gc']} of them, {data['gc_ms_per_call']:.3f} ms per call on average)"
        )
        lines.append(f"  {'step: ... until':<44}{'ms':>7}{'from start':>12}")
        previous = 0.0
        for name, at in data["marks_ms"].items():
            lines.append(f"  {name:<44}{at - previous:7.3f}{at:12.3f}")
            previous = at
        rare = data.get("rare_marks") or {}
        lines.append(
            "  marks in fewer than half of them: "
            + (", ".join(f"{name} ({count})" for name, count in rare.items()) or "none")
        )
    return "\n".join(lines)


def main() -> None:
    output = os.environ.get("DRA_BENCH_TIMELINE")
    if not output:
        raise SystemExit("set DRA_BENCH_TIMELINE to the file the timeline goes to")
    install(Path(output))
    from agent.cli import main as agent_main

    sys.argv[0] = "dra-agent"
    agent_main()


if __name__ == "__main__":
    main()
