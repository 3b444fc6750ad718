"""CDI specs for prepared claims: one transient spec file per claim under the CDI root.

Kind ``k8s.<driver>/claim``, file ``k8s.<driver>-claim_<claimUID>.yaml`` (YAML starting ``---``
whose body is one line of JSON: JSON is YAML, and the CDI library reads every spec file with its
YAML parser, ``ParseSpec`` in container-device-interface ``pkg/cdi/spec.go``; it renders ~15x
faster than YAML),
device names ``<claimUID>-<device>[-<shareID>]`` (a claim UID is never reused, so runtimes that
cache specs never hit a stale entry). ``cdiVersion`` is the lowest version the content needs, as
the CDI library's ``MinimumRequiredVersion`` chooses it. Writes are atomic (`agent.core.atomicfile`).

Specs compose: a container with several claims gets every claim's spec, and CDI applies them in
the order of the device IDs (``Cache.InjectDevices`` in container-device-interface
``pkg/cdi/cache.go``), keeping the last value of each variable (``addEnv`` in
``internal/ociedit/spec_editor.go``). So no variable of a spec lists the claim's devices: device
nodes and mounts say what a container has, and a variable is either the same in every claim
(``NVIDIA_VISIBLE_DEVICES=void``) or of its own per device (the fake's ``FAKE_DEVICE_*``,
`EMPTY_EDITS_ENV`).

Each spec carries its claim's checkpoint entry as a one-line JSON comment (`RECORD_PREFIX`): a
comment, because runtimes ignore it and it raises no ``cdiVersion``; the entry, so that a corrupt
checkpoint can be rebuilt from the specs that survive (`agent.claims.state.startup`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.core.atomicfile import TEMP_SUFFIX, remove_durably, write_atomic
from agent.core.backend import ContainerEdits, Hook
from agent.core.boundedfile import MIB, parse_json, read_text

CDI_CLASS = "claim"
EMPTY_EDITS_ENV = "DRA_CLAIM_DEVICE"
"""Prefix of the variable naming a device whose backend returned no edits (CDI rejects a device
without edits): ``DRA_CLAIM_DEVICE_<hash>=<qualified CDI ID>``, a variable of its own per device."""
RECORD_PREFIX = "# dra-agent claim: "
MAX_SPEC_BYTES = 4 * MIB
"""A claim has at most 32 devices: its spec is a few KiB even with every driver library mounted."""


def cdi_vendor(driver: str) -> str:
    """``k8s.<driver>``."""
    return f"k8s.{driver}"


def cdi_kind(driver: str) -> str:
    """``k8s.<driver>/claim``."""
    return f"{cdi_vendor(driver)}/{CDI_CLASS}"


def spec_file_name(driver: str, claim_uid: str) -> str:
    """The spec file of one claim (``GenerateTransientSpecName`` + ``.yaml``)."""
    return f"{cdi_vendor(driver)}-{CDI_CLASS}_{claim_uid.replace('/', '_')}.yaml"


def cdi_device_name(claim_uid: str, device: str, share_id: str | None = None) -> str:
    """``<claimUID>-<device>``, with ``-<shareID>`` for a shared device."""
    return f"{claim_uid}-{device}" + (f"-{share_id}" if share_id else "")


def qualified_device_id(driver: str, name: str) -> str:
    """``k8s.<driver>/claim=<name>``, the ID the kubelet hands to the runtime."""
    return f"{cdi_kind(driver)}={name}"


def empty_edits_env(driver: str, name: str) -> str:
    """``DRA_CLAIM_DEVICE_<12 hex digits of the SHA-256 of the qualified ID>=<qualified ID>``.

    Its own name per device (the qualified ID is unique on the node), so that the markers of two
    devices in one container never hide each other.
    """
    qualified = qualified_device_id(driver, name)
    digest = hashlib.sha256(qualified.encode()).hexdigest()[:12].upper()
    return f"{EMPTY_EDITS_ENV}_{digest}={qualified}"


@dataclass(frozen=True)
class CdiDevice:
    """One device of a claim's spec and the edits its backend returned."""

    name: str
    edits: ContainerEdits


def merged_env(edits: Sequence[ContainerEdits]) -> dict[str, str]:
    """Environment of all devices of a claim: list variables comma-joined, others first value wins.

    The join reaches one claim only: with two claims in a container, CDI keeps the last claim's
    value (see the module docstring), so no list variable may say which devices a container has.
    """
    env: dict[str, str] = {}
    list_vars = frozenset().union(*(e.list_env for e in edits)) if edits else frozenset()
    for edit in edits:
        for key, value in edit.env.items():
            if key in list_vars and key in env:
                present = env[key].split(",")
                env[key] = ",".join(present + [v for v in value.split(",") if v and v not in present])
            else:
                env.setdefault(key, value)
    return env


