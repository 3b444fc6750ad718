"""Kubernetes resource quantities: parsing, comparison and the API server's canonical form.

Capacities are written in canonical form so that what we send equals what the API server stores
(it canonicalizes ``1024Mi`` to ``1Gi``); otherwise every resync would see a change and write.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

from agent.core.errors import QuantityError

_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_PATTERN = re.compile(
    r"^(?P<sign>[+-]?)(?P<num>\d+(?:\.\d*)?|\.\d+)"
    r"(?:(?P<bin>Ki|Mi|Gi|Ti|Pi|Ei)|(?P<exp>[eE][+-]?\d+)|(?P<dec>[numkMGTPE]?))$"
)

Format = Literal["BinarySI", "DecimalSI", "DecimalExponent"]


@dataclass(frozen=True, order=False)
class Quantity:
    """An exact quantity with the format family the API server keeps for it."""

    value: Fraction
    format: Format = "DecimalSI"

    @classmethod
    def parse(cls, text: str | int) -> Quantity:
        """Parse a quantity string (``80Gi``, ``1500m``, ``1e3``) or an integer."""
        if isinstance(text, int):
            return cls(Fraction(text), "DecimalSI")
        match = _PATTERN.match(text.strip()) if isinstance(text, str) else None
        if match is None:
            raise QuantityError(str(text))
        number = Fraction(match.group("num"))
        if match.group("sign") == "-":
            number = -number
        if match.group("bin"):
            return cls(number * 1024 ** _BINARY[match.group("bin")], "BinarySI")
        if match.group("exp"):
            return cls(number * Fraction(10) ** int(match.group("exp")[1:]), "DecimalExponent")
        return cls(number * Fraction(10) ** _DECIMAL[match.group("dec") or ""], "DecimalSI")

    @classmethod
    def binary(cls, value: int) -> Quantity:
        """A byte count, shown with binary suffixes (``85899345920`` -> ``80Gi``)."""
        return cls(Fraction(value), "BinarySI")

    def canonical(self) -> str:
        """The string the API server stores for this quantity."""
        value = self.value
        sign = "-" if value < 0 else ""
        value = abs(value)
        if self.format == "BinarySI" and value.denominator == 1 and value >= 1024:
            n = value.numerator
            power = 0
            while power < 6 and n % 1024 == 0:
                n //= 1024
                power += 1
            if power:
                suffix = next(k for k, v in _BINARY.items() if v == power)
                return f"{sign}{n}{suffix}"
            return f"{sign}{n}"
        # Decimal: smallest exponent (multiple of 3, >= -9) giving an integer mantissa, then the largest.
        exponent = -9
        mantissa = value * Fraction(10) ** 9
        if mantissa.denominator != 1:
            # Sub-nano precision is rounded up, as the API server does.
            mantissa = Fraction(-(-mantissa.numerator // mantissa.denominator))
        m = mantissa.numerator
        while exponent < 18 and m != 0 and m % 1000 == 0:
            m //= 1000
            exponent += 3
        if m == 0:
            return "0"
        if self.format == "DecimalExponent":
            return f"{sign}{m}" + (f"e{exponent}" if exponent else "")
        suffix = next(k for k, v in _DECIMAL.items() if v == exponent)
        return f"{sign}{m}{suffix}"

    def __lt__(self, other: Quantity) -> bool:
        return self.value < other.value

    def __le__(self, other: Quantity) -> bool:
        return self.value <= other.value

    def __str__(self) -> str:
        return self.canonical()
