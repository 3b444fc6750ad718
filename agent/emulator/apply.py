"""Server-side apply (``PATCH`` with ``application/apply-patch+yaml``), the part the emulator needs.

What is emulated, after upstream ``staging/src/k8s.io/apiserver/pkg/endpoints/handlers/patch.go``
(``applyPatcher``) and ``.../fieldmanager``: ``fieldManager`` is required; applying to a missing
object creates it (201); each applier's fields are recorded in ``metadata.managedFields``
(operation ``Apply``, ``FieldsV1``); a field the applier owned and no longer sends is removed
unless another manager owns it; a field another manager owns with a different value is a 409
``Conflict`` unless ``force=true``, which takes it over. Maps merge key by key; a claim's
``status.devices`` is a list-map (``+listType=map`` keyed by driver, device, pool and shareID,
staging/src/k8s.io/api/resource/v1/types.go): its items merge by key and are owned field by
field, so each driver's writer owns its own entries, and an item left with only its keys goes.
Every other list is atomic (``ownerReferences``, ``finalizers`` and ``reservedFor``, which upstream
merges by key, are treated as atomic).

Writers that create, update or patch otherwise are ``Update`` managers (structured-merge-diff
``Updater.Update``): they own the fields they changed, taken from every other manager, so an
applier that later changes one of them conflicts with them (``conflict with "m" using <apiVersion>``,
upstream ``managedfields/internal/conflict.go``). Before merging, an apply body is checked as
upstream's managers do: its kind and apiVersion (``versioncheck.go``: 400 ``invalid object type``),
no ``metadata.managedFields`` (``structuredmerge.go``: 400), and no field outside the schema
(``ObjectToTyped``: a plain error, so a 500 without a reason).
"""

from __future__ import annotations

import json
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
#: List-maps and their key fields (``+listMapKey``); a path names one item as ``k:{...}``.
LIST_MAPS: dict[Path, tuple[str, ...]] = {("status", "devices"): ("device", "driver", "pool", "shareID")}


@dataclass(frozen=True)
class Applied:
    """The object after an apply, in the served version, with its new managedFields."""

    obj: JSON
    managed_fields: list[JSON]


def item_key(item: JSON, keys: tuple[str, ...]) -> str:
    """structured-merge-diff's name of a list-map item: ``k:{"device":"gpu-0","driver":...}``."""
    fields = {k: item[k] for k in keys if item.get(k) is not None}
    return "k:" + json.dumps(fields, separators=(",", ":"), sort_keys=True)


def _is_list_map(prefix: Path, value: Any) -> bool:
    return prefix in LIST_MAPS and isinstance(value, list) and all(isinstance(i, dict) for i in value)


def leaf_paths(obj: Any, prefix: Path = ()) -> set[Path]:
    """Paths of the fields a configuration sets: maps and list-map items recurse, other lists and
    scalars are leaves; an empty list-map sets nothing."""
    if isinstance(obj, dict) and obj:
        out: set[Path] = set()
        for key, value in obj.items():
            out |= leaf_paths(value, (*prefix, key))
        return out
    if _is_list_map(prefix, obj):
        keys = LIST_MAPS[prefix]
        return {p for item in obj for p in leaf_paths(item, (*prefix, item_key(item, keys)))}
    return {prefix}