def _device_edits(edits: ContainerEdits, env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if env:
        out["env"] = [f"{k}={v}" for k, v in env.items()]
    nodes = []
    for node in edits.device_nodes:
        entry: dict[str, Any] = {"path": node.path}
        if node.host_path:
            entry["hostPath"] = node.host_path
        if node.type:
            entry["type"] = node.type
        if node.major is not None:
            entry["major"] = node.major
        if node.minor is not None:
            entry["minor"] = node.minor
        if node.permissions:
            entry["permissions"] = node.permissions
        nodes.append(entry)
    if nodes:
        out["deviceNodes"] = nodes
    if edits.mounts:
        out["mounts"] = [
            {"hostPath": m.host_path, "containerPath": m.container_path, "options": list(m.options)}
            for m in edits.mounts
        ]
    if edits.hooks:
        out["hooks"] = [_hook(h) for h in edits.hooks]
    return out


def _hook(hook: Hook) -> dict[str, Any]:
    entry: dict[str, Any] = {"hookName": hook.hook_name, "path": hook.path}
    if hook.args:
        entry["args"] = list(hook.args)
    if hook.env:
        entry["env"] = list(hook.env)
    return entry


def build_claim_spec(driver: str, devices: Sequence[CdiDevice]) -> dict[str, Any]:
    """The spec dict of one claim, ``cdiVersion`` set to the minimum its content needs.

    Each device carries the claim-wide merged environment: runtimes append every injected
    device's env and the last value wins, so per-device values would hide each other. Across
    claims no such merge is possible; the backends' variables compose by themselves (module
    docstring).
    """
    env = merged_env([d.edits for d in devices])
    spec: dict[str, Any] = {
        "cdiVersion": "",
        "kind": cdi_kind(driver),
        "devices": [{"name": d.name, "containerEdits": _device_edits(d.edits, env)} for d in devices],
    }
    for device in spec["devices"]:
        if not device["containerEdits"]:
            # CDI rejects a device without edits; name the device so the container can see it.
            device["containerEdits"] = {"env": [empty_edits_env(driver, device["name"])]}
    spec["cdiVersion"] = minimum_version(spec)
    return spec


def _all_edits(spec: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    edits = [spec.get("containerEdits") or {}]
    edits += [d.get("containerEdits") or {} for d in spec.get("devices", [])]
    return edits


def minimum_version(spec: Mapping[str, Any]) -> str:
    """The lowest CDI spec version that can express `spec` (0.3.0 ... 0.7.0)."""
    edits = _all_edits(spec)
    devices = spec.get("devices", [])
    if any(e.get("additionalGids") or e.get("intelRdt") for e in edits):
        return "0.7.0"
    class_part = str(spec.get("kind", "")).partition("/")[2]
    if spec.get("annotations") or any(d.get("annotations") for d in devices) or "." in class_part:
        return "0.6.0"
    if any(str(d.get("name", ""))[:1].isdigit() for d in devices) or any(
        n.get("hostPath") for e in edits for n in e.get("deviceNodes", [])
    ):
        return "0.5.0"
    if any(m.get("type") for e in edits for m in e.get("mounts", [])):
        return "0.4.0"
    return "0.3.0"


def render_spec(spec: Mapping[str, Any], record: Mapping[str, Any] | None = None) -> bytes:
    """A YAML document starting ``---`` as the CDI library writes it: the record comment, the spec as JSON."""
    header = "---\n"
    if record is not None:
        header += RECORD_PREFIX + json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n"
    # Compact: the C encoder (an indent would switch to the pure-Python one); read it with jq.
    return (header + json.dumps(spec, separators=(",", ":")) + "\n").encode()


class CdiSpecWriter:
    """Writes and removes the per-claim specs of one driver (blocking: call through a thread)."""

    def __init__(self, root: Path, driver: str) -> None:
        self.root = root
        self.driver = driver
        self._prefix = f"{cdi_vendor(driver)}-{CDI_CLASS}_"

    def spec_path(self, claim_uid: str) -> Path:
        """Where the claim's spec lives."""
        return self.root / spec_file_name(self.driver, claim_uid)

    def write_claim_spec(
        self, claim_uid: str, devices: Sequence[CdiDevice], record: Mapping[str, Any] | None = None
    ) -> Path:
        """Write (or replace) the claim's spec atomically; raises OSError with the temp file removed."""
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.spec_path(claim_uid)
        write_atomic(path, render_spec(build_claim_spec(self.driver, devices), record))
        return path

    def read_claim_record(self, claim_uid: str) -> object:
        """The record comment of the claim's spec (parsed JSON), None when it has none.

        Raises `agent.core.boundedfile.BoundedFileError` (unreadable, too large, not UTF-8, bad JSON).
        """
        path = self.spec_path(claim_uid)
        text = read_text(path, max_bytes=MAX_SPEC_BYTES, what="CDI spec")
        for line in text.splitlines():
            if line.startswith(RECORD_PREFIX):
                return parse_json(line[len(RECORD_PREFIX) :], path, what="claim record comment")
        return None

    def remove_claim_spec(self, claim_uid: str) -> bool:
        """Delete the claim's spec; False when there was none."""
        return remove_durably(self.spec_path(claim_uid))

    def has_claim_spec(self, claim_uid: str) -> bool:
        """Whether the claim's spec file exists."""
        return self.spec_path(claim_uid).is_file()

    def claim_spec_uids(self) -> set[str]:
        """Claim UIDs of the spec files of this driver found under the root."""
        if not self.root.is_dir():
            return set()
        return {
            p.name[len(self._prefix) : -len(".yaml")]
            for p in self.root.iterdir()
            if p.name.startswith(self._prefix) and p.name.endswith(".yaml")
        }

    def remove_temp_files(self) -> int:
        """Delete temp files a crash left behind mid-write; returns how many."""
        if not self.root.is_dir():
            return 0
        removed = 0
        for p in self.root.iterdir():
            if p.name.startswith("." + self._prefix) and p.name.endswith(TEMP_SUFFIX):
                p.unlink(missing_ok=True)
                removed += 1
        return removed
