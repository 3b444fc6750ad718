"""The 36 requests where the emulator disagreed with a real kube-apiserver v1.36.2, one case per row
of ``shared/reference/emulator-vs-apiserver-1.36.md``, with the real server's answer.

Each case id is the document's row id followed by the upstream rule that decides it. The rules are
in kubernetes/kubernetes ``pkg/apis/resource/validation/validation.go`` unless the case names
another file: ``pkg/apis/core/validation/validation.go`` (``ValidateNodeSelector``),
``staging/src/k8s.io/apimachinery/pkg/apis/meta/v1/validation/validation.go`` (``ValidateConditions``,
``ValidateDryRun``), ``staging/src/k8s.io/apiserver/pkg/storage/names/generate.go``
(``SimpleNameGenerator``), ``staging/src/k8s.io/apiserver/pkg/registry/rest/create.go``
(``BeforeCreate`` clears the namespace of cluster-scoped objects), ``sigs.k8s.io/json`` strict
decoding, ``staging/src/k8s.io/apiserver/pkg/endpoints/handlers/patch.go`` (apply creates) and
``pkg/features/kube_features.go`` (1.36 gate defaults). The emulator serves 1.36 with every DRA gate
on, as the real server of the measurement ran.

Where the document's message is cut short, the emulator's message must start with it; otherwise it
must be equal.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from agent.emulator import KubeApiEmulator
from tests.emulator.conftest import send

DRIVER = "gpu.example.com"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
CLAIMS = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims"
ALL_DRA_GATES = {
    "DRAListTypeAttributes": True,
    "DRADeviceTaintRules": True,
    "DRANodeAllocatableResources": True,
}
UID = "bd80ea5b-cb0f-4c39-856c-eebb7523d197"
LABEL_MSG = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must "
    "start and end with an alphanumeri"
)


def _slice(name: str, **spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "driver": DRIVER,
        "nodeName": "node-a",
        "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
        "devices": [{"name": "gpu-0"}],
    }
    base.update(spec)
    for key in [k for k, v in base.items() if v is None]:
        del base[key]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": base,
    }


def _device_slice(name: str, **device: Any) -> dict[str, Any]:
    return _slice(name, devices=[{"name": "gpu-0", **device}])


def _shared(name: str, **policy: Any) -> dict[str, Any]:
    """A shareable device with an 80Gi memory capacity and the given requestPolicy."""
    return _device_slice(
        name, allowMultipleAllocations=True, capacity={"memory": {"value": "80Gi", "requestPolicy": policy}}
    )


def _status(result: dict[str, Any] | None = None, **status: Any) -> dict[str, Any]:
    """A claim status with one allocated device (fields of the result replaced by ``result``)."""
    allocated = {"request": "gpu", "driver": DRIVER, "pool": "node-a", "device": "gpu-0", **(result or {})}
    return {"allocation": {"devices": {"results": [allocated]}}, **status}


@dataclass(frozen=True)
class Row:
    """One row: the request and the real apiserver's answer."""

    case: str
    rule: str
    method: str
    path: str
    body: Any = None
    code: int = 201
    message: str = ""
    #: The document shows the message cut short: compare the start only.
    prefix: bool = False
    query: dict[str, str] = field(default_factory=dict)
    content_type: str = "application/json"
    #: For claim status rows: the claim is created first and its status is written with this.
    status: dict[str, Any] | None = None
    check: Callable[[dict[str, Any]], bool] | None = None


def _invalid(kind: str, name: str, causes: str) -> str:
    return f'{kind}.resource.k8s.io "{name}" is invalid: {causes}'


