"""Resource semantics shared by HTTP and direct calls: defaults, validation, RVs, conflicts, GC.

Objects are stored in one internal form (v1 for resource.k8s.io); every method takes the served
``version`` of its body and answer, converting on the way in and out.
"""

from __future__ import annotations

import builtins
import secrets
import uuid
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from agent.emulator import authz, slice_rules, validation
from agent.emulator.apply import Applied, check_config, schema_error
from agent.emulator.apply import apply as apply_config
from agent.emulator.apply import update as update_managed
from agent.emulator.conversion import from_internal, to_internal
from agent.emulator.errors import ApiError, already_exists, bad_request, conflict, gone, invalid, not_found
from agent.emulator.patch import apply_patch
from agent.emulator.resources import (
    EVENTS_GROUP,
    RESOURCE_GROUP,
    RESOURCE_TYPES,
    ResourceType,
    dra_versions,
    minor_of,
)
from agent.emulator.schema import prune_unknown, type_error
from agent.emulator.selectors import matcher
from agent.emulator.store import ObjectKey, Store, StoredEvent, clone

JSON = dict[str, Any]

_NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # the apiserver's generateName alphabet
_GENERATED_PREFIX_MAX = 63 - 5
DEFAULT_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")

#: Feature gates and their defaults up to 1.35 (DRADeviceTaints on, as the brief pins).
DEFAULT_GATES: Mapping[str, bool] = {
    "DRADeviceTaints": True,
    "DRAResourceClaimDeviceStatus": True,
    "DRAAdminAccess": True,
    "DRAPrioritizedList": True,
    "DRAPartitionableDevices": False,
    "DRAConsumableCapacity": False,
    "DRADeviceBindingConditions": False,
    "DRAListTypeAttributes": False,
}
#: What changed in 1.36 (upstream ``pkg/features/kube_features.go``): DRAConsumableCapacity,
#: DRADeviceBindingConditions, DRAPartitionableDevices, DRADeviceTaints and DRAExtendedResource
#: are beta and on by default; DRAListTypeAttributes is new, alpha and off; DRADeviceTaintRules is
#: beta but off (its v1beta2 API is off by default); DRAResourceClaimGranularStatusAuthorization is
#: new, beta and on (`agent.emulator.authz`).
_GATES_1_36: Mapping[str, bool] = {
    "DRAPartitionableDevices": True,
    "DRAConsumableCapacity": True,
    "DRADeviceBindingConditions": True,
    "DRAExtendedResource": True,
    "DRADeviceTaintRules": False,
    "DRAResourceClaimGranularStatusAuthorization": True,
}


#: What changed in 1.37 (upstream ``pkg/features/kube_features.go``, 1.37 line): DRADeviceTaints and
#: DRADeviceTaintRules are GA and on (DeviceTaintRule in resource.k8s.io/v1); DRAExtendedResource and
#: DRAResourceClaimDeviceStatus are GA and locked on; DRAFractionalCapacityRange is new, beta and on;
#: DRAWorkloadResourceClaims is beta but off; the new DRAOptionalNodeOperations,
#: DRADerivedAttributes, DRADeviceCompatibilityGroups and DRAPartitionableDevicesType are alpha.
_GATES_1_37: Mapping[str, bool] = {
    "DRADeviceTaintRules": True,
    "DRAFractionalCapacityRange": True,
    "DRAWorkloadResourceClaims": False,
    "DRAOptionalNodeOperations": False,
    "DRADerivedAttributes": False,
    "DRADeviceCompatibilityGroups": False,
    "DRAPartitionableDevicesType": False,
    "DRANodeAllocatableResources": False,
}
#: Gates a release locks to their default (``LockToDefault``): setting another value is refused, as
#: kube-apiserver refuses to start (``cannot set feature gate X to false, feature is locked to true``).
_LOCKED_1_37: Mapping[str, bool] = {
    "DRAExtendedResource": True,
    "DRAResourceClaimDeviceStatus": True,
    "DRAPrioritizedList": True,
    "DRAAdminAccess": True,
}


def default_gates(release: str) -> dict[str, bool]:
    """The feature gates a release has on by default."""
    minor = minor_of(release)
    return {
        **DEFAULT_GATES,
        **(_GATES_1_36 if minor >= 36 else {}),
        **(_GATES_1_37 if minor >= 37 else {}),
    }


def locked_gates(release: str) -> dict[str, bool]:
    """The gates a release locks to their default value (only the 1.37 locks are emulated)."""
    return dict(_LOCKED_1_37) if minor_of(release) >= 37 else {}


def check_gate(release: str, name: str, enabled: bool) -> None:
    """Refuse a locked gate set to the other value (``featuregate.Set``)."""
    locked = locked_gates(release)
    if name in locked and locked[name] != enabled:
        value = "true" if enabled else "false"
        lock = "true" if locked[name] else "false"
        raise ValueError(f"cannot set feature gate {name} to {value}, feature is locked to {lock}")


