"""Reading the files the agent parses (checkpoint, taint policy, kubeconfig, fake profiles) within bounds.

A file is read only up to its size limit, must be UTF-8, and its JSON or YAML may nest only so
deep: a 60 MB file, binary garbage or ``[[[[...`` then fails with `BoundedFileError` naming the
file and the limit, never with a ``MemoryError``, ``UnicodeDecodeError`` or ``RecursionError``
deep inside a parser. The depth is checked before the real parse (JSON: a scan of the brackets
outside strings; YAML: the parser's event stream, which does not recurse), so the recursive
parts never see a deep document. Blocking: call through `anyio.to_thread.run_sync` on the loop.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from agent.core.errors import AgentError

KIB = 1024
MIB = 1024 * KIB
MAX_DEPTH = 64
"""Nesting the agent's own formats never come near (a kubeconfig nests 4 deep, the checkpoint 6)."""

# JSON strings and runs of anything but brackets and quotes: what is left are the brackets.
_NOT_NESTING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[^\[\]{}"]+')
_INNERMOST_PAIR = re.compile(r"\[\]|\{\}")


class BoundedFileError(AgentError):
    """A file cannot be used: unreadable, over its size limit, not UTF-8, nested too deep or not parsable.

    `problem` says what the file is (``larger than 1 MiB``), `accepted` what the agent accepts
    (``a YAML file of at most 1 MiB``), `reason` is a short label (``unreadable``, ``too_large``,
    ``not_utf8``, ``too_deep``, ``invalid``) for metrics.
    """

    def __init__(self, path: Path | str, problem: str, accepted: str, reason: str) -> None:
        self.path = str(path)
        self.problem = problem
        self.accepted = accepted
        self.reason = reason
        super().__init__(f"file {self.path}: {problem}; expected {accepted}")

    @property
    def detail(self) -> str:
        """What is accepted and what the file is, for a `ConfigError` naming the flag and the path."""
        return f"{self.accepted}; it is {self.problem}"


def describe_size(size: int) -> str:
    """``512 bytes``, ``64 KiB``, ``1.5 MiB``."""
    if size < KIB:
        return f"{size} bytes"
    if size < MIB:
        return f"{size / KIB:g} KiB"
    return f"{size / MIB:.4g} MiB"


def read_bytes(path: Path | str, *, max_bytes: int, what: str = "file") -> bytes:
    """At most `max_bytes` of `path`; raises `BoundedFileError` when unreadable or larger.

    `what` names the expected content in messages, without an article (``YAML taint policy``).
    """
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as error:
        raise BoundedFileError(
            path, f"unreadable ({error.strerror or error})", f"a readable {what}", "unreadable"
        ) from None
    if len(data) > max_bytes:
        size = describe_size(max_bytes)
        raise BoundedFileError(path, f"larger than {size}", f"a {what} of at most {size}", "too_large")
    return data


def decode_utf8(path: Path | str, data: bytes, *, what: str = "file") -> str:
    """`data` as text; raises `BoundedFileError` naming the first bad byte's offset."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise BoundedFileError(
            path,
            f"not UTF-8 text (byte {error.start} is 0x{data[error.start]:02x})",
            f"a {what} in UTF-8",
            "not_utf8",
        ) from None


def read_text(path: Path | str, *, max_bytes: int, what: str = "file") -> str:
    """`read_bytes` then `decode_utf8`."""
    return decode_utf8(path, read_bytes(path, max_bytes=max_bytes, what=what), what=what)


def _too_deep(path: Path | str, max_depth: int, what: str) -> BoundedFileError:
    return BoundedFileError(
        path,
        f"nested more than {max_depth} levels deep",
        f"a {what} nested at most {max_depth} levels",
        "too_deep",
    )


def json_depth_exceeds(text: str, max_depth: int) -> bool:
    """Whether the brackets outside strings of JSON `text` nest deeper than `max_depth`.

    Drops one level of innermost ``[]``/``{}`` pairs per pass (at C speed, a checkpoint nests 6
    deep); brackets that stop pairing make invalid JSON, whose open prefix is then counted.
    """
    brackets = _NOT_NESTING.sub("", text)
    for level in range(max_depth + 1):
        if not brackets:
            return False
        inner = _INNERMOST_PAIR.sub("", brackets)
        if len(inner) == len(brackets):
            depth = level
            for char in brackets:  # only for invalid JSON
                if char in "[{":
                    depth += 1
                    if depth > max_depth:
                        return True
                elif char in "]}":
                    depth -= 1
            return False
        brackets = inner
    return True


def parse_json(text: str, path: Path | str, *, max_depth: int = MAX_DEPTH, what: str = "JSON file") -> Any:
    """Parse JSON `text` read from `path`; raises `BoundedFileError` (too deep or invalid)."""
    if json_depth_exceeds(text, max_depth):
        raise _too_deep(path, max_depth, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise BoundedFileError(path, f"not valid JSON ({error})", f"a {what}", "invalid") from None


def _safe_loader() -> Any:
    """libyaml's safe loader when built in: several times faster than the pure-Python one."""
    import yaml  # imported when used: ~12 ms at start, and only the fake profiles and files given need it

    return getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def yaml_depth_exceeds(text: str, max_depth: int) -> bool:
    """Whether the collections of YAML `text` nest deeper than `max_depth` (raises `yaml.YAMLError`)."""
    import yaml

    depth = 0
    for event in yaml.parse(text, Loader=_safe_loader()):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > max_depth:
                return True
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
    return False


def parse_yaml(text: str, path: Path | str, *, max_depth: int = MAX_DEPTH, what: str = "YAML file") -> Any:
    """Parse one YAML document of `text` read from `path` with the safe loader.

    Raises `BoundedFileError` (too deep, or invalid YAML with the line of the problem).
    """
    import yaml

    try:
        if yaml_depth_exceeds(text, max_depth):
            raise _too_deep(path, max_depth, what)
        return yaml.load(text, Loader=_safe_loader())
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise BoundedFileError(path, f"not valid YAML{where} ({problem})", f"a {what}", "invalid") from None


def load_yaml(path: Path | str, *, max_bytes: int, what: str = "YAML file") -> Any:
    """Read and parse a YAML file within the bounds; raises `BoundedFileError`."""
    return parse_yaml(read_text(path, max_bytes=max_bytes, what=what), path, what=what)
