"""The Kubernetes semver library, version 1 (with the ``normalize`` argument)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agent.core.cel.errors import _RuntimeError
from agent.core.cel.library.arguments import _s, _want
from agent.core.cel.values import CelSemver


def _normalized(text: str) -> str:
    text = text.removeprefix("v")
    parts = text.split(".", 2)
    for i, part in enumerate(parts):
        if len(part) > 1:
            stripped = part.lstrip("0")
            parts[i] = stripped if stripped[:1].isdigit() else "0" + stripped
    if len(parts) < 3:
        if any(c in parts[-1] for c in "+-"):
            raise _RuntimeError("short version cannot contain PreRelease/Build meta data")
        parts += ["0"] * (3 - len(parts))
    return ".".join(parts)


def _semver_error(text: str) -> str:
    core = text.split("+", maxsplit=1)[0].split("-", maxsplit=1)[0]
    if core.count(".") != 2:
        return "No Major.Minor.Patch elements found"
    return f"Invalid semantic version: {text}"


def _semver(member: bool, text: Any, *normalize: Any) -> CelSemver:
    value = _s(text)
    if normalize:
        _want(isinstance(normalize[0], bool))
        if normalize[0]:
            value = _normalized(value)
    try:
        return CelSemver(value)
    except ValueError:
        raise _RuntimeError(_semver_error(value)) from None


def _is_semver(member: bool, text: Any, *normalize: Any) -> bool:
    try:
        _semver(member, text, *normalize)
    except _RuntimeError:
        return False
    return True


def _part(index: int) -> Callable[..., int]:
    def part(member: bool, v: Any) -> int:
        _want(isinstance(v, CelSemver))
        return int(v.parts[index])

    return part
