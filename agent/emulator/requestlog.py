"""The emulator's request log: every request it answered, with its time, client, verb and resource.

Fleet tests and `benchmarks/fleet_bench.py` count what each agent asks of the API server, by verb
and resource, and when (the burst measure: the largest share of requests in any one second).
The client is told apart by its bearer token (each node has its own credentials, as with the
kubelet's), else by its User-Agent. The verb is the API server's (``get``, ``list``, ``watch``,
``create``, ...; discovery and ``/version`` are ``get`` of ``discovery`` and ``version``, as
``apiserver_request_total`` counts them), and a dry-run write is marked as one (nothing is stored).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

_METHOD_VERBS = {"POST": "create", "PUT": "update", "PATCH": "patch"}


@dataclass(frozen=True, slots=True)
class LoggedRequest:
    """One request the emulator answered."""

    at: float
    """When it arrived (the log's clock: monotonic seconds unless told otherwise)."""
    client: str
    verb: str
    resource: str
    dry_run: bool = False

    @property
    def label(self) -> str:
        """``verb resource`` (``create resourceslices (dry run)`` for a probe)."""
        return f"{self.verb} {self.resource}" + (" (dry run)" if self.dry_run else "")


def classify(method: str, path: str, query: Mapping[str, str]) -> tuple[str, str]:
    """(verb, resource) of a request as the API server's metrics name them."""
    parts = [p for p in path.split("/") if p]
    if parts == ["version"]:
        return "get", "version"
    if not parts or parts[0] not in ("api", "apis"):
        return method.lower(), "other"
    rest = parts[2:] if parts[0] == "api" else parts[3:]
    if not rest:
        return "get", "discovery"
    if rest[0] == "namespaces" and len(rest) >= 3:
        rest = rest[2:]
    named = len(rest) > 1
    resource = f"{rest[0]}/{rest[2]}" if len(rest) > 2 else rest[0]
    if method == "GET":
        if named:
            return "get", resource
        watch = query.get("watch", "").lower() in ("1", "true")
        return ("watch" if watch else "list"), resource
    if method == "DELETE":
        return ("delete" if named else "deletecollection"), resource
    return _METHOD_VERBS.get(method, method.lower()), resource


MAX_ENTRIES = 500_000
"""The newest requests kept (a long-running emulator forgets the oldest)."""


class RequestLog:
    """The requests answered so far (`entries`), in arrival order (the newest `MAX_ENTRIES`)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_entries: int = MAX_ENTRIES) -> None:
        self._clock = clock
        self.entries: deque[LoggedRequest] = deque(maxlen=max_entries)

    def record(self, method: str, path: str, query: Mapping[str, str], headers: Mapping[str, str]) -> None:
        verb, resource = classify(method, path, query)
        auth = headers.get("Authorization", "")
        client = auth[7:] if auth.startswith("Bearer ") else headers.get("User-Agent", "")
        dry_run = bool(query.get("dryRun"))
        self.entries.append(LoggedRequest(self._clock(), client, verb, resource, dry_run))

    def now(self) -> float:
        """The log's clock now (to mark a moment and read `since` it)."""
        return self._clock()

    def clear(self) -> None:
        self.entries.clear()

    def since(self, start: float, end: float | None = None) -> list[LoggedRequest]:
        """The requests that arrived at or after `start` (and before `end`)."""
        return [e for e in self.entries if e.at >= start and (end is None or e.at < end)]

    @staticmethod
    def counts(entries: Iterable[LoggedRequest]) -> Counter[tuple[str, str]]:
        """How many requests each client sent, by (client, label)."""
        return Counter((e.client, e.label) for e in entries)
