"""The benchmark's timeline (`benchmarks.prepare_timeline`) still finds every function it marks.

It wraps agent functions by name; a rename in the agent would otherwise only show as a benchmark
that fails to start. Nothing is wrapped here: the names are resolved, and one `Timeline` is fed
marks by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

from agent.claims.checkpoint import file as checkpoint
from benchmarks import prepare_timeline


def test_every_point_and_handler_resolves() -> None:
    names = [(p[0], p[1]) for p in prepare_timeline.POINTS] + list(prepare_timeline.HANDLERS)
    for module, dotted in names:
        owner, attribute = prepare_timeline._resolve(module, dotted)
        assert callable(getattr(owner, attribute)), f"{module}.{dotted}"
    # Replaced by name too: the checkpoint's append and the `os` module it calls fsync through.
    assert callable(checkpoint._append) and callable(vars(checkpoint)["os"].fsync)


def test_rows_of_calls_that_ran_alone_become_the_table(tmp_path: Path) -> None:
    output = tmp_path / "timeline.json"
    timeline = prepare_timeline.Timeline(output)
    for _ in range(prepare_timeline.DUMP_EVERY):
        timeline.begin()
        timeline.mark("in the claim state")
        timeline.mark("record fsynced (durable)")
        timeline.end("prepare")
    timeline.begin()  # two calls at once: neither is a row
    timeline.begin()
    timeline.mark("in the claim state")
    timeline.end("prepare")
    timeline.end("prepare")
    table = json.loads(output.read_text())
    rows = table["prepare, 1 claim"]
    assert rows["rows"] == prepare_timeline.DUMP_EVERY
    assert list(rows["marks_ms"]) == ["in the claim state", "record fsynced (durable)", "handler returned"]
    assert "record fsynced (durable)" in prepare_timeline.format_table(output)
