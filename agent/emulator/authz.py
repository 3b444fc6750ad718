"""Who a request comes from and what it may do: bearer tokens, RBAC-like rules, and the per-driver
check of a claim's ``status.devices`` (granular status authorization).

Requests without a token, or with a token nobody registered, are the emulator's administrator:
everything is allowed, as before tokens existed. A token registered with `Identity` is held to its
rules, as RBAC holds a ServiceAccount to its ClusterRole: a verb on a resource (``resourceclaims/status``)
no rule grants is a 403 (``responsewriters.ForbiddenStatusError``, the message RBAC denials carry).

Granular status authorization (``DRAResourceClaimGranularStatusAuthorization``, beta and on from
1.36; upstream ``pkg/registry/resource/authz.go``, ``AuthorizedForDeviceStatus``): a write to a
claim's status that adds, changes or removes ``status.devices`` entries of a driver also needs
the verb ``associated-node:<verb>`` (a ServiceAccount whose bound token names the node the claim
is allocated to) or ``arbitrary-node:<verb>`` on the synthetic ``resourceclaims/driver``
subresource named after that driver. A refusal is a field error (422), not a 403.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.emulator.errors import ApiError, Cause
from agent.emulator.validation import forbidden

JSON = dict[str, Any]

ASSOCIATED_NODE = "associated-node:"
ARBITRARY_NODE = "arbitrary-node:"


@dataclass(frozen=True)
class Rule:
    """One RBAC ``PolicyRule``: verbs on resources (``x`` or ``x/sub``), optionally only `names`."""

    verbs: tuple[str, ...]
    resources: tuple[str, ...]
    names: tuple[str, ...] = ()

    @classmethod
    def from_policy(cls, rule: Mapping[str, Any]) -> Rule:
        """A rule of a ClusterRole as the chart renders it."""
        return cls(
            tuple(rule.get("verbs") or ()),
            tuple(rule.get("resources") or ()),
            tuple(rule.get("resourceNames") or ()),
        )

    def grants(self, verb: str, resource: str, name: str) -> bool:
        return (
            (verb in self.verbs or "*" in self.verbs)
            and (resource in self.resources or "*" in self.resources)
            and (not self.names or name in self.names)
        )


@dataclass(frozen=True)
class Identity:
    """The user a bearer token authenticates: a ServiceAccount, with the node its token is bound to."""

    user: str
    rules: tuple[Rule, ...]
    node: str = ""
    """The ``authentication.kubernetes.io/node-name`` extra of a token bound to a pod on that node."""

    def allows(self, verb: str, resource: str, name: str = "") -> bool:
        return any(rule.grants(verb, resource, name) for rule in self.rules)

    def forbidden_text(self, verb: str, resource: str, *, group: str, namespace: str, name: str) -> str:
        """The RBAC denial as ``ForbiddenStatusError`` words it."""
        plural = resource.split("/", 1)[0]
        qualified = f"{plural}.{group}" if group else plural
        text = f'{qualified} "{name}" is forbidden: ' if name else f"{qualified} is forbidden: "
        text += f'User "{self.user}" cannot {verb} resource "{resource}"'
        text += f' in API group "{group}"'
        return text + (f' in the namespace "{namespace}"' if namespace else " at the cluster scope")


def check(identity: Identity, verb: str, resource: str, *, group: str, namespace: str, name: str) -> None:
    """Raise the 403 RBAC answers when no rule of `identity` grants `verb` on `resource`."""
    if identity.allows(verb, resource, name):
        return
    plural = resource.split("/", 1)[0]
    raise ApiError(
        403,
        identity.forbidden_text(verb, resource, group=group, namespace=namespace, name=name),
        reason="Forbidden",
        details={"name": name, "group": group, "kind": plural},
    )


def _key(entry: Mapping[str, Any]) -> tuple[Any, ...]:
    return (entry.get("driver"), entry.get("pool"), entry.get("device"), entry.get("shareID") or "")


def modified_drivers(new: Mapping[str, Any], old: Mapping[str, Any]) -> set[str]:
    """``getModifiedDrivers``: drivers whose ``status.devices`` entries were added, changed or removed."""
    before = {_key(e): e for e in _entries(old)}
    drivers: set[str] = set()
    for entry in _entries(new):
        previous = before.pop(_key(entry), None)
        if previous != entry:
            drivers.add(str(entry.get("driver", "")))
    drivers |= {str(e.get("driver", "")) for e in before.values()}
    return drivers


def _entries(claim: Mapping[str, Any]) -> Iterable[Mapping[str, Any]]:
    status = claim.get("status") or {}
    items = status.get("devices") if isinstance(status, dict) else None
    return [e for e in items or [] if isinstance(e, dict)]


def allocated_node(claim: Mapping[str, Any]) -> str:
    """``nodeNameFromAllocation``: the node of a one-term, one-``metadata.name In [node]`` selector."""
    status = claim.get("status") or {}
    allocation = status.get("allocation") if isinstance(status, dict) else None
    selector = allocation.get("nodeSelector") if isinstance(allocation, dict) else None
    terms = selector.get("nodeSelectorTerms") if isinstance(selector, dict) else None
    if not isinstance(terms, list) or len(terms) != 1 or not isinstance(terms[0], dict):
        return ""
    term = terms[0]
    fields = term.get("matchFields") or []
    if term.get("matchExpressions") or len(fields) != 1 or not isinstance(fields[0], dict):
        return ""
    match = fields[0]
    values = match.get("values") or []
    if match.get("key") != "metadata.name" or match.get("operator") != "In" or len(values) != 1:
        return ""
    return str(values[0])


def device_status(identity: Identity, verb: str, namespace: str, new: JSON, old: JSON) -> list[Cause]:
    """``AuthorizedForDeviceStatus``: one Forbidden field error per driver `identity` may not write."""
    associated = bool(identity.node) and identity.node == allocated_node(new)
    verbs = [ASSOCIATED_NODE + verb, ARBITRARY_NODE + verb] if associated else [ARBITRARY_NODE + verb]
    out: list[Cause] = []
    for driver in sorted(modified_drivers(new, old)):
        if any(identity.allows(v, "resourceclaims/driver", driver) for v in verbs):
            continue
        denial = identity.forbidden_text(
            verbs[0], "resourceclaims/driver", group="resource.k8s.io", namespace=namespace, name=driver
        )
        out.append(
            forbidden(
                "status.devices",
                f'changing status.devices requires resource="resourceclaims/driver", '
                f'verb="[{" ".join(verbs)}]" permission: {denial}',
            )
        )
    return out


def token_of(headers: Mapping[str, str]) -> str:
    """The bearer token of a request ('' without one)."""
    scheme, _, token = headers.get("Authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""
