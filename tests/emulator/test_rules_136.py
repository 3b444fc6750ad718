"""Every branch of the rules added for 1.36, one cause each, beyond the rows of the measurement.

Upstream: kubernetes/kubernetes ``pkg/apis/resource/validation/validation.go`` (``validateDevice``
node selection, ``validateRequestPolicyRange``, ``validateRequestPolicyValidValues``,
``validateDeviceBindingParameters``, ``validateUID``, ``validateRequestNameRef``,
``validateResourceClaimStatusUpdate``), ``pkg/apis/core/validation/validation.go``
(``ValidateNodeSelector``, ``ValidateNodeSelectorRequirement``, ``ValidateNodeFieldSelectorRequirement``)
and ``staging/src/k8s.io/apimachinery/pkg/apis/meta/v1/validation/validation.go`` (``ValidateConditions``).
"""

from __future__ import annotations

from typing import Any

import pytest

from agent.emulator import ApiError, KubeApiEmulator

DRIVER = "gpu.example.com"
UID = "bd80ea5b-cb0f-4c39-856c-eebb7523d197"


def _slice(devices: list[dict[str, Any]] | None, **spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "driver": DRIVER,
        "nodeName": "node-a",
        "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
        "devices": devices,
    }
    base.update(spec)
    return {"metadata": {"name": "s"}, "spec": {k: v for k, v in base.items() if v is not None}}


