"""Check a CDI spec against the CDI JSON schema and the rules the CDI library checks in code.

The schema is the vendored copy in ``tests/support/cdi_schema`` (see its README). The rules
the schema leaves out are those of ``tags.cncf.io/container-device-interface``:
``pkg/parser/parser.go`` (vendor, class and device names), ``pkg/cdi/container-edits.go``
(``KEY=value`` environment, hook names, non-empty paths, device node types and permissions).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # installed with kubernetes-validate
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7

SCHEMA_DIR = Path(__file__).parent / "cdi_schema"
HOOK_NAMES = {"prestart", "createRuntime", "createContainer", "startContainer", "poststart", "poststop"}
_VENDOR_OR_CLASS = re.compile(r"^[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?$")
_DEVICE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?$")


@functools.cache
def _validator() -> Any:
    def load(name: str) -> Any:
        return json.loads((SCHEMA_DIR / name).read_text())

    registry: Registry[Any] = Registry().with_resource(
        "defs.json", Resource.from_contents(load("defs.json"), default_specification=DRAFT7)
    )
    return jsonschema.Draft7Validator(load("schema.json"), registry=registry)


def _edit_problems(where: str, edits: Mapping[str, Any]) -> list[str]:
    problems = [f"{where}: env {e!r} is not KEY=value" for e in edits.get("env", []) if "=" not in e[1:]]
    for node in edits.get("deviceNodes", []):
        if not str(node.get("path", "")).startswith("/"):
            problems.append(f"{where}: device node path {node.get('path')!r} is not absolute")
        if node.get("type", "") not in ("", "b", "c", "u", "p"):
            problems.append(f"{where}: device node type {node['type']!r}")
        if set(node.get("permissions", "")) - set("rwm"):
            problems.append(f"{where}: device node permissions {node['permissions']!r}")
    for mount in edits.get("mounts", []):
        if not mount["hostPath"] or not mount["containerPath"]:
            problems.append(f"{where}: mount {mount} has an empty path")
    for hook in edits.get("hooks", []):
        if hook["hookName"] not in HOOK_NAMES:
            problems.append(f"{where}: hook name {hook['hookName']!r} is not one of {sorted(HOOK_NAMES)}")
        if not hook["path"].startswith("/"):
            problems.append(f"{where}: hook path {hook['path']!r} is not absolute")
    return problems


def cdi_problems(spec: Mapping[str, Any]) -> list[str]:
    """Every way `spec` breaks the CDI schema or the CDI library's rules; empty when it loads."""
    problems = [
        f"schema: {'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in _validator().iter_errors(dict(spec))
    ]
    if problems:
        return problems
    vendor, _, cls = str(spec["kind"]).partition("/")
    if not _VENDOR_OR_CLASS.match(vendor) or not _VENDOR_OR_CLASS.match(cls):
        problems.append(f"kind {spec['kind']!r} is not <vendor>/<class>")
    problems += _edit_problems("spec", spec.get("containerEdits") or {})
    for device in spec["devices"]:
        if not _DEVICE.match(device["name"]):
            problems.append(f"device name {device['name']!r}")
        problems += _edit_problems(f"device {device['name']}", device["containerEdits"])
    return problems
