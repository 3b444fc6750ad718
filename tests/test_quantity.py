"""Kubernetes quantities: parsing, comparison and the API server's canonical form."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.core.errors import QuantityError
from agent.core.quantity import Quantity


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("80Gi", "80Gi"),
        ("1024Mi", "1Gi"),
        ("0.5Gi", "512Mi"),
        ("2000", "2k"),
        ("1.5", "1500m"),
        ("1500m", "1500m"),
        ("100M", "100M"),
        ("1e3", "1e3"),
        ("0", "0"),
        ("-1Ki", "-1Ki"),
    ],
)
def test_canonical_form_matches_the_api_server(text: str, canonical: str) -> None:
    assert Quantity.parse(text).canonical() == canonical


def test_bytes_use_binary_suffixes() -> None:
    assert Quantity.binary(80 * 1024**3).canonical() == "80Gi"
    assert Quantity.binary(1000).canonical() == "1k"  # below 1Ki the API server switches to decimal
    assert Quantity.binary(1025).canonical() == "1025"


@pytest.mark.parametrize("text", ["", "Gi", "1.2.3", "12XB", "1 Gi", "--1"])
def test_invalid_quantities_are_refused(text: str) -> None:
    with pytest.raises(QuantityError) as info:
        Quantity.parse(text)
    assert repr(text) in str(info.value)


def test_comparison() -> None:
    assert Quantity.parse("40Gi") < Quantity.parse("80Gi")
    assert Quantity.parse("1Gi") <= Quantity.parse("1024Mi")


@given(st.integers(min_value=0, max_value=2**60))
def test_canonical_round_trips(value: int) -> None:
    for q in (Quantity.binary(value), Quantity.parse(value)):
        assert Quantity.parse(q.canonical()).value == Fraction(value)
