"""In-memory object store with one global resourceVersion counter and a watch history, like etcd."""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import anyio

JSON = dict[str, Any]
T = TypeVar("T")
ObjectKey = tuple[str, str]  # (namespace or "", name)


def clone(value: T) -> T:
    """A deep copy of JSON data (several times faster than `copy.deepcopy`, which matters for big slices)."""
    if isinstance(value, dict):
        return cast(T, {k: clone(v) for k, v in value.items()})
    if isinstance(value, list):
        return cast(T, [clone(v) for v in value])
    return value


@dataclass(frozen=True)
class StoredEvent:
    """One change, kept in the history so watches can resume from a resourceVersion."""

    rv: int
    type: str  # ADDED, MODIFIED, DELETED
    resource: str  # "<group>/<plural>" key of the resource type
    obj: JSON
    old: JSON | None


class Store:
    """Objects per resource key, a global revision and a bounded change history."""

    def __init__(self, history: int = 100_000, start_rv: int = 1000) -> None:
        self._objects: dict[str, dict[ObjectKey, JSON]] = {}
        self._rv = start_rv
        self._history_limit = history
        self._events: list[StoredEvent] = []
        # Watches and lists from a revision below this floor get 410 Gone.
        self._compacted = start_rv
        self._waiters: set[anyio.Event] = set()

    @property
    def revision(self) -> int:
        """The current (latest) resourceVersion."""
        return self._rv

    @property
    def compacted(self) -> int:
        """The oldest resourceVersion still resumable."""
        return self._compacted

    def get(self, resource: str, key: ObjectKey) -> JSON | None:
        """The stored object (do not mutate it)."""
        return self._objects.get(resource, {}).get(key)

    def items(self, resource: str) -> Iterator[tuple[ObjectKey, JSON]]:
        """Objects of a resource, sorted by namespace and name like the apiserver's lists."""
        objects = self._objects.get(resource, {})
        for key in sorted(objects):
            yield key, objects[key]

    def all_resources(self) -> list[str]:
        """Resource keys with at least one object."""
        return [r for r, objs in self._objects.items() if objs]

    def put(self, resource: str, key: ObjectKey, obj: JSON) -> JSON:
        """Store a copy of obj (created or modified) under a new resourceVersion; returns the stored object.

        The returned object is the store's own: callers convert (copy) it before handing it out.
        """
        self._rv += 1
        stored = clone(obj)
        stored["metadata"]["resourceVersion"] = str(self._rv)
        bucket = self._objects.setdefault(resource, {})
        old = bucket.get(key)
        bucket[key] = stored
        self._record(StoredEvent(self._rv, "MODIFIED" if old else "ADDED", resource, stored, old))
        return stored

    def remove(self, resource: str, key: ObjectKey) -> JSON:
        """Delete an object; the DELETED event carries it with a new resourceVersion, as etcd does.

        Returns that last state (the store's own object; do not mutate it).
        """
        bucket = self._objects.get(resource, {})
        old = bucket.pop(key)
        self._rv += 1
        gone = clone(old)
        gone["metadata"]["resourceVersion"] = str(self._rv)
        self._record(StoredEvent(self._rv, "DELETED", resource, gone, old))
        return gone

    def _record(self, event: StoredEvent) -> None:
        self._events.append(event)
        if len(self._events) > self._history_limit:
            dropped = self._events[: len(self._events) - self._history_limit]
            del self._events[: len(dropped)]
            self._compacted = dropped[-1].rv
        self.notify()

    def notify(self) -> None:
        """Wake every waiting watch."""
        waiters, self._waiters = self._waiters, set()
        for waiter in waiters:
            waiter.set()

    def compact(self) -> None:
        """Forget all history: resuming from any older resourceVersion gets 410 Gone."""
        self._events.clear()
        self._compacted = self._rv
        self.notify()

    def events_after(self, rv: int) -> list[StoredEvent]:
        """Events with a resourceVersion above rv (caller checks rv >= compacted)."""
        index = bisect.bisect_right(self._events, rv, key=lambda e: e.rv)
        return self._events[index:]

    def waiter(self) -> anyio.Event:
        """An event set at the next change (or `notify`)."""
        event = anyio.Event()
        self._waiters.add(event)
        return event