GRANULAR_STATUS = "DRAResourceClaimGranularStatusAuthorization"
_PARTITIONABLE_DEVICE_FIELDS = ("consumesCounters", "nodeName", "nodeSelector", "allNodes")
_BINDING_FIELDS = ("bindsToNode", "bindingConditions", "bindingFailureConditions")
_NODE_ALLOCATABLE_FIELDS = ("nodeAllocatableResourceMappings", "nodeAllocatableResources")
#: 1.37 slice spec fields and the alpha gates without which they are dropped (unless in use).
_SPEC_GATES = {
    "partitionTypeAttribute": "DRAPartitionableDevicesType",
    "skipNodeOperations": "DRAOptionalNodeOperations",
}


def _partitionable_in_use(old_spec: Mapping[str, Any]) -> bool:
    """``draPartitionableDevicesFeatureInUse`` of upstream ``resourceslice/strategy.go``."""
    if old_spec.get("sharedCounters") or old_spec.get("perDeviceNodeSelection") is not None:
        return True
    return any(
        isinstance(d, dict)
        and (d.get("consumesCounters") or any(d.get(f) is not None for f in _PARTITIONABLE_DEVICE_FIELDS[1:]))
        for d in old_spec.get("devices") or []
    )


def rfc3339(seconds: float) -> str:
    """A timestamp as the apiserver writes ``metav1.Time`` (seconds, UTC, ``Z``)."""
    return datetime.fromtimestamp(int(seconds), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def store_key(rtype: ResourceType) -> str:
    """Where objects of a type live; both Event APIs share one store, as in the apiserver."""
    group = "" if rtype.group == EVENTS_GROUP else rtype.group
    return f"{group}/{rtype.plural}"


class Registry:
    """The resource layer of the emulated apiserver."""

    def __init__(
        self,
        store: Store,
        release: str,
        dra: bool,
        gates: Mapping[str, bool],
        now: Callable[[], float],
    ) -> None:
        self.store = store
        self.release = release
        self.dra = dra
        for name, enabled in gates.items():
            check_gate(release, name, enabled)
        self.gates: dict[str, bool] = {**default_gates(release), **gates}
        if release == "1.32":
            # 1.32 has no device taints at all: the field does not exist in its API.
            self.gates["DRADeviceTaints"] = False
        self._now = now
        #: ``fieldValidation`` of the current request (Strict, Warn or Ignore) and its warnings.
        self.field_validation = "Warn"
        self.warnings: builtins.list[str] = []
        self.requester: tuple[authz.Identity, str] | None = None
        """Who makes the request being served and with which verb (None: the administrator)."""
        #: Keys the current request's JSON body gave twice (``duplicate field`` of the decoder).
        self.duplicate_fields: builtins.list[str] = []
        for name in DEFAULT_NAMESPACES:
            self.create(self.type_for("", "namespaces"), "v1", {"metadata": {"name": name}})

    # ----- types and versions
    def rules(self) -> validation.Rules:
        """Release- and gate-dependent validation rules."""
        return validation.Rules(self.release, dict(self.gates))

    def served_versions(self, group: str) -> tuple[str, ...]:
        """Versions of a group served now, in preference order."""
        if group == RESOURCE_GROUP:
            return dra_versions(self.release, self.dra)
        return ("v1",)

    def served_types(self, group: str, version: str) -> builtins.list[ResourceType]:
        """Resource types served in group/version."""
        if version not in self.served_versions(group):
            return []
        return [
            t
            for t in RESOURCE_TYPES
            if t.group == group
            and t.served_in(version, self.release)
            and (not t.gate or self.gates.get(t.gate, False))
            and not (t.plural == "devicetaintrules" and not self._taint_rules_served())
        ]

    def _taint_rules_served(self) -> bool:
        """From 1.37 (GA, on by default) DeviceTaintRules also follow their own gate."""
        return minor_of(self.release) < 37 or self.gates.get("DRADeviceTaintRules", False)

    def type_for(self, group: str, plural: str) -> ResourceType:
        """A resource type by group and plural name (served or not)."""
        for rtype in RESOURCE_TYPES:
            if rtype.group == group and rtype.plural == plural:
                return rtype
        raise not_found(plural, group, "")

    def serving(self, group: str, version: str, plural: str) -> ResourceType | None:
        """The type served at this URL, or None (the apiserver answers 404)."""
        return next((t for t in self.served_types(group, version) if t.plural == plural), None)

    # ----- reads
    def get(self, rtype: ResourceType, version: str, namespace: str, name: str) -> JSON:
        """An object in the served version; 404 when absent."""
        obj = self.store.get(store_key(rtype), (namespace, name))
        if obj is None:
            raise not_found(rtype.plural, rtype.group, name)
        return from_internal(rtype, version, obj)

    def list(
        self,
        rtype: ResourceType,
        version: str,
        namespace: str,
        field_selector: str | None = None,
        label_selector: str | None = None,
    ) -> tuple[builtins.list[JSON], int]:
        """Matching objects in the served version and the list's resourceVersion."""
        match = matcher(rtype, field_selector, label_selector, self.release)
        items = [
            from_internal(rtype, version, obj)
            for (ns, _), obj in self.store.items(store_key(rtype))
            if (not namespace or ns == namespace) and match(obj)
        ]
        return items, self.store.revision

    def check_resource_version(self, rv: str) -> int:
        """Parse a resourceVersion query value; 410 when it was compacted away."""
        try:
            value = int(rv)
        except ValueError:
            raise bad_request(f"invalid resource version {rv!r}") from None
        if value < self.store.compacted and value != 0:
            raise gone(f"too old resource version: {value} ({self.store.compacted})")
        return value

    def events_for(self, rtype: ResourceType, after: int) -> builtins.list[StoredEvent]:
        """History of one type after a resourceVersion."""
        key = store_key(rtype)
        return [e for e in self.store.events_after(after) if e.resource == key]

    # ----- writes
    def create(
        self,
        rtype: ResourceType,
        version: str,
        body: JSON,
        *,
        namespace: str = "",
        dry_run: bool = False,
        managed_fields: builtins.list[JSON] | None = None,
        manager: str | None = None,
    ) -> JSON:
        """Create an object (generateName, uid, timestamps, defaults, validation).

        ``manager`` (the request's fieldManager or user-agent prefix) becomes an ``Update`` entry of
        ``metadata.managedFields`` owning every field set; None (direct calls) records nothing."""
        obj = self._decode(rtype, version, body, namespace)
        sent_managed = _managed_base(obj["metadata"].get("managedFields"), [])
        meta = obj["metadata"]
        if meta.get("resourceVersion"):
            raise bad_request("resourceVersion should not be set on objects to be created")
        if rtype.namespaced and rtype.plural != "namespaces":
            self._require_namespace(meta["namespace"])
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = self._generate_name(
                rtype, meta["namespace"] if rtype.namespaced else "", meta["generateName"]
            )
        for field in ("uid", "deletionTimestamp", "deletionGracePeriodSeconds", "managedFields", "selfLink"):
            meta.pop(field, None)
        if managed_fields:
            meta["managedFields"] = managed_fields
        elif sent_managed:
            meta["managedFields"] = sent_managed
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = rfc3339(self._now())
        if rtype.has_generation:
            meta["generation"] = 1
        if rtype.has_status and rtype.plural not in ("nodes", "namespaces"):
            obj.pop("status", None)  # status is written only through the status subresource
        if rtype.plural == "namespaces":
            obj["status"] = {"phase": "Active"}
            obj.setdefault("spec", {"finalizers": ["kubernetes"]})
        self._prepare(rtype, obj, None)
        if manager is not None and not managed_fields:
            self._track(rtype, version, obj, None, managed=sent_managed, manager=manager, subresource="")
        self._validate(rtype, obj, None)
        key = self._key(rtype, obj)
        if self.store.get(store_key(rtype), key) is not None:
            raise already_exists(rtype.plural, rtype.group, key[1])
        if dry_run:
            return from_internal(rtype, version, obj)
        stored = self.store.put(store_key(rtype), key, obj)
        if meta.get("ownerReferences"):
            self.collect_garbage()  # a dependent of an owner that does not exist is collected
        return from_internal(rtype, version, stored)

    def update(
        self,
        rtype: ResourceType,
        version: str,
        name: str,
        body: JSON,
        *,
        namespace: str = "",
        subresource: str = "",
        dry_run: bool = False,
        manager: str | None = None,
    ) -> JSON:
        """PUT: optimistic concurrency on resourceVersion; status and spec are split by subresource."""
        obj = self._decode(rtype, version, body, namespace)
        meta = obj["metadata"]
        if meta.get("name") and meta["name"] != name:
            raise bad_request(
                f"the name of the object ({meta['name']}) does not match the name on the URL ({name})"
            )
        meta["name"] = name
        key = self._key(rtype, obj)
        old = self.store.get(store_key(rtype), key)
        if old is None:
            if rtype.allow_create_on_update and not subresource:
                return self.create(
                    rtype, version, body, namespace=namespace, dry_run=dry_run, manager=manager
                )
            raise not_found(rtype.plural, rtype.group, name)
        return self._write_update(
            rtype, version, key, old, obj, subresource=subresource, dry_run=dry_run, manager=manager
        )

    def patch(
        self,
        rtype: ResourceType,
        version: str,
        name: str,
        content_type: str,
        body: Any,
        *,
        namespace: str = "",
        subresource: str = "",
        dry_run: bool = False,
        manager: str | None = None,
    ) -> JSON:
        """PATCH in the served version's shape (merge, JSON patch or strategic merge)."""
        key = (namespace if rtype.namespaced else "", name)
        old = self.store.get(store_key(rtype), key)
        if old is None:
            raise not_found(rtype.plural, rtype.group, name)
        current = from_internal(rtype, version, old)
        patched = apply_patch(content_type, current, body)
        if not isinstance(patched, dict):
            raise bad_request("the patched object is not a JSON object")
        patched_meta = patched.setdefault("metadata", {})
        if patched_meta.get("name", name) != name:
            raise bad_request(
                f"the name of the object ({patched_meta['name']}) does not match the name on the URL ({name})"
            )
        obj = self._decode(rtype, version, patched, namespace)
        # A patch with a resourceVersion is conditional; the current one is implied otherwise.
        return self._write_update(
            rtype, version, key, old, obj, subresource=subresource, dry_run=dry_run, manager=manager
        )

    def apply(
        self,
        rtype: ResourceType,
        version: str,
        name: str,
        config: Any,
        *,
        manager: str,
        force: bool = False,
        namespace: str = "",
        subresource: str = "",
        dry_run: bool = False,
    ) -> tuple[JSON, bool]:
        """Server-side apply (see `agent.emulator.apply`); returns the object and whether it was created."""
        if not isinstance(config, dict):
            raise bad_request("the applied configuration must be an object")
        check_config(config, rtype.api_version(version), rtype.kind)
        config = clone(config)
        unknown = prune_unknown(rtype, version, clone(config), minor_of(self.release))
        if unknown:
            raise schema_error(unknown, rtype.api_version(version), rtype.kind)
        meta = config.setdefault("metadata", {})
        if not isinstance(meta, dict) or meta.get("name", name) != name:
            raise bad_request(
                f"the name of the object ({meta.get('name') if isinstance(meta, dict) else meta}) does not "
                f"match the name on the URL ({name})"
            )
        meta["name"] = name
        key = (namespace if rtype.namespaced else "", name)
        old = self.store.get(store_key(rtype), key)

        def run(current: JSON) -> Applied:
            return apply_config(
                current,
                config,
                manager=manager,
                api_version=rtype.api_version(version),
                force=force,
                subresource=subresource,
                now=rfc3339(self._now()),
            )

        if old is None:
            if subresource:
                raise not_found(rtype.plural, rtype.group, name)
            fresh = run({"metadata": {"name": name}})
            created = self.create(
                rtype,
                version,
                fresh.obj,
                namespace=namespace,
                dry_run=dry_run,
                managed_fields=fresh.managed_fields,
            )
            return created, True
        result = run(from_internal(rtype, version, old))
        result.obj["metadata"]["managedFields"] = result.managed_fields
        obj = self._decode(rtype, version, result.obj, namespace)
        written = self._write_update(
            rtype, version, key, old, obj, subresource=subresource, dry_run=dry_run, applied=True
        )
        return written, False

    def _write_update(
        self,
        rtype: ResourceType,
        version: str,
        key: ObjectKey,
        old: JSON,
        obj: JSON,
        *,
        subresource: str,
        dry_run: bool,
        manager: str | None = None,
        applied: bool = False,
    ) -> JSON:
        meta = obj["metadata"]
        old_meta = old["metadata"]
        live_managed = old_meta.get("managedFields") or []
        # decodeLiveOrNew (managedfields/internal/fieldmanager.go): a subresource never sets them;
        # a body without them keeps the live ones; [] or [{}] resets them.
        if applied:
            managed = meta.get("managedFields") or []
        elif subresource:
            managed = clone(live_managed)
        else:
            managed = _managed_base(meta.get("managedFields"), live_managed)
        name = key[1]
        rv = meta.get("resourceVersion")
        if rv and rv != old_meta["resourceVersion"]:
            raise conflict(
                rtype.plural,
                rtype.group,
                name,
                "the object has been modified; please apply your changes to the latest version and try again",
            )
        if meta.get("uid") and meta["uid"] != old_meta["uid"]:
            raise conflict(
                rtype.plural,
                rtype.group,
                name,
                f"Precondition failed: UID in precondition: {meta['uid']}, "
                f"UID in object meta: {old_meta['uid']}",
            )
        if subresource == "status":
            new = clone(old)
            if "status" in obj:
                new["status"] = obj["status"]
            else:
                new.pop("status", None)
        else:
            new = obj
            for field in (
                "uid",
                "creationTimestamp",
                "deletionTimestamp",
                "deletionGracePeriodSeconds",
                "generation",
            ):
                if field in old_meta:
                    meta[field] = old_meta[field]
                else:
                    meta.pop(field, None)
            if rtype.has_status:
                if "status" in old:
                    new["status"] = clone(old["status"])
                else:
                    new.pop("status", None)
            if old_meta.get("deletionTimestamp") and set(meta.get("finalizers") or []) - set(
                old_meta.get("finalizers") or []
            ):
                raise ApiError(422, "no new finalizers can be added if the object is being deleted")
        new["metadata"]["resourceVersion"] = old_meta["resourceVersion"]
        new["metadata"].pop("managedFields", None)
        if managed:
            new["metadata"]["managedFields"] = managed
        self._prepare(rtype, new, old)
        if manager is not None:
            self._track(rtype, version, new, old, managed=managed, manager=manager, subresource=subresource)
        if rtype.has_generation and _spec_of(new) != _spec_of(old):
            new["metadata"]["generation"] = int(old_meta.get("generation", 1)) + 1
        self._validate(rtype, new, old)
        if new == old or dry_run:
            # The apiserver does not write (nor bump the resourceVersion) when nothing changed.
            return from_internal(rtype, version, new)
        if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
            self.store.put(store_key(rtype), key, new)
            gone_obj = self.store.remove(store_key(rtype), key)
            self.collect_garbage()
            return from_internal(rtype, version, gone_obj)
        return from_internal(rtype, version, self.store.put(store_key(rtype), key, new))

    def delete(
        self,
        rtype: ResourceType,
        version: str,
        name: str,
        *,
        namespace: str = "",
        preconditions: Mapping[str, Any] | None = None,
        dry_run: bool = False,
    ) -> JSON:
        """DELETE with uid/resourceVersion preconditions; objects with finalizers are only marked."""
        key = (namespace if rtype.namespaced else "", name)
        old = self.store.get(store_key(rtype), key)
        if old is None:
            raise not_found(rtype.plural, rtype.group, name)
        meta = old["metadata"]
        pre = preconditions or {}
        if pre.get("uid") and pre["uid"] != meta["uid"]:
            raise conflict(
                rtype.plural,
                rtype.group,
                name,
                f"Precondition failed: UID in precondition: {pre['uid']}, UID in object meta: {meta['uid']}",
            )
        if pre.get("resourceVersion") and pre["resourceVersion"] != meta["resourceVersion"]:
            raise conflict(
                rtype.plural,
                rtype.group,
                name,
                f"Precondition failed: ResourceVersion in precondition: {pre['resourceVersion']}, "
                f"ResourceVersion in object meta: {meta['resourceVersion']}",
            )
        if dry_run:
            return self._deleted_answer(rtype, version, old)
        if meta.get("finalizers"):
            if meta.get("deletionTimestamp"):
                return self._deleted_answer(rtype, version, old)
            marked = clone(old)
            marked["metadata"]["deletionTimestamp"] = rfc3339(self._now())
            marked["metadata"]["deletionGracePeriodSeconds"] = 0
            return from_internal(rtype, version, self.store.put(store_key(rtype), key, marked))
        gone_obj = self.store.remove(store_key(rtype), key)
        self.collect_garbage()
        return self._deleted_answer(rtype, version, gone_obj)

    def _deleted_answer(self, rtype: ResourceType, version: str, obj: JSON) -> JSON:
        if rtype.return_deleted:
            return from_internal(rtype, version, obj)
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Success",
            "details": {"name": obj["metadata"]["name"], "kind": rtype.plural, "uid": obj["metadata"]["uid"]}
            | ({"group": rtype.group} if rtype.group else {}),
        }

    def delete_collection(
        self,
        rtype: ResourceType,
        version: str,
        *,
        namespace: str = "",
        field_selector: str | None = None,
        label_selector: str | None = None,
        dry_run: bool = False,
    ) -> builtins.list[JSON]:
        """Delete every matching object; returns them (in the served version)."""
        items, _ = self.list(rtype, version, namespace, field_selector, label_selector)
        out: builtins.list[JSON] = []
        for item in items:
            meta = item["metadata"]
            try:
                self.delete(
                    rtype, version, meta["name"], namespace=meta.get("namespace", ""), dry_run=dry_run
                )
                out.append(item)
            except ApiError as error:
                if error.code != 404:
                    raise
        return out

    # ----- garbage collection
    def collect_garbage(self) -> int:
        """Delete dependents whose owners are all gone (cascading), drop dangling owner references."""
        total = 0
        while deleted := self._collect_once():
            total += deleted
        return total

    def _collect_once(self) -> int:
        owners: dict[str, tuple[str, str]] = {}
        for resource in self.store.all_resources():
            for _, obj in self.store.items(resource):
                meta = obj["metadata"]
                owners[meta["uid"]] = (obj.get("kind", ""), meta["name"])
        deleted = 0
        for resource in list(self.store.all_resources()):
            for key, obj in list(self.store.items(resource)):
                refs = obj["metadata"].get("ownerReferences") or []
                if not refs:
                    continue
                live = [r for r in refs if owners.get(r.get("uid", "")) == (r.get("kind"), r.get("name"))]
                if not live:
                    self.store.remove(resource, key)
                    deleted += 1
                elif len(live) != len(refs):
                    patched = clone(obj)
                    patched["metadata"]["ownerReferences"] = live
                    self.store.put(resource, key, patched)
        return deleted

    # ----- helpers
    def _decode(self, rtype: ResourceType, version: str, body: Any, namespace: str) -> JSON:
        if not isinstance(body, dict):
            raise bad_request("the body of the request must be a JSON object")
        api_version = body.get("apiVersion")
        if api_version and api_version != rtype.api_version(version):
            raise bad_request(
                f"the API version in the data ({api_version}) does not match the expected API version "
                f"({rtype.api_version(version)})"
            )
        if body.get("kind") and body["kind"] != rtype.kind:
            raise bad_request(
                f"the kind in the data ({body['kind']}) does not match the expected kind ({rtype.kind})"
            )
        body = clone(body)  # the only copy: pruning and conversion below work in place
        problems = [f'duplicate field "{d}"' for d in self.duplicate_fields]
        problems += [
            f'unknown field "{u}"' for u in prune_unknown(rtype, version, body, minor_of(self.release))
        ]
        if problems and self.field_validation == "Strict":
            raise bad_request(
                f'{rtype.kind} in version "{version}" cannot be handled as a {rtype.kind}: '
                f"strict decoding error: {', '.join(problems)}"
            )
        if self.field_validation != "Ignore":
            self.warnings += problems
        obj = to_internal(rtype, version, body, in_place=True)
        obj["kind"] = rtype.kind
        if not isinstance(obj.get("metadata", {}), dict):
            raise bad_request("metadata must be a JSON object")
        problem = type_error(rtype.plural, obj)
        if problem is not None:
            raise bad_request(
                f'{rtype.kind} in version "{version}" cannot be handled as a {rtype.kind}: json: {problem}'
            )
        meta = obj.get("metadata")
        if meta is None:
            meta = obj["metadata"] = {}
        if not isinstance(meta, dict):
            raise bad_request("metadata must be a JSON object")
        if not rtype.namespaced:
            # rest.BeforeCreate/BeforeUpdate clear the namespace of cluster-scoped objects.
            meta.pop("namespace", None)
        if rtype.namespaced:
            if meta.get("namespace") and namespace and meta["namespace"] != namespace:
                raise bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request"
                )
            meta["namespace"] = meta.get("namespace") or namespace
            if not meta["namespace"]:
                raise bad_request("the namespace of the object must be set for a namespaced resource")
        return obj

    def _key(self, rtype: ResourceType, obj: JSON) -> ObjectKey:
        meta = obj["metadata"]
        return (meta.get("namespace", "") if rtype.namespaced else "", meta.get("name", ""))

    def _require_namespace(self, namespace: str) -> None:
        if self.store.get("/namespaces", ("", namespace)) is None:
            raise not_found("namespaces", "", namespace)

    def _generate_name(self, rtype: ResourceType, namespace: str, prefix: str) -> str:
        # names.SimpleNameGenerator (apiserver/pkg/storage/names/generate.go): the prefix is cut to
        # 58 bytes and 5 random characters are appended, so a generated name is at most 63 long.
        base = prefix[:_GENERATED_PREFIX_MAX]
        while True:
            name = base + "".join(secrets.choice(_NAME_ALPHABET) for _ in range(5))
            if self.store.get(store_key(rtype), (namespace, name)) is None:
                return name

    def _prepare(self, rtype: ResourceType, obj: JSON, old: JSON | None) -> None:
        """Drop fields of disabled gates (unless already in use) and apply defaults."""
        if rtype.plural == "resourceslices":
            self._prepare_slice(obj, old)
        elif rtype.plural == "resourceclaims":
            _default_requests(obj.get("spec"))
            status = obj.get("status")
            keep = bool(((old or {}).get("status") or {}).get("devices"))
            if isinstance(status, dict) and not self.gates["DRAResourceClaimDeviceStatus"] and not keep:
                status.pop("devices", None)
            if isinstance(status, dict) and not self.gates.get("DRAConsumableCapacity"):
                _drop_share_ids(status, old)
        elif rtype.plural == "resourceclaimtemplates":
            _default_requests((obj.get("spec") or {}).get("spec"))
        elif rtype.plural == "devicetaintrules":
            item = (obj.get("spec") or {}).get("taint")
            if isinstance(item, dict):
                _drop_empty_value(item)
            if isinstance(item, dict) and not item.get("timeAdded"):
                item["timeAdded"] = _old_time(old, None) or rfc3339(self._now())
            elif isinstance(item, dict):
                item["timeAdded"] = _normalize_time(item["timeAdded"])

    def _prepare_slice(self, obj: JSON, old: JSON | None) -> None:
        """``dropDisabledFields`` of upstream ``registry/resource/resourceslice/strategy.go``, then the
        defaults and canonical quantities the apiserver stores."""
        spec = obj.get("spec")
        if not isinstance(spec, dict):
            return
        old_spec = (old or {}).get("spec") or {}
        old_devices: builtins.list[Any] = old_spec.get("devices") or []
        used = {field for d in old_devices if isinstance(d, dict) for field in d}
        used |= {
            kind
            for d in old_devices
            if isinstance(d, dict)
            for a in (d.get("attributes") or {}).values()
            if isinstance(a, dict)
            for kind in a
        }

        def in_use(field: str) -> bool:
            return field in used

        # draConsumableCapacityFeatureInUse: either field anywhere in the old slice keeps both.
        consumable_in_use = in_use("allowMultipleAllocations") or any(
            isinstance(cap, dict) and "requestPolicy" in cap
            for d in old_devices
            if isinstance(d, dict) and isinstance(d.get("capacity"), dict)
            for cap in d["capacity"].values()
        )

        gate = self.gates.get
        # Upstream asks whether the old slice uses any partitionable field at all, not each one.
        drop_partitionable = not gate("DRAPartitionableDevices") and not _partitionable_in_use(old_spec)
        if drop_partitionable:
            spec.pop("sharedCounters", None)
            spec.pop("perDeviceNodeSelection", None)
        for field, gate_name in _SPEC_GATES.items():
            if not gate(gate_name) and field not in old_spec:
                spec.pop(field, None)
        for counter_set in spec.get("sharedCounters") or []:
            if isinstance(counter_set, dict):
                _canonical_counters(counter_set.get("counters"))
        devices = spec.get("devices")
        if not isinstance(devices, list):
            return
        binding = bool(gate("DRADeviceBindingConditions") and gate("DRAResourceClaimDeviceStatus"))
        now = rfc3339(self._now())
        for device in devices:
            if not isinstance(device, dict):
                continue
            if not gate("DRADeviceTaints") and not in_use("taints"):
                device.pop("taints", None)
            if drop_partitionable:
                for field in _PARTITIONABLE_DEVICE_FIELDS:
                    device.pop(field, None)
            if not gate("DRANodeAllocatableResources"):
                for field in _NODE_ALLOCATABLE_FIELDS:
                    if not in_use(field):
                        device.pop(field, None)
            if not binding:
                for field in _BINDING_FIELDS:
                    if not in_use(field):
                        device.pop(field, None)
            consumable = gate("DRAConsumableCapacity") or consumable_in_use
            if not consumable:
                device.pop("allowMultipleAllocations", None)
            if not gate("DRAListTypeAttributes"):
                for attribute in (device.get("attributes") or {}).values():
                    for kind in slice_rules.LIST_ATTRIBUTE_FIELDS:
                        if isinstance(attribute, dict) and not in_use(kind):
                            attribute.pop(kind, None)
            for cap in (
                (device.get("capacity") or {}).values() if isinstance(device.get("capacity"), dict) else ()
            ):
                if not isinstance(cap, dict):
                    continue
                cap.setdefault("value", "0")  # a Quantity's zero value, as the apiserver stores {}
                cap["value"] = _canonical(cap["value"])
                if not consumable:
                    cap.pop("requestPolicy", None)
                _canonical_policy(cap.get("requestPolicy"))
            for consumption in device.get("consumesCounters") or []:
                if isinstance(consumption, dict):
                    _canonical_counters(consumption.get("counters"))
            for item in device.get("taints") or [] if isinstance(device.get("taints"), list) else []:
                if isinstance(item, dict):
                    item["timeAdded"] = _normalize_time(item.get("timeAdded")) or now
                    _drop_empty_value(item)

    def _track(
        self,
        rtype: ResourceType,
        version: str,
        obj: JSON,
        old: JSON | None,
        *,
        managed: builtins.list[JSON],
        manager: str,
        subresource: str,
    ) -> None:
        """Record ``manager``'s changes in ``metadata.managedFields`` (operation ``Update``)."""
        entries = update_managed(
            managed,
            old,
            obj,
            manager=manager,
            api_version=rtype.api_version(version),
            subresource=subresource,
            now=rfc3339(self._now()),
        )
        obj["metadata"].pop("managedFields", None)
        if entries:
            obj["metadata"]["managedFields"] = entries

    def _validate(self, rtype: ResourceType, obj: JSON, old: JSON | None) -> None:
        rules = self.rules()
        causes = validation.metadata(
            obj,
            namespaced=rtype.namespaced,
            name_rule="label" if rtype.plural == "namespaces" else "subdomain",
        )
        if rtype.plural == "resourceslices":
            causes += slice_rules.resource_slice(obj, old, rules)
        elif rtype.plural == "resourceclaims":
            causes += validation.resource_claim(obj)
            causes += validation.resource_claim_status(obj, old)
            if old is not None and self.requester is not None and self.gates.get(GRANULAR_STATUS):
                identity, verb = self.requester
                causes += authz.device_status(identity, verb, obj["metadata"].get("namespace", ""), obj, old)
            if old is not None and obj.get("spec") != old.get("spec"):
                causes.append(validation.immutable("spec", "<spec>"))
        elif rtype.plural == "devicetaintrules":
            causes += validation.device_taint_rule(obj, rules)
        elif rtype.plural == "deviceclasses":
            causes += validation.device_class(obj)
        elif rtype.plural == "events" and rtype.group != EVENTS_GROUP:
            causes += validation.event(obj)
        if old is not None:
            old_ns = old["metadata"].get("namespace")
            if old_ns != obj["metadata"].get("namespace"):
                causes.append(validation.immutable("metadata.namespace", obj["metadata"].get("namespace")))
        if causes:
            name = obj["metadata"].get("name") or obj["metadata"].get("generateName", "")
            raise invalid(rtype.kind, rtype.group, name, causes)


