"""Field and label selectors, parsed and matched as the apiserver does."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.emulator.errors import ApiError, bad_request
from agent.emulator.resources import ResourceType, field_value

_LABEL_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)


@dataclass(frozen=True)
class FieldTerm:
    """``field=value`` or ``field!=value``."""

    field: str
    value: str
    negate: bool


@dataclass(frozen=True)
class LabelTerm:
    """One requirement of a label selector."""

    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!exists"
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Whether labels satisfy this requirement."""
        present = self.key in labels
        value = labels.get(self.key)
        if self.op == "exists":
            return present
        if self.op == "!exists":
            return not present
        if self.op in ("=", "in"):
            return present and value in self.values
        # "!=" and "notin" match objects without the label too, as the apiserver does.
        return not present or value not in self.values


def parse_field_selector(text: str, rtype: ResourceType, release: str = "") -> tuple[FieldTerm, ...]:
    """Parse a field selector; a field the resource does not support is a 400 as in the apiserver."""
    terms: list[FieldTerm] = []
    for raw in _split(text):
        part = raw.strip()
        if not part:
            continue
        for op in ("!=", "==", "="):
            if op in part:
                key, value = part.split(op, 1)
                break
        else:
            raise bad_request(f"invalid selector: '{text}'; can't understand '{part}'")
        key = key.strip()
        if not rtype.selects(key, release):
            raise bad_request(f"field label not supported: {key}")
        terms.append(FieldTerm(key, value.strip(), op == "!="))
    return tuple(terms)


def parse_label_selector(text: str) -> tuple[LabelTerm, ...]:
    """Parse a label selector (``=``, ``==``, ``!=``, ``in``, ``notin``, ``key``, ``!key``)."""
    terms: list[LabelTerm] = []
    for raw in _split(text):
        part = raw.strip()
        if not part:
            continue
        set_match = re.match(r"^(\S+)\s+(in|notin)\s*\(([^)]*)\)$", part)
        if set_match:
            key, op, values = set_match.groups()
            terms.append(LabelTerm(_key(key, text), op, tuple(v.strip() for v in values.split(","))))
            continue
        if part.startswith("!"):
            terms.append(LabelTerm(_key(part[1:].strip(), text), "!exists"))
            continue
        for op in ("!=", "==", "="):
            if op in part:
                key, value = part.split(op, 1)
                terms.append(
                    LabelTerm(_key(key.strip(), text), "!=" if op == "!=" else "=", (value.strip(),))
                )
                break
        else:
            terms.append(LabelTerm(_key(part, text), "exists"))
    return tuple(terms)


def _key(key: str, text: str) -> str:
    if not _LABEL_KEY.match(key) or len(key.rsplit("/", 1)[-1]) > 63:
        raise bad_request(f"unable to parse requirement: invalid label key {key!r} in selector {text!r}")
    return key


def _split(text: str) -> list[str]:
    """Split on commas outside parentheses."""
    parts: list[str] = []
    depth = 0
    current = ""
    for char in text:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return parts


def matcher(
    rtype: ResourceType, field_selector: str | None, label_selector: str | None, release: str = ""
) -> Callable[[Mapping[str, Any]], bool]:
    """A predicate for objects matching both selectors; raises `ApiError` 400 on a bad selector
    (``release`` decides the field selectors added later; "" accepts them all)."""
    fields = parse_field_selector(field_selector, rtype, release) if field_selector else ()
    labels = parse_label_selector(label_selector) if label_selector else ()

    def match(obj: Mapping[str, Any]) -> bool:
        for term in fields:
            if (field_value(obj, term.field) == term.value) == term.negate:
                return False
        object_labels = obj.get("metadata", {}).get("labels") or {}
        return all(term.matches(object_labels) for term in labels)

    return match


__all__ = ["ApiError", "FieldTerm", "LabelTerm", "matcher", "parse_field_selector", "parse_label_selector"]
