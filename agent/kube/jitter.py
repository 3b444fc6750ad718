"""Jittered periods and backoff, so that a fleet of agents started together drifts apart and stays apart.

Three rules, each from upstream:

- The slice watch's ``timeoutSeconds`` is drawn between 1x and 2x its base for every watch, as the
  client-go reflector does (``minWatchTimeout * (rand.Float64() + 1.0)`` in
  ``staging/src/k8s.io/client-go/tools/cache/reflector.go``: "spread the load on apiserver").
- The resync waits a time drawn uniformly over [0.5, 1.5) of its interval each time: like
  ``wait.JitterUntil`` (``staging/src/k8s.io/apimachinery/pkg/util/wait/backoff.go``, ``Jitter``)
  every period is drawn afresh, but centred so that the mean interval stays the configured one
  (the idle request rate does not grow). Agents started in the same second are spread over a whole
  interval after their first resync, and independent draws keep them spread.
- Retries back off exponentially with full jitter from the first retry: a delay drawn uniformly
  from [0, min(cap, initial * 2^(n-1))). ``wait.Backoff.Step`` (same file) jitters every step,
  the first included; full jitter (rather than client-go's [d, 2d)) spreads the reconnects of a
  fleet over the whole backoff window instead of the upper half of it.

Every function takes the `random.Random` to draw from, so tests are deterministic.
"""

from __future__ import annotations

import math
import random


def watch_timeout(base_seconds: float, rng: random.Random) -> int:
    """A watch's ``timeoutSeconds``: drawn between `base_seconds` and twice that (whole seconds, >= 1)."""
    return max(1, int(base_seconds * (rng.random() + 1.0)))


def resync_wait(period: float, rng: random.Random) -> float:
    """How long to wait for the next resync: uniformly over [0.5, 1.5) of `period`."""
    return period * (0.5 + rng.random())


def backoff(failures: int, initial: float, cap: float, rng: random.Random) -> float:
    """The delay before retry number `failures` (1 for the first): full jitter, capped."""
    exponent = min(max(0, failures - 1), 30)
    return rng.random() * min(cap, initial * math.pow(2.0, exponent))
