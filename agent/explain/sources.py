"""What `explain` reads: the claim, its DeviceClasses, this node's slices and the other claims,
from the API server or from files; and, for an allocated claim, this node's checkpoint and CDI specs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import yaml

from agent.claims.cdi import spec_file_name
from agent.claims.checkpoint.format import CHECKPOINT_FILE, MAX_CHECKPOINT_BYTES, ClaimPhase, decode
from agent.core.boundedfile import MAX_DEPTH, MIB, BoundedFileError, read_bytes, read_text, yaml_depth_exceeds
from agent.core.errors import KubeApiError
from agent.explain.evaluate import ExplainError, Placement, allocation_results, requests_of
from agent.kube.client import RESOURCE_GROUP, claim_to_v1

MAX_INPUT_BYTES = 64 * MIB
"""--file and --slices: far above a node's slices printed many times over."""


@dataclass(frozen=True)
class Inputs:
    claim: Mapping[str, Any]
    classes: Mapping[str, Mapping[str, Any] | None]
    slices: Sequence[Mapping[str, Any]]
    other_claims: Sequence[Mapping[str, Any]]
    notes: tuple[str, ...] = ()
    taint_rules: Sequence[Mapping[str, Any]] = ()
    """DeviceTaintRules: the scheduler adds their taints to the devices they select."""


class ApiReader(Protocol):
    """What explain reads through (`agent.kube.client.KubeClient`)."""

    @property
    def slice_version(self) -> str: ...

    async def ensure_discovered(self) -> object: ...

    async def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]: ...

    async def request(
        self, method: str, path: str, *, query: Sequence[tuple[str, str]] = (), body: Any = None
    ) -> dict[str, Any]: ...


def class_names(claim: Mapping[str, Any]) -> set[str]:
    return {str(r.spec.get("deviceClassName", "")) for r in requests_of(claim)} - {""}


async def from_api(kube: ApiReader, namespace: str, name: str, node: str) -> Inputs:
    """Read everything from the API server; a missing claim is an `ExplainError`."""
    await kube.ensure_discovered()
    base = f"/apis/{RESOURCE_GROUP}/{kube.slice_version}"
    try:
        claim = await kube.get_resource_claim(namespace, name)
    except KubeApiError as error:
        if error.status == 404:
            raise ExplainError(f"ResourceClaim {namespace}/{name} not found") from error
        raise
    classes: dict[str, Mapping[str, Any] | None] = {}
    for class_name in sorted(class_names(claim)):
        try:
            classes[class_name] = await kube.request("GET", f"{base}/deviceclasses/{class_name}")
        except KubeApiError as error:
            if error.status == 403:
                raise ExplainError(
                    f"cannot read DeviceClass {class_name}: forbidden; run explain with credentials that may "
                    "get deviceclasses and list resourceslices and resourceclaims (--kube kubeconfig)"
                ) from error
            if error.status != 404:
                raise
            classes[class_name] = None
    slices = await kube.request(
        "GET", f"{base}/resourceslices", query=[("fieldSelector", f"spec.nodeName={node}")]
    )
    notes: tuple[str, ...] = ()
    try:
        claims = await kube.request("GET", f"{base}/resourceclaims")
    except KubeApiError as error:
        if error.status != 403:
            raise
        claims = {}
        notes = ("cannot list ResourceClaims (forbidden): devices allocated to other claims are not shown",)
    rules, rule_note = await _taint_rules(kube)
    convert = claim_to_v1 if kube.slice_version == "v1beta1" else dict
    return Inputs(
        claim=claim,
        classes=classes,
        slices=[s for s in slices.get("items") or [] if isinstance(s, Mapping)],
        other_claims=[convert(c) for c in claims.get("items") or [] if isinstance(c, Mapping)],
        notes=notes + rule_note,
        taint_rules=rules,
    )


TAINT_RULE_VERSIONS = ("v1", "v1beta2", "v1alpha3")
"""Where DeviceTaintRules are served: v1 from 1.37 (GA, on by default), v1alpha3 before (gated)."""


async def _taint_rules(kube: ApiReader) -> tuple[list[Mapping[str, Any]], tuple[str, ...]]:
    """The cluster's DeviceTaintRules (none where the API server does not serve them)."""
    for version in TAINT_RULE_VERSIONS:
        try:
            found = await kube.request("GET", f"/apis/{RESOURCE_GROUP}/{version}/devicetaintrules")
        except KubeApiError as error:
            if error.status == 404:
                continue  # not served at this version (or the feature gate is off)
            if error.status == 403:
                return [], (
                    "cannot list DeviceTaintRules (forbidden): taints an admin set by rule are not shown",
                )
            raise
        return [r for r in found.get("items") or [] if isinstance(r, Mapping)], ()
    return [], ()