def _selector(*expressions: dict[str, Any], fields: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    term: dict[str, Any] = {"matchExpressions": list(expressions)}
    if fields is not None:
        term["matchFields"] = fields
    return {"nodeSelectorTerms": [term]}


def _on_selector(selector: dict[str, Any]) -> dict[str, Any]:
    return _slice([{"name": "d"}], nodeName=None, nodeSelector=selector)


def _per_device(**device: Any) -> dict[str, Any]:
    return _slice([{"name": "d", **device}], nodeName=None, perDeviceNodeSelection=True)


def _policy(**policy: Any) -> dict[str, Any]:
    return _slice(
        [
            {
                "name": "d",
                "allowMultipleAllocations": True,
                "capacity": {"m": {"value": "80", "requestPolicy": policy}},
            }
        ]
    )


RP = "spec.devices[0].capacity[m].requestPolicy"
SEL = "spec.nodeSelector.nodeSelectorTerms[0]"

SLICE_CAUSES: list[tuple[str, dict[str, Any], str]] = [
    (
        "no selector terms",
        _on_selector({"nodeSelectorTerms": []}),
        "spec.nodeSelector.nodeSelectorTerms: Required value: must have at least one node selector term",
    ),
    (
        "In without values",
        _on_selector(_selector({"key": "k", "operator": "In"})),
        f"{SEL}.matchExpressions[0].values: Required value: must be specified when `operator` is 'In' or 'No",
    ),
    (
        "Exists with values",
        _on_selector(_selector({"key": "k", "operator": "Exists", "values": ["v"]})),
        f"{SEL}.matchExpressions[0].values: Forbidden: may not be specified when `operator` is 'Exists' or '",
    ),
    (
        "Gt with two values",
        _on_selector(_selector({"key": "k", "operator": "Gt", "values": ["1", "2"]})),
        f"{SEL}.matchExpressions[0].values: Required value: must be specified single value when `operator` i",
    ),
    (
        "bad label value",
        _on_selector(_selector({"key": "k", "operator": "In", "values": ["a b"]})),
        f'{SEL}.matchExpressions[0].values[0]: Invalid value: "a b": a valid label',
    ),
    (
        "bad label key",
        _on_selector(_selector({"key": "a b", "operator": "Exists"})),
        f'{SEL}.matchExpressions[0].key: Invalid value: "a b": name part',
    ),
    (
        "field selector key",
        _on_selector(_selector(fields=[{"key": "spec.x", "operator": "In", "values": ["n"]}])),
        f'{SEL}.matchFields[0].key: Invalid value: "spec.x": not a valid field selector key',
    ),
    (
        "field selector operator",
        _on_selector(_selector(fields=[{"key": "metadata.name", "operator": "Exists"}])),
        f'{SEL}.matchFields[0].operator: Invalid value: "Exists": not a valid selector operator',
    ),
    (
        "field selector two values",
        _on_selector(_selector(fields=[{"key": "metadata.name", "operator": "In", "values": ["a", "b"]}])),
        f"{SEL}.matchFields[0].values: Required value: must be only one value when `operator` is 'In' or 'No",
    ),
    (
        "field selector node name",
        _on_selector(_selector(fields=[{"key": "metadata.name", "operator": "In", "values": ["A_B"]}])),
        f'{SEL}.matchFields[0].values[0]: Invalid value: "A_B": a lowercase RFC 1123 subdomain',
    ),
    (
        "perDeviceNodeSelection false",
        _slice([{"name": "d"}], perDeviceNodeSelection=False),
        "spec.perDeviceNodeSelection: Invalid value: false: must be either unset or set to true",
    ),
    (
        "device with two selections",
        _per_device(nodeName="n", allNodes=True),
        'spec.devices[0]: Invalid value: "{`nodeName`, `allNodes`}": exactly one of `nodeName`, '
        "`nodeSelector`, or `allNodes` is required",
    ),
    (
        "device nodeName empty",
        _per_device(nodeName="", allNodes=True),
        'spec.devices[0].nodeName: Invalid value: "": must not be empty',
    ),
    (
        "device allNodes false",
        _per_device(allNodes=False, nodeName="n"),
        "spec.devices[0].allNodes: Invalid value: false: must be either unset or set to true",
    ),
    (
        "device node selector checked",
        _per_device(nodeSelector={"nodeSelectorTerms": []}),
        "spec.devices[0].nodeSelector.nodeSelectorTerms: Required value",
    ),
    (
        "device nodeName a subdomain",
        _per_device(nodeName="A_B"),
        'spec.devices[0].nodeName: Invalid value: "A_B"',
    ),
    (
        "values without default",
        _policy(validValues=["1"]),
        f"{RP}.default: Required value: required when validValues is defined",
    ),
    (
        "duplicate values",
        _policy(default="1", validValues=["1", "1"]),
        f'{RP}.validValues[1]: Duplicate value: "1"',
    ),
    (
        "range without min",
        _policy(default="1", validRange={"max": "2"}),
        f"{RP}.validRange.min: Required value: required when validRange is defined",
    ),
    (
        "default below min",
        _policy(default="1", validRange={"min": "2"}),
        f'{RP}.validRange.min: Invalid value: "1": default is less than min: 2',
    ),
    (
        "max below min",
        _policy(default="5", validRange={"min": "5", "max": "4"}),
        f'{RP}.validRange.max: Invalid value: "5": min is larger than max: 4',
    ),
    (
        "default above max",
        _policy(default="9", validRange={"min": "1", "max": "8"}),
        f'{RP}.validRange.max: Invalid value: "9": default is more than max: 8',
    ),
    (
        "step not positive",
        _policy(default="1", validRange={"min": "1", "step": "0"}),
        f'{RP}.validRange.step: Invalid value: "0": must be greater than zero',
    ),
    (
        "one step beyond capacity",
        _policy(default="70", validRange={"min": "70", "step": "20"}),
        f'{RP}.validRange.step: Invalid value: "20": one step 90 is larger than capacity value: 80',
    ),
    (
        "duplicate binding condition",
        _slice([{"name": "d", "bindingConditions": ["c", "c"], "bindingFailureConditions": ["f"]}]),
        'spec.devices[0].bindingConditions[1]: Duplicate value: "c"',
    ),
    (
        "failure conditions alone",
        _slice([{"name": "d", "bindingFailureConditions": ["f"]}]),
        "spec.devices[0].bindingConditions: Invalid value: null: bindingConditions are required to use bindi",
    ),
    (
        "5 failure conditions",
        _slice([{"name": "d", "bindingConditions": ["c"], "bindingFailureConditions": list("abcde")}]),
        "spec.devices[0].bindingFailureConditions: Too many: 5: must have at most 4 items",
    ),
    (
        "empty list attribute",
        _slice([{"name": "d", "attributes": {"l": {"ints": []}}}]),
        "spec.devices[0].attributes[l].ints: Invalid value: []: must not be empty if specified",
    ),
    (
        "bad list version",
        _slice([{"name": "d", "attributes": {"l": {"versions": ["1.0"]}}}]),
        'spec.devices[0].attributes[l].versions[0]: Invalid value: "1.0": must be a string compatible',
    ),
    (
        "long list string",
        _slice([{"name": "d", "attributes": {"l": {"strings": ["s" * 65]}}}]),
        "spec.devices[0].attributes[l].strings[0]: Too long: may not be more than 64 bytes",
    ),
    (
        "scalar and list",
        _slice([{"name": "d", "attributes": {"l": {"int": 1, "ints": [1]}}}]),
        "spec.devices[0].attributes[l]: Invalid value:",
    ),
    (
        "empty domain",
        _slice([{"name": "d", "attributes": {"/x": {"int": 1}}}]),
        'spec.devices[0].attributes: Invalid value: "": the domain must not be empty',
    ),
    (
        "empty name",
        _slice([{"name": "d", "attributes": {"a.com/": {"int": 1}}}]),
        'spec.devices[0].attributes: Invalid value: "": the name must not be empty',
    ),
    (
        "counter set without name",
        _slice(None, sharedCounters=[{"counters": {"a": {"value": "1"}}}]),
        "spec.sharedCounters[0].name: Required value",
    ),
    (
        "duplicate counter set",
        _slice(None, sharedCounters=[{"name": "a", "counters": {"a": {"value": "1"}}}] * 2),
        'spec.sharedCounters[1]: Duplicate value: "a"',
    ),
    (
        "consumption without counterSet",
        _slice([{"name": "d", "consumesCounters": [{"counters": {"a": {"value": "1"}}}]}]),
        "spec.devices[0].consumesCounters[0].counterSet: Required value",
    ),
]


@pytest.mark.parametrize(("body", "cause"), [c[1:] for c in SLICE_CAUSES], ids=[c[0] for c in SLICE_CAUSES])
async def test_slice_rule_branches(body: dict[str, Any], cause: str) -> None:
    async with KubeApiEmulator(version="1.36", feature_gates={"DRAListTypeAttributes": True}) as emu:
        with pytest.raises(ApiError) as caught:
            emu.create("resourceslices", body)
    causes = [f"{c['field']}: {c['message']}" for c in caught.value.details["causes"]]
    assert any(c.startswith(cause) for c in causes), causes


async def test_valid_selectors_and_per_device_selection_are_accepted() -> None:
    async with KubeApiEmulator(version="1.36") as emu:
        emu.create(
            "resourceslices",
            _on_selector(
                _selector(
                    {"key": "k", "operator": "Gt", "values": ["1"]},
                    {"key": "k", "operator": "DoesNotExist"},
                    fields=[{"key": "metadata.name", "operator": "NotIn", "values": ["n"]}],
                )
            ),
        )
        per_device = _per_device(nodeSelector=_selector({"key": "k", "operator": "In", "values": ["v"]}))
        per_device["metadata"]["name"] = "p"
        emu.create("resourceslices", per_device)


def _claim_status(
    emu: KubeApiEmulator, name: str, status: dict[str, Any], requests: list[Any] | None = None
) -> None:
    claim = {
        "metadata": {"name": name},
        "spec": {
            "devices": {"requests": requests or [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}
        },
    }
    created = emu.create("resourceclaims", claim)
    emu.update("resourceclaims", {**created, "status": status}, subresource="status")


def _allocated(result: dict[str, Any] | None = None, **status: Any) -> dict[str, Any]:
    item = {"request": "gpu", "driver": DRIVER, "pool": "node-a", "device": "gpu-0", **(result or {})}
    return {"allocation": {"devices": {"results": [item]}}, **status}


RES = "status.allocation.devices.results[0]"
COND = "status.devices[0].conditions[0]"


def _condition(**fields: Any) -> dict[str, Any]:
    condition = {
        "type": "Ready",
        "status": "True",
        "reason": "Ok",
        "lastTransitionTime": "2026-11-23T20:25:27Z",
    }
    device = {"driver": DRIVER, "pool": "node-a", "device": "gpu-0", "conditions": [{**condition, **fields}]}
    return _allocated(devices=[device])


CLAIM_CAUSES: list[tuple[str, dict[str, Any], str]] = [
    (
        "shareID without hyphens",
        _allocated({"shareID": UID.replace("-", "")}),
        f'{RES}.shareID: Invalid value: "{UID.replace("-", "")}": uid must be in RFC 4122 normalized form',
    ),
    (
        "shareID in braces",
        _allocated({"shareID": "{" + UID + "}"}),
        f'{RES}.shareID: Invalid value: "{{{UID}}}": uid must be in RFC 4122',
    ),
    (
        "shareID bad urn",
        _allocated({"shareID": "urn:uuix:" + UID}),
        f'{RES}.shareID: Invalid value: "urn:uuix:{UID}": error validating uid: '
        'invalid urn prefix: "urn:uuix:"',
    ),
    (
        "shareID not hex",
        _allocated({"shareID": UID.replace("b", "x")}),
        f'{RES}.shareID: Invalid value: "{UID.replace("b", "x")}": error validating uid: invalid UUID format',
    ),
    (
        "request with three segments",
        _allocated({"request": "a/b/c"}),
        f'{RES}.request: Invalid value: "a/b/c": must be the name of a request',
    ),
    (
        "unknown subrequest",
        _allocated({"request": "gpu/x"}),
        f'{RES}.request: Invalid value: "gpu/x": must be the name of a request',
    ),
    (
        "binding conditions of a result",
        _allocated({"bindingConditions": ["c"]}),
        f"{RES}.bindingFailureConditions: Invalid value: null",
    ),
    (
        "allocation node selector",
        {
            **_allocated(),
            "allocation": {**_allocated()["allocation"], "nodeSelector": {"nodeSelectorTerms": []}},
        },
        "status.allocation.nodeSelector.nodeSelectorTerms: Required value",
    ),
    (
        "reservedFor without name and uid",
        _allocated(reservedFor=[{"resource": "pods"}]),
        "status.reservedFor[0].name: Required value",
    ),
    (
        "duplicate condition type",
        {
            **_condition(),
            "devices": [
                {**_condition()["devices"][0], "conditions": _condition()["devices"][0]["conditions"] * 2}
            ],
        },
        'status.devices[0].conditions[1].type: Duplicate value: "Ready"',
    ),
    (
        "bad condition reason",
        _condition(reason="9bad"),
        f'{COND}.reason: Invalid value: "9bad": a condition reason must start',
    ),
    (
        "negative observedGeneration",
        _condition(observedGeneration=-1),
        f"{COND}.observedGeneration: Invalid value: -1: must be greater than or equal to zero",
    ),
    (
        "device status shareID",
        {
            **_allocated(),
            "devices": [{"driver": DRIVER, "pool": "node-a", "device": "gpu-0", "shareID": "abc"}],
        },
        'status.devices[0].shareID: Invalid value: "abc": error validating uid',
    ),
    (
        "device status pool",
        {**_allocated(), "devices": [{"driver": DRIVER, "pool": "Pool_A", "device": "gpu-0"}]},
        'status.devices[0].pool: Invalid value: "Pool_A"',
    ),
]


@pytest.mark.parametrize(("status", "cause"), [c[1:] for c in CLAIM_CAUSES], ids=[c[0] for c in CLAIM_CAUSES])
async def test_claim_status_rule_branches(status: dict[str, Any], cause: str) -> None:
    async with KubeApiEmulator(version="1.36") as emu:
        with pytest.raises(ApiError) as caught:
            _claim_status(emu, "c", status)
    causes = [f"{c['field']}: {c['message']}" for c in caught.value.details["causes"]]
    assert any(c.startswith(cause) for c in causes), causes


async def test_subrequests_and_good_conditions_are_accepted() -> None:
    requests = [{"name": "gpu", "firstAvailable": [{"name": "big", "deviceClassName": DRIVER}]}]
    async with KubeApiEmulator(version="1.36") as emu:
        _claim_status(emu, "a", _allocated({"request": "gpu/big", "shareID": UID}), requests)
        _claim_status(emu, "b", _condition())