ROWS: list[Row] = [
    Row(
        "s-attr-domain-upper",
        "validateQualifiedName: the domain is a driver name, lower-cased before the DNS check",
        "POST",
        SLICES,
        _device_slice("s-attr-domain-upper", attributes={"GPU.Example.com/x": {"int": 1}}),
    ),
    Row(
        "s-attr-two-slashes",
        "validateQualifiedName: names with more than one slash are not checked up to 1.36",
        "POST",
        SLICES,
        _device_slice("s-attr-two-slashes", attributes={"a.com/b/c": {"int": 1}}),
    ),
    Row(
        "s-list-attr",
        "validateDeviceAttribute: list values (DRAListTypeAttributes, 1.36)",
        "POST",
        SLICES,
        _device_slice("s-list-attr", attributes={"l": {"strings": ["a", "b"]}}),
        check=lambda obj: obj["spec"]["devices"][0]["attributes"] == {"l": {"strings": ["a", "b"]}},
    ),
    Row(
        "s-cap-no-value",
        "validateDevice: a capacity value is a Quantity, zero when omitted",
        "POST",
        SLICES,
        _device_slice("s-cap-no-value", capacity={"memory": {}}),
        check=lambda obj: obj["spec"]["devices"][0]["capacity"] == {"memory": {"value": "0"}},
    ),
    Row(
        "s-allnodes-false",
        "validateResourceSliceSpec: allNodes must be either unset or set to true",
        "POST",
        SLICES,
        _slice("s-allnodes-false", allNodes=False),
        422,
        _invalid(
            "ResourceSlice",
            "s-allnodes-false",
            "spec.allNodes: Invalid value: false: must be either unset or set to true",
        ),
    ),
    Row(
        "s-nodesel-badop",
        "core ValidateNodeSelectorRequirement: operator In, NotIn, Exists, DoesNotExist, Gt or Lt",
        "POST",
        SLICES,
        _slice(
            "s-nodesel-badop",
            nodeName=None,
            nodeSelector={
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "k", "operator": "Bogus", "values": ["v"]}]}
                ]
            },
        ),
        422,
        _invalid(
            "ResourceSlice",
            "s-nodesel-badop",
            "spec.nodeSelector.nodeSelectorTerms[0].matchExpressions[0].operator: Invalid value: "
            '"Bogus": not a valid selector operator',
        ),
    ),
    Row(
        "s-perdevice-missing",
        "validateDevice: perDeviceNodeSelection needs one node selection per device",
        "POST",
        SLICES,
        _slice("s-perdevice-missing", nodeName=None, perDeviceNodeSelection=True),
        422,
        _invalid(
            "ResourceSlice",
            "s-perdevice-missing",
            "spec.devices[0]: Required value: exactly one of `nodeName`, `nodeSelector`, or `allNodes` is "
            "required when `perDeviceNodeSelection` is set to true in the ResourceSlice spec",
        ),
    ),
    Row(
        "s-device-nodename-noper",
        "validateDevice: device node selection only with perDeviceNodeSelection",
        "POST",
        SLICES,
        _device_slice("s-device-nodename-noper", nodeName="node-a"),
        422,
        _invalid(
            "ResourceSlice",
            "s-device-nodename-noper",
            "spec.devices[0]: Invalid value: null: `nodeName`, `nodeSelector` and `allNodes` can only be "
            "set if `perDeviceNodeSelection` is set to true in the ResourceSlice spec",
        ),
    ),
    Row(
        "s-rp-unsorted",
        "validateRequestPolicyValidValues: validValues sorted ascending",
        "POST",
        SLICES,
        _shared("s-rp-unsorted", default="1Gi", validValues=["4Gi", "1Gi"]),
        422,
        _invalid(
            "ResourceSlice",
            "s-rp-unsorted",
            'spec.devices[0].capacity[memory].requestPolicy.validValues[1]: Invalid value: "1Gi": values '
            "must be sorted in ascending order",
        ),
    ),
    Row(
        "s-rp-both",
        "validateRequestPolicy: exactly one of validValues and validRange",
        "POST",
        SLICES,
        _shared("s-rp-both", default="1Gi", validValues=["1Gi"], validRange={"min": "1Gi"}),
        422,
        _invalid(
            "ResourceSlice",
            "s-rp-both",
            "spec.devices[0].capacity[memory].requestPolicy: Forbidden: exactly one policy can be specified, "
            'cannot specify "validValues" and "validRange" at the same time',
        ),
    ),
    Row(
        "s-rp-no-default",
        "validateValidRequestValues: default required with validRange",
        "POST",
        SLICES,
        _shared("s-rp-no-default", validRange={"min": "1Gi"}),
        422,
        _invalid(
            "ResourceSlice",
            "s-rp-no-default",
            "spec.devices[0].capacity[memory].requestPolicy.default: Required value: required when "
            "validRange is defined",
        ),
    ),
    Row(
        "s-rp-min-gt-cap",
        "validateRequestPolicyRange: min at most the capacity value",
        "POST",
        SLICES,
        _shared("s-rp-min-gt-cap", default="100Gi", validRange={"min": "100Gi"}),
        422,
        _invalid(
            "ResourceSlice",
            "s-rp-min-gt-cap",
            'spec.devices[0].capacity[memory].requestPolicy.validRange.min: Invalid value: "100Gi": min '
            "is larger than capacity value: 80Gi",
        ),
    ),
    Row(
        "s-rp-unknown-field",
        "strict decoding (sigs.k8s.io/json): unknown field in requestPolicy",
        "POST",
        SLICES,
        _shared("s-rp-unknown-field", default="1Gi", bogus=1),
        400,
        'ResourceSlice in version "v1" cannot be handled as a ResourceSlice: strict decoding error: '
        'unknown field "spec.devices[0].capacity.memory.requestPolicy.bogus"',
        query={"fieldValidation": "Strict"},
    ),
    Row(
        "s-sc-empty-devices",
        "validateResourceSliceSpec: only one of sharedCounters or devices (an empty list is set)",
        "POST",
        SLICES,
        _slice(
            "s-sc-empty-devices",
            devices=[],
            sharedCounters=[{"name": "set-a", "counters": {"mem": {"value": "1"}}}],
        ),
        422,
        _invalid(
            "ResourceSlice",
            "s-sc-empty-devices",
            'spec: Invalid value: "": only one of `sharedCounters` or `devices` is allowed',
        ),
    ),
    Row(
        "s-sc-counter-name-bad",
        "validateCounterSet: counter names are DNS labels (validateCounterName)",
        "POST",
        SLICES,
        _slice(
            "s-sc-counter-name-bad",
            devices=None,
            sharedCounters=[{"name": "set-a", "counters": {"Mem_1": {"value": "1"}}}],
        ),
        422,
        _invalid(
            "ResourceSlice",
            "s-sc-counter-name-bad",
            f'spec.sharedCounters[0].counters: Invalid value: "Mem_1": {LABEL_MSG}',
        ),
        prefix=True,
    ),
    Row(
        "s-sc-no-counters",
        "validateCounterSet: counters required",
        "POST",
        SLICES,
        _slice("s-sc-no-counters", devices=None, sharedCounters=[{"name": "set-a"}]),
        422,
        _invalid("ResourceSlice", "s-sc-no-counters", "spec.sharedCounters[0].counters: Required value"),
    ),
    Row(
        "s-cc-name-bad",
        "validateDeviceCounterConsumption: counterSet is a DNS label",
        "POST",
        SLICES,
        _device_slice(
            "s-cc-name-bad", consumesCounters=[{"counterSet": "Bad_Set", "counters": {"m": {"value": "1"}}}]
        ),
        422,
        _invalid(
            "ResourceSlice",
            "s-cc-name-bad",
            f'spec.devices[0].consumesCounters[0].counterSet: Invalid value: "Bad_Set": {LABEL_MSG}',
        ),
        prefix=True,
    ),
    Row(
        "s-cc-no-counters",
        "validateDeviceCounterConsumption: counters required",
        "POST",
        SLICES,
        _device_slice("s-cc-no-counters", consumesCounters=[{"counterSet": "set-a"}]),
        422,
        _invalid(
            "ResourceSlice",
            "s-cc-no-counters",
            "spec.devices[0].consumesCounters[0].counters: Required value",
        ),
    ),
    Row(
        "s-bind-no-failure",
        "validateDeviceBindingParameters: bindingFailureConditions required with bindingConditions",
        "POST",
        SLICES,
        _device_slice("s-bind-no-failure", bindingConditions=["c"]),
        422,
        _invalid(
            "ResourceSlice",
            "s-bind-no-failure",
            "spec.devices[0].bindingFailureConditions: Invalid value: null: bindingFailureConditions are "
            "required to use bindingConditions",
        ),
    ),
    Row(
        "s-bind-5",
        "validateDeviceBindingParameters: at most 4 bindingConditions (BindingConditionsMaxSize)",
        "POST",
        SLICES,
        _device_slice(
            "s-bind-5", bindingConditions=[f"c{i}" for i in range(5)], bindingFailureConditions=["f"]
        ),
        422,
        _invalid(
            "ResourceSlice",
            "s-bind-5",
            "spec.devices[0].bindingConditions: Too many: 5: must have at most 4 items",
        ),
    ),
    Row(
        "s-bind-overlap",
        "validateDeviceBindingParameters: failure conditions must not overlap",
        "POST",
        SLICES,
        _device_slice("s-bind-overlap", bindingConditions=["c"], bindingFailureConditions=["c"]),
        422,
        _invalid(
            "ResourceSlice",
            "s-bind-overlap",
            'spec.devices[0].bindingFailureConditions[0]: Invalid value: "c": bindingFailureConditions must '
            "not overlap with bindingConditions",
        ),
    ),
    Row(
        "s-bind-bad-name",
        "validateDeviceBindingParameters: conditions are label names (ValidateLabelName)",
        "POST",
        SLICES,
        _device_slice("s-bind-bad-name", bindingConditions=["bad name"], bindingFailureConditions=["f"]),
        422,
        _invalid(
            "ResourceSlice",
            "s-bind-bad-name",
            'spec.devices[0].bindingConditions[0]: Invalid value: "bad name": name part must consist of '
            "alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric "
            "character (e.g. 'MyName",
        ),
        prefix=True,
    ),
    Row(
        "s-unknown-meta-strict",
        "strict decoding (sigs.k8s.io/json): unknown field in ObjectMeta",
        "POST",
        SLICES,
        {**_slice("s-unknown-meta-strict"), "metadata": {"name": "s-unknown-meta-strict", "bogus": 1}},
        400,
        'ResourceSlice in version "v1" cannot be handled as a ResourceSlice: strict decoding error: '
        'unknown field "metadata.bogus"',
        query={"fieldValidation": "Strict"},
    ),
    Row(
        "s-dup-key-strict",
        "strict decoding (sigs.k8s.io/json): duplicate field",
        "POST",
        SLICES,
        json.dumps(_slice("s-dup-key-strict")).replace(
            '"driver": ', '"driver": "x.example.com", "driver": ', 1
        ),
        400,
        'ResourceSlice in version "v1" cannot be handled as a ResourceSlice: strict decoding error: '
        'duplicate field "spec.driver"',
        query={"fieldValidation": "Strict"},
    ),
    Row(
        "s-generatename-long",
        "names.SimpleNameGenerator: generateName cut to 58 bytes plus 5 random",
        "POST",
        SLICES,
        {**_slice(""), "metadata": {"generateName": "g" * 253}},
        check=lambda obj: len(obj["metadata"]["name"]) == 63,
    ),
    Row(
        "s-namespace-set",
        "rest.BeforeCreate: the namespace of a cluster-scoped object is cleared",
        "POST",
        SLICES,
        {**_slice(""), "metadata": {"name": "s-namespace-set", "namespace": "default"}},
        check=lambda obj: "namespace" not in obj["metadata"],
    ),
    Row(
        "c-st-pool-bad",
        "validateDeviceRequestAllocationResult: pool (validatePoolName)",
        "PUT",
        CLAIMS,
        code=422,
        message=_invalid(
            "ResourceClaim",
            "c-st-pool-bad",
            'status.allocation.devices.results[0].pool: Invalid value: "Pool_A": a lowercase RFC 1123 '
            "subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and "
            "end with an alphanum",
        ),
        prefix=True,
        status=_status({"pool": "Pool_A"}),
    ),
    Row(
        "c-st-request-unknown",
        "validateRequestNameRef: a request of the claim",
        "PUT",
        CLAIMS,
        code=422,
        message=_invalid(
            "ResourceClaim",
            "c-st-request-unknown",
            'status.allocation.devices.results[0].request: Invalid value: "nope": must be the name of a '
            "request in the claim or the name of a request and a subrequest separated by '/'",
        ),
        status=_status({"request": "nope"}),
    ),
    Row(
        "c-st-shareid-bad",
        "validateUID: google/uuid Validate",
        "PUT",
        CLAIMS,
        code=422,
        message=_invalid(
            "ResourceClaim",
            "c-st-shareid-bad",
            'status.allocation.devices.results[0].shareID: Invalid value: "abc": error validating uid: '
            "invalid UUID length: 3",
        ),
        status=_status({"shareID": "abc"}),
    ),
    Row(
        "c-st-shareid-upper",
        "validateUID: RFC 4122 normalized (lowercase) form",
        "PUT",
        CLAIMS,
        code=422,
        message=_invalid(
            "ResourceClaim",
            "c-st-shareid-upper",
            'status.allocation.devices.results[0].shareID: Invalid value: "9033FC3C-F360-444E-BC8B-'
            'FF131896E9AE": uid must be in RFC 4122 normalized form, `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` '
            "with lowercase h",
        ),
        prefix=True,
        status=_status({"shareID": "9033FC3C-F360-444E-BC8B-FF131896E9AE"}),
    ),
    Row(
        "c-st-reserved-dup",
        "validateResourceClaimStatusUpdate: reservedFor is a set keyed by uid",
        "PUT",
        CLAIMS,
        code=422,
        message=_invalid(
            "ResourceClaim", "c-st-reserved-dup", f'status.reservedFor[1]: Duplicate value: "{UID}"'
        ),
        status=_status(
            reservedFor=[
                {"resource": "pods", "name": "a", "uid": UID},
                {"resource": "pods", "name": "b", "uid": UID},
            ]
        ),
    ),
    Row(
        "c-st-reserved-noresource",
        "validateResourceClaimUserReference: resource required",
        "PUT",
        CLAIMS,
        code=422,
        message=_invalid(
            "ResourceClaim", "c-st-reserved-noresource", "status.reservedFor[0].resource: Required value"
        ),
        status=_status(reservedFor=[{"name": "a", "uid": UID}]),
    ),
    Row(
        "c-st-devstatus-badcond",
        "metav1 ValidateConditions: status, lastTransitionTime and reason",
        "PUT",
        CLAIMS,
        code=422,
        message=_invalid(
            "ResourceClaim",
            "c-st-devstatus-badcond",
            '[status.devices[0].conditions[0].status: Unsupported value: "Maybe": supported values: '
            '"False", "True", "Unknown", status.devices[0].conditions[0].lastTransitionTime: Required value, '
            "status.dev",
        ),
        prefix=True,
        status=_status(
            devices=[
                {
                    "driver": DRIVER,
                    "pool": "node-a",
                    "device": "gpu-0",
                    "conditions": [{"type": "Ready", "status": "Maybe"}],
                }
            ]
        ),
    ),
    Row(
        "d-dryrun-bogus",
        "metav1 ValidateDryRun: only All",
        "POST",
        SLICES,
        _slice("d-dryrun-bogus"),
        422,
        'CreateOptions.meta.k8s.io "" is invalid: dryRun: Unsupported value: ["Bogus"]: '
        'supported values: "All"',
        query={"dryRun": "Bogus"},
    ),
    Row(
        "p-apply",
        "handlers/patch.go applyPatcher: apply to a missing object creates it",
        "PATCH",
        f"{SLICES}/p-apply",
        "apiVersion: resource.k8s.io/v1\nkind: ResourceSlice\nmetadata: {name: p-apply}\n"
        f"spec:\n  driver: {DRIVER}\n  nodeName: node-a\n"
        "  pool: {name: node-a, generation: 1, resourceSliceCount: 1}\n  devices: [{name: gpu-0}]\n",
        query={"fieldManager": "hf"},
        content_type="application/apply-patch+yaml",
        check=lambda obj: obj["metadata"]["managedFields"][0]["manager"] == "hf",
    ),
    Row(
        "x-devicetaintrule-v1beta2",
        "1.36 serves DeviceTaintRule in resource.k8s.io/v1beta2",
        "GET",
        "/apis/resource.k8s.io/v1beta2/devicetaintrules",
        code=200,
        check=lambda obj: (
            obj["kind"] == "DeviceTaintRuleList" and obj["apiVersion"] == "resource.k8s.io/v1beta2"
        ),
    ),
]


@pytest.fixture
async def emu136() -> AsyncIterator[KubeApiEmulator]:
    """A 1.36 emulator with every DRA gate on, as the real server of the measurement."""
    async with KubeApiEmulator(version="1.36", feature_gates=ALL_DRA_GATES) as emulator:
        yield emulator


@pytest.mark.parametrize("row", ROWS, ids=[f"{r.case}[{r.rule.split(':')[0]}]" for r in ROWS])
async def test_emulator_gives_the_real_apiservers_answer(emu136: KubeApiEmulator, row: Row) -> None:
    method, path, body = row.method, row.path, row.body
    if row.status is not None:
        claim = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": row.case},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}},
        }
        code, created, _ = await send(emu136, "POST", CLAIMS, claim)
        assert code == 201, created
        path, body = f"{CLAIMS}/{row.case}/status", {**created, "status": row.status}
    code, answer, _ = await send(emu136, method, path, body, query=row.query, content_type=row.content_type)
    assert code == row.code, (row.rule, answer)
    if row.message:
        message = answer["message"]
        assert message.startswith(row.message) if row.prefix else message == row.message, (row.rule, message)
    if row.check is not None:
        assert row.check(answer), (row.rule, answer)