def _documents(path: Path, flag: str) -> list[list[Mapping[str, Any]]]:
    """The objects of each YAML document of `path` (a ``List`` gives its items), read within bounds."""
    try:
        text = read_text(path, max_bytes=MAX_INPUT_BYTES, what=f"{flag} file")
        if yaml_depth_exceeds(text, MAX_DEPTH):
            raise ExplainError(f"{flag} {path}: nests deeper than {MAX_DEPTH} levels")
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except BoundedFileError as error:
        raise ExplainError(f"{flag}: {error}") from error
    except yaml.YAMLError as error:
        raise ExplainError(f"{flag} {path}: not YAML: {str(error).splitlines()[0]}") from error
    out: list[list[Mapping[str, Any]]] = []
    for doc in docs:
        if not isinstance(doc, Mapping):
            raise ExplainError(f"{flag} {path}: expected Kubernetes objects, got {type(doc).__name__}")
        if doc.get("kind") == "List":
            out.append([i for i in doc.get("items") or [] if isinstance(i, Mapping)])
        else:
            out.append([doc])
    return out


def _pool(obj: Mapping[str, Any]) -> tuple[str, str]:
    spec = obj.get("spec") or {}
    return str(spec.get("driver", "")), str((spec.get("pool") or {}).get("name", ""))


def from_files(claim_file: Path, slices_file: Path) -> Inputs:
    """The first ResourceClaim of `claim_file` (its DeviceClasses and other claims may follow) and
    the slices ``dra-agent run --kube none`` printed: it prints a pool again on every change, so
    the last print of each pool wins."""
    objects = [o for doc in _documents(claim_file, "--file") for o in doc]
    pools: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    classes = {}
    for doc in _documents(slices_file, "--slices"):
        printed: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
        for obj in doc:
            if obj.get("kind") == "ResourceSlice":
                printed.setdefault(_pool(obj), []).append(obj)
            elif obj.get("kind") == "DeviceTaintRule":
                objects.append(obj)
            elif obj.get("kind") == "DeviceClass":
                classes[str((obj.get("metadata") or {}).get("name"))] = obj
        pools.update(printed)
    claims = [o for o in objects if o.get("kind") == "ResourceClaim"]
    rules = [o for o in objects if o.get("kind") == "DeviceTaintRule"]
    if not claims:
        raise ExplainError(f"--file {claim_file}: no ResourceClaim in it")
    classes.update(
        {str((o.get("metadata") or {}).get("name")): o for o in objects if o.get("kind") == "DeviceClass"}
    )
    claim = claims[0]
    return Inputs(
        claim=claim,
        classes={name: classes.get(name) for name in class_names(claim)},
        slices=[s for group in pools.values() for s in group],
        other_claims=claims[1:],
        taint_rules=rules,
    )


def node_of(slices: Sequence[Mapping[str, Any]]) -> str | None:
    """The one node the slices belong to, or None."""
    nodes = {str((s.get("spec") or {}).get("nodeName", "")) for s in slices} - {""}
    return nodes.pop() if len(nodes) == 1 else None


def placement(claim: Mapping[str, Any], node: str, state_dir: Path, cdi_root: Path) -> Placement | None:
    """Where an allocated claim stands on this node: prepared (checkpoint), CDI specs, pods."""
    results = [r for r in allocation_results(claim) if r.get("pool") == node]
    if not results:
        return None
    uid = str((claim.get("metadata") or {}).get("uid", ""))
    drivers = sorted({str(r.get("driver")) for r in results})
    states = []
    for driver in drivers:
        path = state_dir / driver / CHECKPOINT_FILE
        if not path.exists():
            states.append("no")
            continue
        try:
            entry = decode(read_bytes(path, max_bytes=MAX_CHECKPOINT_BYTES, what="checkpoint")).entries.get(
                uid
            )
        except Exception:  # unreadable or corrupt: say unknown rather than guess
            states.append("unknown")
            continue
        if entry is None:
            states.append("no")
        else:
            states.append("yes" if entry.phase is ClaimPhase.COMPLETED else "started")
    specs = [
        str(cdi_root / spec_file_name(d, uid))
        for d in drivers
        if (cdi_root / spec_file_name(d, uid)).exists()
    ]
    reserved = (claim.get("status") or {}).get("reservedFor") or []
    return Placement(
        devices=tuple(f"{r.get('driver')}/{r.get('pool')}/{r.get('device')}" for r in results),
        prepared=states[0] if len(set(states)) == 1 else ",".join(states),
        cdi_spec=tuple(specs),
        pods=tuple(str(r.get("name")) for r in reserved if r.get("resource") == "pods"),
    )
