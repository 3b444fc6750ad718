"""Fault injection: latency, error codes for the next matching requests, outages and dropped watches."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from agent.emulator.errors import ApiError, reason_for

ALL_VERBS = frozenset({"get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"})


@dataclass
class FailureRule:
    """Fail ``remaining`` requests matching verbs/resource with ``status`` (``remaining < 0``: forever)."""

    remaining: int
    status: int
    verbs: frozenset[str] = ALL_VERBS
    resource: str | None = None
    retry_after: int = 1

    def matches(self, verb: str, resource: str) -> bool:
        """Whether a request matches (resource is the plural, ``x/status`` for subresources)."""
        if verb not in self.verbs:
            return False
        return (
            self.resource is None
            or resource == self.resource
            or resource.split("/", maxsplit=1)[0] == self.resource
        )


@dataclass
class Faults:
    """Faults the HTTP front end applies; changing them takes effect on the next request."""

    latency: float = 0.0
    #: Extra latency of one resource's requests (plural, or ``plural/status`` for the subresource
    #: alone -> seconds), e.g. a slow events endpoint.
    slow: dict[str, float] = field(default_factory=dict)
    rules: list[FailureRule] = field(default_factory=list)
    #: While True, connections are reset (and the port refuses new ones where the server can close it).
    down: bool = False
    _on_outage: Callable[[bool], None] | None = None
    _on_drop_watches: Callable[[], None] | None = None

    def fail_next(
        self,
        count: int,
        status: int = 500,
        verbs: Iterable[str] | None = None,
        resource: str | None = None,
        retry_after: int = 1,
    ) -> None:
        """Answer the next ``count`` matching requests with ``status`` and a proper Status body."""
        self.rules.append(
            FailureRule(count, status, frozenset(verbs) if verbs else ALL_VERBS, resource, retry_after)
        )

    def fail_all(
        self,
        status: int = 500,
        verbs: Iterable[str] | None = None,
        resource: str | None = None,
        retry_after: int = 1,
    ) -> None:
        """Answer every matching request with ``status`` until `clear`."""
        self.rules.append(
            FailureRule(-1, status, frozenset(verbs) if verbs else ALL_VERBS, resource, retry_after)
        )

    def outage(self, down: bool = True) -> None:
        """Start (True) or end (False) a full outage: connections refused or reset, watches cut."""
        self.down = down
        if self._on_outage is not None:
            self._on_outage(down)

    def drop_watches(self) -> None:
        """Close every open watch stream now."""
        if self._on_drop_watches is not None:
            self._on_drop_watches()

    def clear(self) -> None:
        """Remove every fault (latency, failures, outage)."""
        self.latency = 0.0
        self.slow.clear()
        self.rules.clear()
        if self.down:
            self.outage(False)

    def take(self, verb: str, resource: str) -> ApiError | None:
        """The injected error for this request, consuming one use of the first matching rule."""
        for rule in self.rules:
            if rule.remaining != 0 and rule.matches(verb, resource):
                if rule.remaining > 0:
                    rule.remaining -= 1
                error = ApiError(
                    rule.status, f"injected fault: {reason_for(rule.status)} ({verb} {resource})"
                )
                if rule.status == 429:
                    error.details = {"retryAfterSeconds": rule.retry_after}
                self.rules = [r for r in self.rules if r.remaining != 0]
                return error
        return None