def _drop_share_ids(status: JSON, old: JSON | None) -> None:
    """``dropDisabledDRAResourceClaimConsumableCapacityStatusFields`` (resourceclaim/strategy.go): with
    DRAConsumableCapacity off, shares are dropped from the status unless the old claim used them."""
    old_status = (old or {}).get("status") or {}
    results = ((old_status.get("allocation") or {}).get("devices") or {}).get("results") or []
    in_use = any("shareID" in r or "consumedCapacity" in r for r in results if isinstance(r, dict))
    in_use |= any("shareID" in d for d in old_status.get("devices") or [] if isinstance(d, dict))
    requests = (((old or {}).get("spec") or {}).get("devices") or {}).get("requests") or []
    in_use |= any("capacity" in (r.get("exactly") or {}) for r in requests if isinstance(r, dict))
    if in_use:
        return
    allocation = status.get("allocation")
    results = ((allocation.get("devices") or {}).get("results") or []) if isinstance(allocation, dict) else []
    for result in results:
        if isinstance(result, dict):
            result.pop("shareID", None)
            result.pop("consumedCapacity", None)
    for entry in status.get("devices") or []:
        if isinstance(entry, dict):
            entry.pop("shareID", None)


def _managed_base(sent: object, live: builtins.list[JSON]) -> builtins.list[JSON]:
    """The managedFields an update starts from (upstream ``decodeLiveOrNew``)."""
    if isinstance(sent, list) and (not sent or sent == [{}]):
        return []
    if isinstance(sent, list) and all(isinstance(e, dict) and e.get("manager") for e in sent):
        return clone(sent)
    return clone(live)


