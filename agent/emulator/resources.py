"""The resource types the emulator serves, and which API versions each Kubernetes release serves."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

RESOURCE_GROUP = "resource.k8s.io"
EVENTS_GROUP = "events.k8s.io"

#: Versions of resource.k8s.io served per release, in preference order.
_DRA_VERSIONS: Mapping[str, tuple[str, ...]] = {
    "1.32": ("v1beta1",),
    "1.33": ("v1beta2", "v1beta1", "v1alpha3"),
    "1.34": ("v1", "v1beta2", "v1beta1", "v1alpha3"),
    "1.35": ("v1", "v1beta2", "v1beta1", "v1alpha3"),
    "1.36": ("v1", "v1beta2", "v1beta1", "v1alpha3"),
    # 1.37 still serves every version (v1beta1 goes in 1.38, v1beta2 in 1.39).
    "1.37": ("v1", "v1beta2", "v1beta1", "v1alpha3"),
}
SUPPORTED_RELEASES = tuple(_DRA_VERSIONS)
_PATCH_RELEASE = {"1.32": 4, "1.33": 5, "1.34": 2, "1.35": 0, "1.36": 2, "1.37": 0}

_META_NAME = ("metadata.name",)
_META_NS = ("metadata.name", "metadata.namespace")


@dataclass(frozen=True)
class ResourceType:
    """One resource (plural name) with its serving rules."""

    plural: str
    singular: str
    kind: str
    group: str
    namespaced: bool
    #: Versions this resource exists in (the release decides which are served).
    versions: tuple[str, ...]
    #: The internal (stored) version.
    storage_version: str
    field_selectors: tuple[str, ...]
    short_names: tuple[str, ...] = ()
    has_status: bool = False
    has_generation: bool = False
    #: DELETE answers with the deleted object instead of a Status (resource.k8s.io does).
    return_deleted: bool = False
    allow_create_on_update: bool = False
    #: A feature gate without which the resource is not served.
    gate: str = ""
    #: Versions added after the resource first appeared: version -> first release serving it.
    added_in: Mapping[str, str] = field(default_factory=dict)
    #: Field selectors added after the resource first appeared: field -> first release supporting it.
    selectors_added_in: Mapping[str, str] = field(default_factory=dict)

    def selects(self, field_name: str, release: str = "") -> bool:
        """Whether a release supports a field selector on this resource (all releases when "")."""
        if field_name in self.field_selectors:
            return True
        first = self.selectors_added_in.get(field_name)
        return first is not None and (not release or minor_of(release) >= minor_of(first))

    def served_in(self, version: str, release: str) -> bool:
        """Whether a release serves this resource in a version."""
        first = self.added_in.get(version)
        return version in self.versions and (first is None or minor_of(release) >= minor_of(first))

    def api_version(self, version: str) -> str:
        """``group/version`` (``v1`` for core)."""
        return f"{self.group}/{version}" if self.group else version


_EVENT_FIELDS = (
    *_META_NS,
    "involvedObject.kind",
    "involvedObject.namespace",
    "involvedObject.name",
    "involvedObject.uid",
    "involvedObject.apiVersion",
    "involvedObject.resourceVersion",
    "involvedObject.fieldPath",
    "reason",
    "reportingComponent",
    "source",
    "type",
)

_ALL_DRA = ("v1", "v1beta2", "v1beta1")

RESOURCE_TYPES: tuple[ResourceType, ...] = (
    ResourceType(
        "namespaces",
        "namespace",
        "Namespace",
        "",
        False,
        ("v1",),
        "v1",
        (*_META_NAME, "status.phase"),
        ("ns",),
        has_status=True,
    ),
    ResourceType(
        "nodes",
        "node",
        "Node",
        "",
        False,
        ("v1",),
        "v1",
        (*_META_NAME, "spec.unschedulable"),
        ("no",),
        has_status=True,
    ),
    ResourceType(
        "events",
        "event",
        "Event",
        "",
        True,
        ("v1",),
        "v1",
        _EVENT_FIELDS,
        ("ev",),
        allow_create_on_update=True,
    ),
    ResourceType(
        "events",
        "event",
        "Event",
        EVENTS_GROUP,
        True,
        ("v1",),
        "v1",
        _EVENT_FIELDS,
        ("ev",),
        allow_create_on_update=True,
    ),
    ResourceType(
        "resourceslices",
        "resourceslice",
        "ResourceSlice",
        RESOURCE_GROUP,
        False,
        _ALL_DRA,
        "v1",
        (*_META_NAME, "spec.nodeName", "spec.driver"),
        has_generation=True,
        return_deleted=True,
        # 1.37: ResourceSliceSelectableFields adds spec.pool.name (pkg/registry/resource/resourceslice).
        selectors_added_in={"spec.pool.name": "1.37"},
    ),
    ResourceType(
        "resourceclaims",
        "resourceclaim",
        "ResourceClaim",
        RESOURCE_GROUP,
        True,
        _ALL_DRA,
        "v1",
        _META_NS,
        has_status=True,
        has_generation=True,
        return_deleted=True,
    ),
    ResourceType(
        "resourceclaimtemplates",
        "resourceclaimtemplate",
        "ResourceClaimTemplate",
        RESOURCE_GROUP,
        True,
        _ALL_DRA,
        "v1",
        _META_NS,
        has_generation=True,
        return_deleted=True,
    ),
    ResourceType(
        "deviceclasses",
        "deviceclass",
        "DeviceClass",
        RESOURCE_GROUP,
        False,
        _ALL_DRA,
        "v1",
        _META_NAME,
        has_generation=True,
        return_deleted=True,
    ),
    ResourceType(
        "devicetaintrules",
        "devicetaintrule",
        "DeviceTaintRule",
        RESOURCE_GROUP,
        False,
        ("v1", "v1beta2", "v1alpha3"),
        "v1alpha3",
        _META_NAME,
        has_status=True,
        has_generation=True,
        return_deleted=True,
        gate="DRADeviceTaints",
        # The same shape as v1alpha3; 1.36 serves it as v1beta2 too, 1.37 (GA) as v1.
        added_in={"v1beta2": "1.36", "v1": "1.37"},
    ),
)


def minor_of(release: str) -> int:
    """The minor version of a release (36 for ``1.36``)."""
    return int(release.split(".")[1])


def git_version(release: str) -> str:
    """``/version``'s gitVersion for a release (``1.34`` -> ``v1.34.2``)."""
    return f"v{release}.{_PATCH_RELEASE.get(release, 0)}"


def dra_versions(release: str, dra: bool) -> tuple[str, ...]:
    """resource.k8s.io versions served by a release, in preference order."""
    if not dra:
        return ()
    return _DRA_VERSIONS[release]


def field_value(obj: Mapping[str, Any], path: str) -> str:
    """A field's value as the apiserver's field selectors see it ("" when absent)."""
    node: Any = obj
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return ""
        node = node[part]
    if isinstance(node, bool):
        return "true" if node else "false"
    if node is None:
        return ""
    if path == "source" and isinstance(node, Mapping):
        return str(node.get("component", ""))
    return str(node)
