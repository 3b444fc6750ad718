"""Readiness of the agent: named checks that components set, read by ``/readyz``.

Checks are named ``<kind>/<driver>``: ``registered/gpu.nvidia.com`` (the kubelet accepted the
plugin), ``published/gpu.nvidia.com`` (the slices are in the API server), ``monitor/...``
(the health monitor answers). A check that was `expect`-ed but never set counts as not ready,
so the pod is not ready before each component has reported once.
"""

from __future__ import annotations

import logging

from agent.core.logs import log_fields

log = logging.getLogger("agent.observe.readiness")

NOT_REPORTED = "not reported yet"


class Readiness:
    """A set of named readiness checks; ready when every known check is ok."""

    def __init__(self) -> None:
        self._checks: dict[str, tuple[bool, str]] = {}

    def expect(self, check: str) -> None:
        """Declare `check`: it counts as not ready until it is first `set`."""
        self._checks.setdefault(check, (False, NOT_REPORTED))

    def set(self, check: str, ok: bool, detail: str = "") -> None:
        """Record the state of `check` (logged when it changes)."""
        previous = self._checks.get(check)
        self._checks[check] = (ok, detail)
        if previous is None or previous[0] != ok:
            log.log(
                logging.INFO if ok else logging.WARNING,
                "readiness check changed",
                extra=log_fields(check=check, ok=ok, detail=detail),
            )

    def remove(self, check: str) -> None:
        """Forget `check` (e.g. a driver that is no longer served)."""
        self._checks.pop(check, None)

    def ready(self) -> tuple[bool, dict[str, tuple[bool, str]]]:
        """Whether all checks are ok, and a copy of every check's (ok, detail), sorted by name."""
        checks = dict(sorted(self._checks.items()))
        return all(ok for ok, _ in checks.values()), checks
