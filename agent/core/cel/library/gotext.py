"""Go's text for numbers and strings, as cel-go prints them (``%g``, ``%e``/``%f``, ``%q``)."""

from __future__ import annotations

import math


def _go_float(number: float, spec: str) -> str:
    if math.isnan(number):
        return "NaN"
    if math.isinf(number):
        return "+Inf" if number > 0 else "-Inf"
    return format(number, spec)


def _go_g(number: float) -> str:
    """Go's ``%g`` (shortest representation): cel-go's string(double)."""
    if math.isnan(number):
        return "NaN"
    if math.isinf(number):
        return "+Inf" if number > 0 else "-Inf"
    if number == 0:
        return "-0" if math.copysign(1, number) < 0 else "0"
    digits, exp = _digits(repr(number))
    if exp < -4 or exp >= 6:  # Go: %e when the exponent is < -4 or >= 6 for the shortest form
        return _exponent_form(number < 0, digits, exp)
    return _plain_form(number < 0, digits, exp)


def _digits(text: str) -> tuple[str, int]:
    """The significant digits of a float's repr and its decimal exponent."""
    text = text.lstrip("-")
    mantissa, _, exp_text = text.partition("e")
    exp = int(exp_text) if exp_text else 0
    whole, _, frac = mantissa.partition(".")
    digits = (whole + frac).lstrip("0")
    lead = len(whole.lstrip("0")) if whole.strip("0") else -(len(frac) - len(frac.lstrip("0")))
    exponent = exp + lead - 1
    return digits.rstrip("0") or "0", exponent


def _exponent_form(negative: bool, digits: str, exp: int) -> str:
    body = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
    sign = "-" if exp < 0 else "+"
    return f"{'-' if negative else ''}{body}e{sign}{abs(exp):02d}"


def _plain_form(negative: bool, digits: str, exp: int) -> str:
    if exp >= 0:
        whole = (digits + "0" * max(0, exp + 1 - len(digits)))[: exp + 1]
        frac = digits[exp + 1 :]
    else:
        whole, frac = "0", "0" * (-exp - 1) + digits
    return f"{'-' if negative else ''}{whole}{'.' + frac if frac else ''}"


def _go_quote(text: str) -> str:
    """Go's ``%q`` for printable text (the common case in selectors)."""
    escapes = {"\a": "\\a", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\v": "\\v"}
    out = []
    for ch in text:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ch in escapes:
            out.append(escapes[ch])
        elif not ch.isprintable():
            out.append(f"\\x{ord(ch):02x}" if ord(ch) < 0x80 else f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


_SUPERSCRIPT = str.maketrans("0123456789-", "⁰¹²³⁴⁵⁶⁷⁸⁹⁻")


def _printer_float(number: float, verb: str, digits: int) -> str:
    """golang.org/x/text's en_US printer (v0.33.0, what Kubernetes 1.36 builds cel-go with), which
    cel-go's ``%f``/``%e`` clauses use; the cel-go referee (benchmarks/cel_conformance/referee)
    printed what this reproduces.

    ``%f`` groups thousands (``1,234.500000``), infinities are ``∞``. ``%e`` ignores the precision
    (always 6 digits) and writes ``1.052033\u00d710⁰³`` (the multiplication sign, ``10`` and an
    exponent of at least two superscript digits, no spaces); its infinities and NaN are padded
    to six characters (``     ∞``).
    """
    if verb == "e":
        digits = 6
    if math.isnan(number) or math.isinf(number):
        text = "NaN" if math.isnan(number) else "∞" if number > 0 else "-∞"
        return text.rjust(6) if verb == "e" else text
    if verb == "f":
        return format(number, f",.{digits}f")
    mantissa, _, exponent = format(number, f".{digits}e").partition("e")
    exp = int(exponent)
    power = (("-" if exp < 0 else "") + f"{abs(exp):02d}").translate(_SUPERSCRIPT)
    return f"{mantissa}\u00d710{power}"
