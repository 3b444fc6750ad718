"""Server-side apply (``PATCH`` with ``application/apply-patch+yaml``), the part the emulator needs.

What is emulated, after upstream ``staging/src/k8s.io/apiserver/pkg/endpoints/handlers/patch.go``
(``applyPatcher``) and ``.../fieldmanager``: ``fieldManager`` is required; applying to a missing
object creates it (201); each applier's fields are recorded in ``metadata.managedFields``
(operation ``Apply``, ``FieldsV1``); a field the applier owned and no longer sends is removed
unless another applier owns it; a field another applier owns with a different value is a 409
``Conflict`` unless ``force=true``, which takes it over. Maps merge key by key; every list is
atomic (all resource.k8s.io lists are ``listType=atomic``; ``ownerReferences`` and ``finalizers``,
which upstream merges by key, are treated as atomic too). Writers that use create, update or
other patches are not recorded as managers, so they never conflict with an applier.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from agent.emulator.errors import ApiError
from agent.emulator.store import clone

JSON = dict[str, Any]
Path = tuple[str, ...]

#: Fields that identify the object rather than being owned by a manager.
_IDENTITY: frozenset[Path] = frozenset(
    {("apiVersion",), ("kind",), ("metadata", "name"), ("metadata", "namespace")}
)
_SERVER_META = frozenset(
    {"uid", "resourceVersion", "generation", "creationTimestamp", "managedFields", "selfLink"}
)


@dataclass(frozen=True)
class Applied:
    """The object after an apply, in the served version, with its new managedFields."""

    obj: JSON
    managed_fields: list[JSON]


def leaf_paths(obj: Any, prefix: Path = ()) -> set[Path]:
    """Paths of the fields a configuration sets: maps recurse, lists and scalars are leaves."""
    if isinstance(obj, dict) and obj:
        out: set[Path] = set()
        for key, value in obj.items():
            out |= leaf_paths(value, (*prefix, key))
        return out
    return {prefix}


def owned_by_config(config: JSON, subresource: str) -> set[Path]:
    """What an applier owns: the fields it sent, less identity and server-set metadata, and only
    status (for the status subresource) or everything but status (for the object)."""
    paths = {
        p
        for p in leaf_paths(config)
        if p not in _IDENTITY and not (p[0] == "metadata" and len(p) > 1 and p[1] in _SERVER_META)
    }
    if subresource == "status":
        return {p for p in paths if p[0] == "status"}
    return {p for p in paths if p[0] != "status"}


def fields_v1(paths: Iterable[Path]) -> JSON:
    """The ``fieldsV1`` tree of a set of paths (``{"f:spec": {"f:driver": {}}}``)."""
    tree: JSON = {}
    for path in sorted(paths):
        node = tree
        for part in path:
            node = node.setdefault(f"f:{part}", {})
    return tree


def paths_of(tree: Any, prefix: Path = ()) -> set[Path]:
    """The paths a ``fieldsV1`` tree names (its leaves)."""
    if not isinstance(tree, dict) or not tree:
        return {prefix} if prefix else set()
    out: set[Path] = set()
    for key, value in tree.items():
        if key == ".":
            out.add(prefix)
        elif key.startswith("f:"):
            out |= paths_of(value, (*prefix, key[2:]))
    return out


def _overlaps(a: Path, b: Path) -> bool:
    short = min(len(a), len(b))
    return a[:short] == b[:short]


def _get(obj: Any, path: Path) -> Any:
    for part in path:
        if not isinstance(obj, dict) or part not in obj:
            return None
        obj = obj[part]
    return obj


def _remove(obj: JSON, path: Path) -> None:
    parents = []
    node: Any = obj
    for part in path[:-1]:
        if not isinstance(node, dict) or part not in node:
            return
        parents.append((node, part))
        node = node[part]
    if isinstance(node, dict):
        node.pop(path[-1], None)
    # Maps emptied by the removal go too, as structured-merge-diff prunes them.
    for parent, key in reversed(parents):
        if parent[key] == {}:
            del parent[key]


def _merge(target: JSON, config: JSON) -> None:
    for key, value in config.items():
        if isinstance(value, dict) and value and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = clone(value)


def apply(
    current: JSON,
    config: JSON,
    *,
    manager: str,
    api_version: str,
    force: bool,
    subresource: str,
    now: str,
) -> Applied:
    """Apply ``config`` from ``manager`` to ``current`` (both in the served version)."""
    managed = [clone(m) for m in (current.get("metadata") or {}).get("managedFields") or []]
    mine = owned_by_config(config, subresource)
    previous = next(
        (m for m in managed if m.get("manager") == manager and m.get("operation") == "Apply"), None
    )
    owned_before = paths_of(previous.get("fieldsV1")) if previous else set()
    others = [m for m in managed if m is not previous]
    conflicts: list[tuple[str, Path]] = []
    for entry in others:
        theirs = paths_of(entry.get("fieldsV1"))
        clashing = {
            t for t in theirs for p in mine if _overlaps(p, t) and _get(current, t) != _get(config, t)
        }
        if clashing and not force:
            conflicts += [(str(entry.get("manager")), t) for t in sorted(clashing)]
        elif clashing:
            entry["fieldsV1"] = fields_v1(theirs - clashing)
    if conflicts:
        raise _conflict(conflicts)
    merged = clone(current)
    kept_by_others = set().union(*(paths_of(e.get("fieldsV1")) for e in others)) if others else set()
    for path in owned_before - mine:
        if not any(_overlaps(path, k) for k in kept_by_others):
            _remove(merged, path)
    _merge(merged, {k: v for k, v in config.items() if (k == "status") == (subresource == "status")})
    if previous is not None and owned_before == mine:
        entry = previous  # unchanged ownership keeps its timestamp: a no-op apply writes nothing
    else:
        entry = {
            "manager": manager,
            "operation": "Apply",
            "apiVersion": api_version,
            "time": now,
            "fieldsType": "FieldsV1",
            "fieldsV1": fields_v1(mine),
        }
        if subresource:
            entry["subresource"] = subresource
    result = [e for e in others if paths_of(e.get("fieldsV1"))] + [entry]
    return Applied(merged, result)


def _conflict(conflicts: list[tuple[str, Path]]) -> ApiError:
    shown = [(manager, "." + ".".join(path)) for manager, path in conflicts]
    count = len(shown)
    listed = "\n".join(f'- conflict with "{m}": {p}' for m, p in shown)
    message = (
        f'Apply failed with 1 conflict: conflict with "{shown[0][0]}": {shown[0][1]}'
        if count == 1
        else f"Apply failed with {count} conflicts: {listed}"
    )
    return ApiError(
        409,
        message,
        reason="Conflict",
        details={
            "causes": [
                {"reason": "FieldManagerConflict", "message": f'conflict with "{m}"', "field": p}
                for m, p in shown
            ]
        },
    )
