"""The chart's ValidatingAdmissionPolicy, evaluated with real CEL semantics (cel-python).

The policy runs as the API server runs one (``staging/src/k8s.io/apiserver/pkg/admission/plugin/
policy/validating``): the match conditions, then the variables, then each validation; ``object``
is null on DELETE and ``oldObject`` is null on CREATE. Requests of the agent's ServiceAccount may
write only ResourceSlices of its own node (from its token) and of the drivers it serves, checked
on the new object and, for UPDATE and DELETE, on the stored one.
"""

from __future__ import annotations

from typing import Any

import celpy
import pytest
from celpy import celtypes
from celpy.adapter import json_to_cel

from tests.deploy.chart import MANIFEST_VALUES, NAMESPACE, render_objects

AGENT = f"system:serviceaccount:{NAMESPACE}:dra-agent"
NVIDIA, AMD, OTHER = "gpu.nvidia.com", "gpu.amd.com", "other.example.com"


def policy_of(values: dict[str, Any]) -> dict[str, Any]:
    (policy,) = [o for o in render_objects(values) if o["kind"] == "ValidatingAdmissionPolicy"]
    return policy


@pytest.fixture(scope="module")
def nvidia_policy() -> dict[str, Any]:
    return policy_of(MANIFEST_VALUES["nvidia"])


def decide(policy: dict[str, Any], request: dict[str, Any]) -> tuple[bool, str]:
    """(allowed, why) for `request`, evaluating the policy's CEL like the API server."""
    env = celpy.Environment()

    def evaluate(expression: str, activation: dict[str, Any]) -> Any:
        return env.program(env.compile(expression)).evaluate(activation)

    base = {
        "request": json_to_cel(request),
        "object": json_to_cel(request.get("object")),
        "oldObject": json_to_cel(request.get("oldObject")),
    }
    spec = policy["spec"]
    if not all(evaluate(c["expression"], base) for c in spec["matchConditions"]):
        return True, "not matched"
    variables = celtypes.MapType()
    for variable in spec["variables"]:  # later variables may use earlier ones
        variables[celtypes.StringType(variable["name"])] = evaluate(
            variable["expression"], {**base, "variables": variables}
        )
    activation = {**base, "variables": variables}
    for validation in spec["validations"]:
        if not evaluate(validation["expression"], activation):
            message = validation.get("messageExpression") or validation.get("message", "")
            return False, str(message)
    return True, "allowed"


def slice_of(node: str | None, driver: str = NVIDIA) -> dict[str, Any]:
    spec: dict[str, Any] = {"driver": driver, "pool": {"name": node or "fleet"}}
    if node:
        spec["nodeName"] = node
    else:
        spec["allNodes"] = True
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "spec": spec}


def request(
    operation: str,
    *,
    new: dict[str, Any] | None = None,
    old: dict[str, Any] | None = None,
    user: str = AGENT,
    token_node: str | None = "node-a",
) -> dict[str, Any]:
    extra = {"authentication.kubernetes.io/node-name": [token_node]} if token_node else {}
    return {
        "resource": {"group": "resource.k8s.io", "version": "v1", "resource": "resourceslices"},
        "operation": operation,
        "userInfo": {"username": user, "extra": extra},
        "object": new,
        "oldObject": old,
    }


OWN, OTHER_NODE, OTHER_DRIVER = slice_of("node-a"), slice_of("node-b"), slice_of("node-a", OTHER)

CASES: list[tuple[str, dict[str, Any], bool]] = [
    ("create own", request("CREATE", new=OWN), True),
    ("update own", request("UPDATE", new=OWN, old=OWN), True),
    ("delete own", request("DELETE", old=OWN), True),
    ("create for another node", request("CREATE", new=OTHER_NODE), False),
    ("create for another driver", request("CREATE", new=OTHER_DRIVER), False),
    ("create a fleet-wide slice", request("CREATE", new=slice_of(None)), False),
    ("update another node's slice in place", request("UPDATE", new=OTHER_NODE, old=OTHER_NODE), False),
    # The hole the old policy had: only the new object was checked on UPDATE.
    ("re-point another node's slice at ours", request("UPDATE", new=OWN, old=OTHER_NODE), False),
    ("re-point a fleet-wide slice at ours", request("UPDATE", new=OWN, old=slice_of(None)), False),
    ("take over another driver's slice", request("UPDATE", new=OWN, old=OTHER_DRIVER), False),
    ("give our slice away", request("UPDATE", new=OTHER_NODE, old=OWN), False),
    ("delete another node's slice", request("DELETE", old=OTHER_NODE), False),
    ("delete another driver's slice", request("DELETE", old=OTHER_DRIVER), False),
    ("token without a node", request("CREATE", new=OWN, token_node=None), False),
    ("someone else", request("DELETE", old=OTHER_NODE, user="system:serviceaccount:x:controller"), True),
]


@pytest.mark.parametrize(("name", "req", "allowed"), CASES, ids=[c[0] for c in CASES])
def test_decisions(nvidia_policy: dict[str, Any], name: str, req: dict[str, Any], allowed: bool) -> None:
    decision, why = decide(nvidia_policy, req)
    assert decision is allowed, (name, why)


def test_drivers_follow_the_enabled_backends() -> None:
    mixed = policy_of(MANIFEST_VALUES["mixed"])
    amd_slice = slice_of("node-a", AMD)
    assert decide(mixed, request("CREATE", new=amd_slice))[0]
    assert decide(mixed, request("CREATE", new=OWN))[0]
    amd_only = policy_of(MANIFEST_VALUES["amd"])
    assert decide(amd_only, request("CREATE", new=amd_slice))[0]
    assert not decide(amd_only, request("CREATE", new=OWN))[0]
    fake = policy_of(
        {"backends": {"nvidia": {"enabled": False}, "fake": {"enabled": True, "driverName": OTHER}}}
    )
    assert decide(fake, request("CREATE", new=OTHER_DRIVER))[0]
    assert not decide(fake, request("CREATE", new=OWN))[0]


def test_only_resourceslices_are_matched(nvidia_policy: dict[str, Any]) -> None:
    (rule,) = nvidia_policy["spec"]["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["resourceslices"]
    assert set(rule["operations"]) == {"CREATE", "UPDATE", "DELETE"}
    assert nvidia_policy["spec"]["failurePolicy"] == "Fail"
