"""Version normalization: every vendor version string becomes valid semver or a clear error."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.core.errors import VersionError
from agent.core.semver import is_semver, normalize_version

# The API server's semver check (semver.org's recommended expression).
OFFICIAL = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)"
    r"(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("550.54.15", "550.54.15"),
        ("535.54.03", "535.54.3"),
        ("12.4", "12.4.0"),
        ("8", "8.0.0"),
        ("v1.2.3", "1.2.3"),
        ("6.8.0.5", "6.8.0+5"),  # four-part amdgpu driver version (ROCm/gpu-operator#609)
        ("030.010.001", "30.10.1"),
        ("6.10.5-1.el9", "6.10.5-1.el9"),
        ("535.54.03-beta", "535.54.3-beta"),
        ("1.2.3+build.7", "1.2.3+build.7"),
        ("2.0.0-rc.01", "2.0.0-rc.1"),
        (" 9.0 ", "9.0.0"),
    ],
)
def test_normalize_known_vendor_versions(raw: str, expected: str) -> None:
    assert normalize_version(raw) == expected
    assert OFFICIAL.match(expected)


@pytest.mark.parametrize("raw", ["", "   ", "abc", "-1.2.3", "N/A"])
def test_unnormalizable_versions_name_the_value(raw: str) -> None:
    with pytest.raises(VersionError) as info:
        normalize_version(raw)
    assert repr(raw) in str(info.value)


def test_too_long_version_is_refused() -> None:
    with pytest.raises(VersionError):
        normalize_version("1.2.3-" + "a" * 80)


@given(st.lists(st.integers(min_value=0, max_value=10**6), min_size=1, max_size=6), st.booleans())
def test_numeric_versions_always_normalize_to_valid_semver(parts: list[int], pad: bool) -> None:
    text = ".".join(f"{p:03d}" if pad else str(p) for p in parts)
    result = normalize_version(text)
    assert OFFICIAL.match(result) and is_semver(result)
    assert result.split("+")[0].split(".")[: len(parts)] == [str(p) for p in parts[:3]]


@given(st.text(max_size=40))
def test_normalize_never_yields_an_invalid_version(text: str) -> None:
    try:
        result = normalize_version(text)
    except VersionError:
        return
    assert OFFICIAL.match(result) and len(result) <= 64


@given(st.from_regex(OFFICIAL, fullmatch=True))
def test_valid_semver_is_kept_as_is(text: str) -> None:
    if len(text) <= 64:
        assert normalize_version(text) == text
