"""DeviceTaintRule fallback: taints as cluster-scoped rules when slices cannot carry them.

With the DRADeviceTaints feature gate off, the API server drops ``taints`` from ResourceSlices.
DeviceTaintRules (resource.k8s.io v1alpha3, or v1beta2 where served) select one device by
driver, pool and device name and add one taint; we keep one rule per tainted device and taint
key, named deterministically so restarts find them, and delete them when the taint lifts.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from agent.core.errors import KubeApiError
from agent.core.logs import log_fields
from agent.health.taints import DeviceTaint
from agent.kube.slices import taint_identity, taint_to_api

if TYPE_CHECKING:
    from agent.kube.client import KubeClient
    from agent.observe.metrics import Metrics

log = logging.getLogger("agent.kube.taintrules")

MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "dra-agent"
DRIVER_LABEL = "dra-agent.io/driver"
RESOURCE = "devicetaintrules"


def rule_name(driver: str, pool: str, device: str, key: str) -> str:
    """A stable DNS-subdomain name for the rule of one device's taint key."""
    digest = hashlib.sha256(f"{driver}\0{pool}\0{device}\0{key}".encode()).hexdigest()[:10]
    prefix = f"{pool}.{device}"[: 253 - 12].rstrip(".-")
    return f"{prefix}-{digest}"


def desired_rules(
    driver: str, pool: str, taints: Mapping[str, Sequence[DeviceTaint]]
) -> dict[str, dict[str, Any]]:
    """The DeviceTaintRule objects (without apiVersion/kind) for `taints`, by name."""
    rules: dict[str, dict[str, Any]] = {}
    for device, device_taints in sorted(taints.items()):
        for taint in device_taints:
            name = rule_name(driver, pool, device, taint.key)
            if name in rules:  # the first (most severe) taint of a key wins
                continue
            rules[name] = {
                "metadata": {"name": name, "labels": {MANAGED_BY_LABEL: MANAGED_BY, DRIVER_LABEL: driver}},
                "spec": {
                    "deviceSelector": {"driver": driver, "pool": pool, "device": device},
                    "taint": taint_to_api(taint),
                },
            }
    return rules


class TaintRuleSync:
    """Keeps our DeviceTaintRules equal to the wanted taints of one driver's pool."""

    def __init__(self, kube: KubeClient, driver: str, pool: str, *, metrics: Metrics | None = None) -> None:
        self._kube = kube
        self._driver = driver
        self._pool = pool
        self._metrics = metrics

    @property
    def supported(self) -> bool:
        """Whether the API server serves DeviceTaintRules at all."""
        return self._kube.info.taint_rule_version is not None

    async def sync(self, taints: Mapping[str, Sequence[DeviceTaint]]) -> int:
        """Create, update and delete rules so they match `taints`; return the number of writes.

        Raises `KubeApiError` (404 when DeviceTaintRules are not served).
        """
        existing = {
            str(r["metadata"]["name"]): r
            for r in await self._kube.list_device_taint_rules(
                f"{MANAGED_BY_LABEL}={MANAGED_BY},{DRIVER_LABEL}={self._driver}"
            )
            if r.get("spec", {}).get("deviceSelector", {}).get("pool") == self._pool
        }
        wanted = desired_rules(self._driver, self._pool, taints)
        writes = 0
        for name, rule in existing.items():
            if name not in wanted:
                meta = rule.get("metadata", {})
                await self._write(
                    "delete",
                    self._kube.delete_device_taint_rule(
                        name,
                        uid=str(meta.get("uid", "")),
                        resource_version=str(meta.get("resourceVersion", "")),
                    ),
                )
                writes += 1
                log.info("device taint rule removed", extra=log_fields(rule=name, driver=self._driver))
        for name, rule in wanted.items():
            current = existing.get(name)
            if current is None:
                await self._write("create", self._kube.create_device_taint_rule(rule))
                writes += 1
                log.info(
                    "device taint rule created",
                    extra=log_fields(rule=name, device=rule["spec"]["deviceSelector"]["device"]),
                )
                continue
            spec = current.get("spec", {})
            if spec.get("deviceSelector") != rule["spec"]["deviceSelector"] or taint_identity(
                spec.get("taint", {})
            ) != taint_identity(rule["spec"]["taint"]):
                body = {"metadata": {**current.get("metadata", {}), **rule["metadata"]}, "spec": rule["spec"]}
                await self._write("update", self._kube.update_device_taint_rule(body))
                writes += 1
        return writes

    async def _write(self, verb: str, call: Any) -> None:
        try:
            await call
        except KubeApiError as error:
            if self._metrics is not None:
                self._metrics.api_writes.labels(RESOURCE, verb, "error").inc()
            if verb == "delete" and error.status == 404:
                return
            raise
        if self._metrics is not None:
            self._metrics.api_writes.labels(RESOURCE, verb, "success").inc()