def _drop_empty_value(taint: JSON) -> None:
    """``DeviceTaint.Value`` is ``json:"value,omitempty"``: an empty value is not stored."""
    if taint.get("value") == "":
        del taint["value"]


def _normalize_time(value: object) -> str | None:
    """Timestamps are stored as RFC 3339 in UTC with seconds, as ``metav1.Time`` marshals them."""
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return value  # validation reports it
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return rfc3339(parsed.timestamp())


def _canonical(value: Any) -> Any:
    """A quantity in the form the apiserver stores (unchanged when it does not parse)."""
    canonical = validation.canonical_quantity(value)
    return canonical if canonical is not None else value


def _canonical_counters(counters: Any) -> None:
    for counter in counters.values() if isinstance(counters, dict) else ():
        if isinstance(counter, dict) and "value" in counter:
            counter["value"] = _canonical(counter["value"])


def _canonical_policy(policy: Any) -> None:
    if not isinstance(policy, dict):
        return
    if "default" in policy:
        policy["default"] = _canonical(policy["default"])
    if isinstance(policy.get("validValues"), list):
        policy["validValues"] = [_canonical(v) for v in policy["validValues"]]
    valid_range = policy.get("validRange")
    for key in ("min", "max", "step"):
        if isinstance(valid_range, dict) and key in valid_range:
            valid_range[key] = _canonical(valid_range[key])


def _spec_of(obj: JSON) -> JSON:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status")}


def _old_time(old: JSON | None, _: object) -> str | None:
    item = ((old or {}).get("spec") or {}).get("taint") or {}
    value = item.get("timeAdded") if isinstance(item, dict) else None
    return value if isinstance(value, str) else None


def _default_requests(spec: Any) -> None:
    devices = spec.get("devices") if isinstance(spec, dict) else None
    requests = devices.get("requests") if isinstance(devices, dict) else None
    for request in requests if isinstance(requests, list) else []:
        exact = request.get("exactly") if isinstance(request, dict) else None
        if isinstance(exact, dict):
            exact.setdefault("allocationMode", "ExactCount")
            if exact["allocationMode"] == "ExactCount":
                exact.setdefault("count", 1)
