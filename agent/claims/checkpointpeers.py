"""Whether another agent shares the checkpoint now (a rolling update's other pod)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from agent.core.logs import log_fields

log = logging.getLogger("agent.claims.checkpoint")


PEER_CHECK_SECONDS = 1.0
"""How long the answer of the peer check is kept (it runs in the write's worker thread)."""


class PeerWatch:
    """Whether another agent shares the checkpoint now (a rolling update's other pod), asked at most
    once every `PEER_CHECK_SECONDS`.

    While one does, every write is a whole snapshot: an agent of a release before the journal
    reads only that, and one that finds journal records moves the file aside and writes what its
    memory holds, losing the claims the other pod prepared. Used by one write at a time.
    """

    def __init__(self, check: Callable[[], bool], clock: Callable[[], float] = time.monotonic) -> None:
        self._check = check
        self._clock = clock
        self._answer = True
        self._asked: float | None = None

    def forget(self) -> None:
        """Ask again at the next write: another agent just wrote the file."""
        self._asked = None

    def present(self) -> bool:
        """The check's answer, asked again once it is older than `PEER_CHECK_SECONDS` (blocking)."""
        now = self._clock()
        if self._asked is None or now - self._asked >= PEER_CHECK_SECONDS:
            try:
                self._answer = self._check()
            except OSError as error:  # unknown: shared, the safe answer
                log.warning(
                    "cannot tell whether another agent shares the checkpoint",
                    extra=log_fields(error=str(error)),
                )
                self._answer = True
            self._asked = now
        return self._answer