def owned_by_config(config: JSON, subresource: str) -> set[Path]:
    """What an applier owns: the fields it sent, less identity and server-set metadata, and only
    status (for the status subresource) or everything but status (for the object)."""
    paths = {
        p
        for p in leaf_paths(config)
        if p and p not in _IDENTITY and not (p[0] == "metadata" and len(p) > 1 and p[1] in _SERVER_META)
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
            node = node.setdefault(part if part.startswith("k:") else f"f:{part}", {})
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
        elif key.startswith("k:"):
            out |= paths_of(value, (*prefix, key))
    return out


def _overlaps(a: Path, b: Path) -> bool:
    short = min(len(a), len(b))
    return a[:short] == b[:short]


def _find(items: list[Any], at: Path, part: str) -> int | None:
    """The index of the list-map item `part` names in the list at `at`."""
    keys = LIST_MAPS.get(at)
    if keys is None:
        return None
    found = (i for i, item in enumerate(items) if isinstance(item, dict) and item_key(item, keys) == part)
    return next(found, None)


def _get(obj: Any, path: Path) -> Any:
    for depth, part in enumerate(path):
        if isinstance(obj, list) and part.startswith("k:"):
            index = _find(obj, path[:depth], part)
            if index is None:
                return None
            obj = obj[index]
            continue
        if not isinstance(obj, dict) or part not in obj:
            return None
        obj = obj[part]
    return obj


def _remove(obj: Any, path: Path, at: Path = ()) -> None:
    """Remove the field at `path`; maps it empties go too, as structured-merge-diff prunes them, and
    so does a list-map item left with only its keys."""
    part, rest = path[0], path[1:]
    if isinstance(obj, list):
        keys = LIST_MAPS.get(at, ())
        index = _find(obj, at, part)
        if index is None:
            return
        item = obj[index]
        if rest and rest[0] not in keys:
            _remove(item, rest, (*at, part))
        if not rest or all(k in keys for k in item):
            del obj[index]
        return
    if not isinstance(obj, dict) or part not in obj:
        return
    if not rest:
        del obj[part]
        return
    _remove(obj[part], rest, (*at, part))
    if obj[part] == {} or (obj[part] == [] and (*at, part) in LIST_MAPS):
        del obj[part]


def _merge(target: JSON, config: JSON, at: Path = ()) -> None:
    for key, value in config.items():
        path = (*at, key)
        if _is_list_map(path, value):
            found = target.get(key)
            items: list[Any] = found if isinstance(found, list) else []
            for item in value:
                index = _find(items, path, item_key(item, LIST_MAPS[path]))
                if index is None:
                    items.append(clone(item))
                else:
                    _merge(items[index], item, (*path, "k:"))
            if items:
                target[key] = items
        elif isinstance(value, dict) and value and isinstance(target.get(key), dict):
            _merge(target[key], value, path)
        else:
            target[key] = clone(value)


def manager_key(entry: JSON) -> tuple[str, str, str, str]:
    """``BuildManagerIdentifier``: manager, operation, subresource, and apiVersion for updaters."""
    operation = str(entry.get("operation", ""))
    version = str(entry.get("apiVersion", "")) if operation == "Update" else ""
    return (str(entry.get("manager", "")), operation, str(entry.get("subresource", "")), version)


def print_manager(entry: JSON) -> str:
    """``printManager`` of upstream ``conflict.go`` (identifiers carry no time)."""
    text = json.dumps(str(entry.get("manager", "")))
    if entry.get("subresource"):
        text += f" with subresource {json.dumps(str(entry['subresource']))}"
    if entry.get("operation") == "Update":
        text += f" using {entry.get('apiVersion', '')}"
    return text


def check_config(config: JSON, api_version: str, kind: str) -> None:
    """The apply body checks that come before any merge (upstream manager chain order)."""
    if config.get("apiVersion") != api_version or config.get("kind") != kind:
        group, _, version = str(config.get("apiVersion") or "").rpartition("/")
        raise ApiError(400, f"invalid object type: {group}/{version}, Kind={config.get('kind') or ''}")
    meta = config.get("metadata")
    if isinstance(meta, dict) and isinstance(meta.get("managedFields"), list):
        raise ApiError(400, "metadata.managedFields must be nil")


def schema_error(unknown: list[str], api_version: str, kind: str) -> ApiError:
    """``failed to create typed patch object``: a plain Go error, answered 500 without a reason."""
    group, _, version = api_version.rpartition("/")
    problems = [f".{path}: field not declared in schema" for path in unknown]
    text = problems[0] if len(problems) == 1 else "errors:\n" + "\n".join(f"  {p}" for p in problems)
    error = ApiError(500, f"failed to create typed patch object ({group}/{version}, Kind={kind}): {text}")
    error.reason = ""  # metav1.StatusReasonUnknown
    return error


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
    me = {"manager": manager, "operation": "Apply", **({"subresource": subresource} if subresource else {})}
    previous = next((m for m in managed if manager_key(m) == manager_key(me)), None)
    owned_before = paths_of(previous.get("fieldsV1")) if previous else set()
    others = [m for m in managed if m is not previous]
    conflicts: list[tuple[JSON, Path]] = []
    for entry in others:
        theirs = paths_of(entry.get("fieldsV1"))
        clashing = {
            t for t in theirs for p in mine if _overlaps(p, t) and _get(current, t) != _get(config, t)
        }
        if clashing and not force:
            conflicts += [(entry, t) for t in sorted(clashing)]
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
    return Applied(merged, sort_entries(result))


def sort_entries(entries: list[JSON]) -> list[JSON]:
    """``sortEncodedManagedFields``: by operation, time, manager, apiVersion, subresource."""
    return sorted(
        entries,
        key=lambda e: (
            str(e.get("operation", "")),
            str(e.get("time", "")),
            str(e.get("manager", "")),
            str(e.get("apiVersion", "")),
            str(e.get("subresource", "")),
        ),
    )


def _changed(old: JSON, new: JSON, subresource: str) -> tuple[set[Path], set[Path]]:
    """Leaf paths set or changed by ``new`` and leaf paths it removed (``TypedValue.Compare``)."""
    before, after = owned_by_config(old, subresource), owned_by_config(new, subresource)
    changed = {p for p in after if p not in before or _get(old, p) != _get(new, p)}
    removed = {p for p in before if not any(_overlaps(p, q) for q in after)}
    return changed, removed


def update(
    managed: list[JSON],
    old: JSON | None,
    new: JSON,
    *,
    manager: str,
    api_version: str,
    subresource: str,
    now: str,
) -> list[JSON]:
    """structured-merge-diff ``Updater.Update`` for a create/update/patch by ``manager``.

    The fields it changes move to its ``Update`` entry (forced: an update never conflicts);
    fields it removes leave every entry; entries left empty disappear."""
    changed, removed = _changed(old or {}, new, subresource)
    me = {"manager": manager, "operation": "Update", "apiVersion": api_version}
    if subresource:
        me["subresource"] = subresource
    out: list[JSON] = []
    previous: JSON | None = None
    for raw in managed:
        entry = clone(raw)
        if manager_key(entry) == manager_key(me):
            previous = entry
            continue
        theirs = paths_of(entry.get("fieldsV1"))
        kept = {t for t in theirs if not any(_overlaps(t, c) for c in changed) and t not in removed}
        if kept != theirs:
            entry["fieldsV1"] = fields_v1(kept)
        if kept:
            out.append(entry)
    mine_before = paths_of(previous.get("fieldsV1")) if previous else set()
    mine = {p for p in mine_before if p not in removed and not any(_overlaps(p, c) for c in changed)}
    mine |= changed
    if mine:
        if previous is not None and mine == mine_before and not changed:
            out.append(previous)
        else:
            out.append({**me, "time": now, "fieldsType": "FieldsV1", "fieldsV1": fields_v1(mine)})
    return sort_entries(out)


def _conflict(conflicts: list[tuple[JSON, Path]]) -> ApiError:
    """``NewConflictError`` of upstream ``managedfields/internal/conflict.go``."""
    shown = [(print_manager(entry), "." + ".".join(path)) for entry, path in conflicts]
    if len(shown) == 1:
        message = f"Apply failed with 1 conflict: conflict with {shown[0][0]}: {shown[0][1]}"
    else:
        by_manager: dict[str, list[str]] = {}
        for manager, path in shown:
            by_manager.setdefault(manager, []).append(path)
        lines: list[str] = []
        for manager in sorted(by_manager):
            lines.append(f"conflicts with {manager}:")
            lines += [f"- {path}" for path in by_manager[manager]]
        message = f"Apply failed with {len(shown)} conflicts: " + "\n".join(lines)
    return ApiError(
        409,
        message,
        reason="Conflict",
        details={
            "causes": [
                {"reason": "FieldManagerConflict", "message": f"conflict with {m}", "field": p}
                for m, p in shown
            ]
        },
    )
