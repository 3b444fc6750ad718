"""PATCH bodies: JSON merge patch (RFC 7386), JSON patch (RFC 6902) and strategic merge patch."""

from __future__ import annotations

from typing import Any

from agent.emulator.errors import ApiError, bad_request
from agent.emulator.store import clone

MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
APPLY = "application/apply-patch+yaml"

#: Lists that strategic merge patch merges by a key (``patchMergeKey`` in the Go types); others are replaced.
_MERGE_KEYS: dict[str, str] = {
    "metadata.ownerReferences": "uid",
    "status.conditions": "type",
    "status.addresses": "type",
    "status.reservedFor": "uid",
}
_MERGE_PRIMITIVES = {"metadata.finalizers"}


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge recursively, ``null`` deletes, everything else replaces."""
    if not isinstance(patch, dict):
        return clone(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def strategic_merge_patch(target: Any, patch: Any, path: str = "") -> Any:
    """Strategic merge: like merge patch, but known keyed lists merge element-wise."""
    if not isinstance(patch, dict):
        return clone(patch)
    if patch.get("$patch") == "replace":
        return {k: clone(v) for k, v in patch.items() if k != "$patch"}
    if patch.get("$patch") == "delete":
        return None
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$"):
            if key.startswith("$setElementOrder/") or key == "$retainKeys":
                continue
            raise bad_request(f"unknown patch directive {key!r} in strategic merge patch")
        sub = f"{path}.{key}" if path else key
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list) and sub in _MERGE_KEYS and isinstance(result.get(key), list):
            result[key] = _merge_list(result[key], value, _MERGE_KEYS[sub], sub)
        elif isinstance(value, list) and sub in _MERGE_PRIMITIVES and isinstance(result.get(key), list):
            result[key] = list(dict.fromkeys([*result[key], *value]))
        else:
            merged = strategic_merge_patch(result.get(key), value, sub)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
    return result


def _merge_list(current: list[Any], patch: list[Any], key: str, path: str) -> list[Any]:
    out = [clone(item) for item in current]
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise bad_request(f"{path}: every element of a strategic merge list needs the merge key {key!r}")
        index = next((i for i, have in enumerate(out) if have.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if index is not None:
                out.pop(index)
        elif index is None:
            out.append(strategic_merge_patch({}, item, path))
        else:
            out[index] = strategic_merge_patch(out[index], item, path)
    return out


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise _patch_error(f"invalid JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _patch_error(message: str) -> ApiError:
    # The apiserver answers failed JSON patch operations with 422 in recent releases.
    return ApiError(422, f"the server rejected our request due to an error in our request: {message}")


def _parent(doc: Any, parts: list[str]) -> tuple[Any, str]:
    node = doc
    for part in parts[:-1]:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise _patch_error(f"doc is missing path: /{'/'.join(parts)}")
    return node, parts[-1]


def _get(doc: Any, parts: list[str]) -> Any:
    if not parts:
        return doc
    parent, last = _parent(doc, parts)
    if isinstance(parent, dict) and last in parent:
        return parent[last]
    if isinstance(parent, list) and last.isdigit() and int(last) < len(parent):
        return parent[int(last)]
    raise _patch_error(f"doc is missing path: /{'/'.join(parts)}")


def _remove(doc: Any, parts: list[str]) -> Any:
    parent, last = _parent(doc, parts)
    if isinstance(parent, dict) and last in parent:
        return parent.pop(last)
    if isinstance(parent, list) and last.isdigit() and int(last) < len(parent):
        return parent.pop(int(last))
    raise _patch_error(f"unable to remove nonexistent key: {last}: missing value")


def _add(doc: Any, parts: list[str], value: Any, replace: bool) -> Any:
    if not parts:
        return value
    parent, last = _parent(doc, parts)
    if isinstance(parent, dict):
        if replace and last not in parent:
            raise _patch_error(f"replace operation does not apply: doc is missing key: /{'/'.join(parts)}")
        parent[last] = value
    elif isinstance(parent, list):
        if last == "-" and not replace:
            parent.append(value)
        elif last.isdigit() and int(last) <= len(parent) - (1 if replace else 0):
            if replace:
                parent[int(last)] = value
            else:
                parent.insert(int(last), value)
        else:
            raise _patch_error(f"index out of range: /{'/'.join(parts)}")
    else:
        raise _patch_error(f"doc is missing path: /{'/'.join(parts)}")
    return doc


def json_patch(target: Any, operations: Any) -> Any:
    """RFC 6902 operations add, remove, replace, move, copy and test."""
    if not isinstance(operations, list):
        raise bad_request("json patch must be a list of operations")
    doc = clone(target)
    for op in operations:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise bad_request(f"invalid JSON patch operation: {op!r}")
        kind = op["op"]
        parts = _pointer(op["path"])
        if kind in ("add", "replace"):
            if "value" not in op:
                raise bad_request(f"JSON patch {kind} operation without a value: {op!r}")
            doc = _add(doc, parts, clone(op["value"]), replace=kind == "replace")
        elif kind == "remove":
            _remove(doc, parts)
        elif kind in ("move", "copy"):
            source = _pointer(op.get("from", ""))
            value = _remove(doc, source) if kind == "move" else clone(_get(doc, source))
            doc = _add(doc, parts, value, replace=False)
        elif kind == "test":
            if _get(doc, parts) != op.get("value"):
                raise _patch_error(f"testing value {op['path']} failed")
        else:
            raise bad_request(f"Unexpected kind: {kind}")
    return doc


def apply_patch(content_type: str, target: Any, body: Any) -> Any:
    """Apply a PATCH body of the given media type to target (a copy is returned)."""
    media = content_type.split(";", 1)[0].strip().lower()
    if media == MERGE:
        return merge_patch(target, body)
    if media == JSON_PATCH:
        return json_patch(target, body)
    if media == STRATEGIC:
        return strategic_merge_patch(target, body)
    raise ApiError(
        415,
        f"the body of the request was in an unknown format - accepted media types include: "
        f"{JSON_PATCH}, {MERGE}, {APPLY}, {STRATEGIC}",
    )
