"""What this node's agent already published: the device taints in our own ResourceSlices.

Health conditions live in memory, so a restarted agent (crash, OOM, ``helm upgrade``, the new
pod of a rolling update) would rewrite its pool without the taints of faults seen seconds
before. Read before the first write, these taints seed the health tracker instead
(`agent.health.tracker.HealthTracker.seed`): a restart never lifts a taint early.
"""

from __future__ import annotations

import calendar
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent.kube.client import KubeClient
from agent.kube.slices import flat_device


@dataclass(frozen=True)
class PublishedTaint:
    """One taint of one device as stored in the API server; `time_added` is Unix time (None: unknown)."""

    device: str
    key: str
    value: str
    effect: str
    time_added: float | None


def parse_time(text: object) -> float | None:
    """RFC 3339 UTC (``2026-01-02T03:04:05Z``, fractions allowed) as Unix time, or None."""
    if not isinstance(text, str) or not text.endswith("Z"):
        return None
    try:
        return float(calendar.timegm(time.strptime(text[:19], "%Y-%m-%dT%H:%M:%S")))
    except ValueError:
        return None


def slice_taints(items: Sequence[Mapping[str, Any]], node_name: str) -> list[PublishedTaint]:
    """The taints of the current pool generation of our slices (`node_name` is the pool name)."""
    ours = [s for s in items if s.get("spec", {}).get("pool", {}).get("name") == node_name]
    generation = max((int(s["spec"]["pool"].get("generation", 0)) for s in ours), default=0)
    taints: list[PublishedTaint] = []
    for item in ours:
        if int(item["spec"]["pool"].get("generation", 0)) < generation:
            continue  # an older layout the publisher is about to delete
        for entry in item["spec"].get("devices") or []:
            device = flat_device(entry)
            for taint in device.get("taints") or []:
                taints.append(
                    PublishedTaint(
                        str(device.get("name", "")),
                        str(taint.get("key", "")),
                        str(taint.get("value", "") or ""),
                        str(taint.get("effect", "")),
                        parse_time(taint.get("timeAdded")),
                    )
                )
    return taints


async def published_taints(kube: KubeClient, *, node_name: str, driver: str) -> list[PublishedTaint]:
    """The device taints in this node's slices of `driver`; raises `KubeApiError` when unreadable."""
    await kube.ensure_discovered()
    items, _ = await kube.list_resource_slices(node_name=node_name, driver=driver)
    return slice_taints(items, node_name)
