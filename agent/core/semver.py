"""Semantic versions as the API server accepts them, and normalization of vendor version strings.

The API server validates `version` attributes against semver 2.0.0 (no leading zeros, exactly
MAJOR.MINOR.PATCH). Vendor tools print versions such as ``550.54.15``, ``6.8.0.5``, ``12.4``,
``030.010`` or the empty string; each must become a valid version or be refused clearly.
"""

from __future__ import annotations

import re

from agent.core.errors import VersionError

MAX_VERSION_LENGTH = 64

_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)
_LEADING = re.compile(r"^\s*[vV]?(\d+(?:\.\d+)*)(.*)$")
_IDENT_BAD = re.compile(r"[^0-9A-Za-z-]+")


def is_semver(value: str) -> bool:
    """Return True when `value` is a semver 2.0.0 string the API server accepts."""
    return len(value) <= MAX_VERSION_LENGTH and _SEMVER.match(value) is not None


def normalize_version(value: str) -> str:
    """Turn a vendor version string into valid semver, or raise `VersionError`.

    Rules: a leading ``v`` is dropped; numeric parts lose their leading zeros; one or two parts
    are padded with ``.0``; a fourth and later numeric part goes into build metadata
    (``6.8.0.5`` -> ``6.8.0+5``) so that nothing is lost and ordering of the first three holds;
    a non-numeric tail becomes a pre-release (``535.54.03-beta`` -> ``535.54.3-beta``).
    """
    raw = value.strip()
    if not raw:
        raise VersionError(value, "it is empty")
    if is_semver(raw):
        return raw
    match = _LEADING.match(raw)
    if match is None:
        raise VersionError(value, "it does not start with a number")
    numbers = [str(int(part)) for part in match.group(1).split(".")]
    tail = match.group(2)
    core = [*numbers[:3], *(["0"] * (3 - len(numbers[:3])))]
    build = numbers[3:]
    prerelease = ""
    if tail:
        head, _, build_tail = tail.partition("+")
        ident = _IDENT_BAD.sub(".", head.lstrip("-._ ")).strip(".")
        parts = [p for p in ident.split(".") if p]
        prerelease = ".".join(str(int(p)) if p.isdigit() else p for p in parts)
        if build_tail:
            build.extend(p for p in _IDENT_BAD.sub(".", build_tail).split(".") if p)
    result = ".".join(core)
    if prerelease:
        result += "-" + prerelease
    if build:
        result += "+" + ".".join(build)
    if not is_semver(result):
        raise VersionError(value, f"the normalized form {result!r} is still not valid semver")
    return result
