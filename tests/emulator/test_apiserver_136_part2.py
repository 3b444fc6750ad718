"""The 16 requests (of 82 more) where the emulator disagreed with a real kube-apiserver v1.36.2, one
case per row of ``shared/reference/emulator-vs-apiserver-1.36-part2.md``, with the real answer; then
the rows both already agreed on that the document asks to keep, and its "both reject, details
differ" notes.

Each case names the upstream rule (kubernetes/kubernetes) that decides it:

- ``staging/src/k8s.io/apimachinery/pkg/util/managedfields/internal/`` (server-side apply):
  ``versioncheck.go`` (``invalid object type``), ``structuredmerge.go`` (``managedFields must be
  nil``, ``failed to create typed patch object``), ``conflict.go`` (``printManager``,
  ``getConflictMessage``), ``fieldmanager.go`` (``Update`` managers from create/update/patch);
- ``staging/src/k8s.io/apiserver/pkg/endpoints/handlers/responsewriters/status.go``
  (``ErrorToAPIStatus``: a plain error is a 500 without a reason);
- ``staging/src/k8s.io/apimachinery/pkg/apis/meta/v1/validation/validation.go``
  (``ValidatePatchOptions``, ``ValidateFieldManager``);
- ``pkg/apis/resource/validation/validation.go`` (``validateDeviceClassSpec`` with
  ``pkg/apis/core/v1/helper`` ``IsExtendedResourceName``; ``validateNetworkDeviceData`` with
  ``staging/src/k8s.io/apimachinery/pkg/api/validation/ip.go`` ``IsValidInterfaceAddress``;
  ``validateAllocationConfigSource``; ``validateRequestPolicyRange``);
- ``staging/src/k8s.io/api/resource/v1/types.go`` (``DeviceTaint.Value`` is ``omitempty``);
- ``staging/src/k8s.io/apimachinery/pkg/api/validate/content/errors.go`` (``MaxLenError``: bytes).

The emulator serves 1.36 with every DRA gate on, as the measured server did.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import yaml

from agent.emulator import KubeApiEmulator
from tests.emulator.conftest import send

DRIVER = "gpu.example.com"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
CLASSES = "/apis/resource.k8s.io/v1/deviceclasses"
CLAIMS = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims"
APPLY = "application/apply-patch+yaml"
MERGE = "application/merge-patch+json"
ALL_DRA_GATES = {
    "DRAListTypeAttributes": True,
    "DRADeviceTaintRules": True,
    "DRANodeAllocatableResources": True,
}
UNSET = object()


def _slice(name: str, generation: int = 1, **device: Any) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": DRIVER,
            "nodeName": "node-a",
            "pool": {"name": "node-a", "generation": generation, "resourceSliceCount": 1},
            "devices": [{"name": "gpu-0", **device}],
        },
    }


def _yaml(body: dict[str, Any]) -> str:
    return yaml.safe_dump(body)


def _class(name: str, extended: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {"extendedResourceName": extended},
    }


def _status(**device: Any) -> dict[str, Any]:
    """A claim status with one allocated device and a status entry for it (fields added)."""
    allocated = {"request": "gpu", "driver": DRIVER, "pool": "node-a", "device": "gpu-0"}
    entry = {"driver": DRIVER, "pool": "node-a", "device": "gpu-0", **device}
    return {"allocation": {"devices": {"results": [allocated]}}, "devices": [entry]}


def _shared(name: str, **policy: Any) -> dict[str, Any]:
    return _slice(
        name,
        allowMultipleAllocations=True,
        capacity={"memory": {"value": "80Gi", "requestPolicy": policy}},
    )


@dataclass(frozen=True)
class Call:
    """One HTTP request."""

    method: str
    path: str
    body: Any = None
    query: dict[str, str] = field(default_factory=dict)
    content_type: str = "application/json"


@dataclass(frozen=True)
class Row:
    """One row: setup requests (each must succeed), the request and the real apiserver's answer."""

    case: str
    rule: str
    call: Call
    code: int
    message: str = ""
    #: The document cuts the message short: compare its start (and ``suffix``, if given).
    prefix: bool = False
    suffix: str = ""
    #: The Status ``reason`` the real server sends (UNSET: not checked; None: absent).
    reason: Any = UNSET
    setup: tuple[Call, ...] = ()
    #: For claim status rows: the claim is created first and its status is written with this.
    status: dict[str, Any] | None = None
    check: Callable[[dict[str, Any]], bool] | None = None


def _invalid(kind: str, name: str, causes: str) -> str:
    return f'{kind}.resource.k8s.io "{name}" is invalid: {causes}'


def _ern(name: str, value: str, code: int = 422) -> Row:
    return Row(
        f"dc-ern-{name}",
        "validateDeviceClassSpec: IsExtendedResourceName (core/v1/helper)",
        Call("POST", CLASSES, _class(f"dc-ern-{name}", value)),
        code,
        _invalid(
            "DeviceClass",
            f"dc-ern-{name}",
            f'spec.extendedResourceName: Invalid value: "{value}": must be a valid extended resource name',
        )
        if code == 422
        else "",
        check=(lambda obj: obj["spec"]["extendedResourceName"] == value) if code == 201 else None,
    )


ROWS: list[Row] = [
    # ----- server-side apply
    Row(
        "ssa-conflict-update-manager",
        "managedfields conflict.go: a field a plain POST set belongs to an Update manager",
        Call("PATCH", f"{SLICES}/ssa-upd", _yaml(_slice("ssa-upd", 2)), {"fieldManager": "a"}, APPLY),
        409,
        'Apply failed with 1 conflict: conflict with "cx-post" using resource.k8s.io/v1: '
        ".spec.pool.generation",
        reason="Conflict",
        setup=(Call("POST", SLICES, _slice("ssa-upd"), {"fieldManager": "cx-post"}),),
    ),
    Row(
        "ssa-no-kind",
        "managedfields versioncheck.go: the applied object's GroupVersionKind must be the served one",
        Call(
            "PATCH",
            f"{SLICES}/ssa-nokind",
            _yaml({k: v for k, v in _slice("ssa-nokind").items() if k not in ("apiVersion", "kind")}),
            {"fieldManager": "a"},
            APPLY,
        ),
        400,
        "invalid object type: /, Kind=",
        reason="BadRequest",
    ),
    Row(
        "ssa-managed-fields",
        "managedfields structuredmerge.go: metadata.managedFields must be nil in an apply",
        Call(
            "PATCH",
            f"{SLICES}/ssa-mf",
            _yaml(
                {
                    **_slice("ssa-mf"),
                    "metadata": {"name": "ssa-mf", "managedFields": [{"manager": "x", "operation": "Apply"}]},
                }
            ),
            {"fieldManager": "a"},
            APPLY,
        ),
        400,
        "metadata.managedFields must be nil",
        reason="BadRequest",
    ),
    Row(
        "ssa-unknown-field",
        "managedfields structuredmerge.go: ObjectToTyped refuses a field outside the schema (500)",
        Call(
            "PATCH",
            f"{SLICES}/ssa-unknown",
            _yaml({**_slice("ssa-unknown"), "spec": {**_slice("ssa-unknown")["spec"], "bogus": 1}}),
            {"fieldManager": "a"},
            APPLY,
        ),
        500,
        "failed to create typed patch object (",
        prefix=True,
        suffix="): .spec.bogus: field not declared in schema",
        reason=None,
    ),
    Row(
        "merge-patch-force",
        "meta/v1 ValidatePatchOptions: force only for apply patches",
        Call("PATCH", f"{SLICES}/mp-force", {"metadata": {"labels": {"a": "b"}}}, {"force": "true"}, MERGE),
        422,
        'PatchOptions.meta.k8s.io "" is invalid: force: Forbidden: may not be specified for non-apply patch',
        reason="Invalid",
        setup=(Call("POST", SLICES, _slice("mp-force")),),
    ),
    Row(
        "ssa-long-manager",
        "meta/v1 ValidateFieldManager: at most 128 bytes (FieldManagerMaxLength)",
        Call("PATCH", f"{SLICES}/ssa-long", _yaml(_slice("ssa-long")), {"fieldManager": "m" * 129}, APPLY),
        422,
        'PatchOptions.meta.k8s.io "" is invalid: fieldManager: Too long: may not be more than 128 bytes',
        reason="Invalid",
    ),
    # ----- DeviceClass spec.extendedResourceName
    _ern("no-domain", "gpu"),
    _ern("native", "kubernetes.io/gpu"),
    _ern("implicit", "deviceclass.resource.kubernetes.io/x"),
    _ern("requests", "requests.example.com/gpu"),
    _ern("long", "example.com/" + "g" * 64),
    _ern("ok-example", "example.com/gpu", 201),
    _ern("ok-nvidia", "nvidia.com/gpu", 201),
    # ----- ResourceClaim status
    Row(
        "c-st-ip-no-prefix",
        "validateNetworkDeviceData: IsValidInterfaceAddress needs CIDR form",
        Call("PUT", CLAIMS),
        422,
        _invalid(
            "ResourceClaim",
            "c-st-ip-no-prefix",
            'status.devices[0].networkData.ips[0]: Invalid value: "10.0.0.1": must be a valid address in '
            "CIDR form, (e.g. 10.9.8.7/24 or 2001:db8::1/64)",
        ),
        status=_status(networkData={"ips": ["10.0.0.1"]}),
    ),
    Row(
        "c-st-ip-dup",
        "validateNetworkDeviceData: ips is a set (validateSet, stringKey)",
        Call("PUT", CLAIMS),
        422,
        _invalid(
            "ResourceClaim",
            "c-st-ip-dup",
            'status.devices[0].networkData.ips[1]: Duplicate value: "10.0.0.1/24"',
        ),
        status=_status(networkData={"ips": ["10.0.0.1/24", "10.0.0.1/24"]}),
    ),
    Row(
        "c-st-ip6-noncanonical",
        "validateNetworkDeviceData: IsValidInterfaceAddress wants the canonical form",
        Call("PUT", CLAIMS),
        422,
        _invalid(
            "ResourceClaim",
            "c-st-ip6-noncanonical",
            'status.devices[0].networkData.ips[0]: Invalid value: "fd00:0::1/64": must be in canonical '
            'form ("fd00::1/64")',
        ),
        status=_status(networkData={"ips": ["fd00:0::1/64"]}),
    ),
    Row(
        "c-st-config-source",
        "validateAllocationConfigSource: FromClaim or FromClass",
        Call("PUT", CLAIMS),
        422,
        _invalid(
            "ResourceClaim",
            "c-st-config-source",
            'status.allocation.devices.config[0].source: Unsupported value: "Bogus": supported values: '
            '"FromClaim", "FromClass"',
        ),
        status={
            "allocation": {
                "devices": {
                    "results": [{"request": "gpu", "driver": DRIVER, "pool": "node-a", "device": "gpu-0"}],
                    "config": [
                        {
                            "source": "Bogus",
                            "requests": ["gpu"],
                            "opaque": {"driver": DRIVER, "parameters": {"a": 1}},
                        }
                    ],
                }
            }
        },
    ),
    # ----- taints
    Row(
        "s-taint-empty-value",
        "DeviceTaint.Value is omitempty (k8s.io/api resource/v1 types.go)",
        Call(
            "POST",
            SLICES,
            _slice("s-taint-empty", taints=[{"key": "a.b/c", "value": "", "effect": "NoSchedule"}]),
        ),
        201,
        check=lambda obj: "value" not in obj["spec"]["devices"][0]["taints"][0],
    ),
    # ----- agreed already (keep)
    Row(
        "ok-apply-creates",
        "handlers/patch.go applyPatcher: apply to a missing object creates it, an Apply manager",
        Call("PATCH", f"{SLICES}/ok-create", _yaml(_slice("ok-create")), {"fieldManager": "a"}, APPLY),
        201,
        check=lambda obj: [m["operation"] for m in obj["metadata"]["managedFields"]] == ["Apply"],
    ),
    Row(
        "ok-apply-appliers-conflict",
        "managedfields conflict.go: two appliers with different values conflict",
        Call("PATCH", f"{SLICES}/ok-two", _yaml(_slice("ok-two", 2)), {"fieldManager": "b"}, APPLY),
        409,
        'Apply failed with 1 conflict: conflict with "a": .spec.pool.generation',
        setup=(Call("PATCH", f"{SLICES}/ok-two", _yaml(_slice("ok-two")), {"fieldManager": "a"}, APPLY),),
    ),
    Row(
        "ok-apply-force",
        "structured-merge-diff Updater.Apply: force takes the field over",
        Call(
            "PATCH",
            f"{SLICES}/ok-force",
            _yaml(_slice("ok-force", 2)),
            {"fieldManager": "b", "force": "true"},
            APPLY,
        ),
        200,
        setup=(Call("POST", SLICES, _slice("ok-force"), {"fieldManager": "cx-post"}),),
        check=lambda obj: obj["spec"]["pool"]["generation"] == 2,
    ),
    # ----- both reject, details differ
    Row(
        "rp-step-zero",
        "validateRequestPolicyRange: step 0 (upstream 1.36.2 panics with a 500; the emulator keeps 422)",
        Call("POST", SLICES, _shared("rp-step-zero", default="1Gi", validRange={"min": "1Gi", "step": "0"})),
        422,
        _invalid(
            "ResourceSlice",
            "rp-step-zero",
            'spec.devices[0].capacity[memory].requestPolicy.validRange.step: Invalid value: "0": must be '
            "greater than zero",
        ),
    ),
    Row(
        "rp-default-below-min",
        "validateRequestPolicyRange: default below min is reported at validRange.min",
        Call("POST", SLICES, _shared("rp-below", default="1Gi", validRange={"min": "2Gi"})),
        422,
        _invalid(
            "ResourceSlice",
            "rp-below",
            'spec.devices[0].capacity[memory].requestPolicy.validRange.min: Invalid value: "1Gi": default is '
            "less than min: 2Gi",
        ),
    ),
    Row(
        "rp-default-above-max",
        "validateRequestPolicyRange: default above max is reported at validRange.max",
        Call("POST", SLICES, _shared("rp-above", default="9Gi", validRange={"min": "1Gi", "max": "8Gi"})),
        422,
        _invalid(
            "ResourceSlice",
            "rp-above",
            'spec.devices[0].capacity[memory].requestPolicy.validRange.max: Invalid value: "9Gi": default is '
            "more than max: 8Gi",
        ),
    ),
    Row(
        "name-length-bytes",
        "content.MaxLenError: lengths are in bytes",
        Call("POST", SLICES, {**_slice(""), "metadata": {"name": "n" * 254}}),
        422,
        _invalid(
            "ResourceSlice",
            "n" * 254,
            f'metadata.name: Invalid value: "{"n" * 254}": must be no more than 253 bytes',
        ),
    ),
]


@pytest.fixture
async def emu136() -> AsyncIterator[KubeApiEmulator]:
    """A 1.36 emulator with every DRA gate on, as the real server of the measurement."""
    async with KubeApiEmulator(version="1.36", feature_gates=ALL_DRA_GATES) as emulator:
        yield emulator


async def _send(emu: KubeApiEmulator, call: Call, body: Any = None) -> tuple[int, dict[str, Any]]:
    code, answer, _ = await send(
        emu,
        call.method,
        call.path,
        call.body if body is None else body,
        query=call.query,
        content_type=call.content_type,
    )
    return code, answer


@pytest.mark.parametrize("row", ROWS, ids=[r.case for r in ROWS])
async def test_emulator_gives_the_real_apiservers_answer(emu136: KubeApiEmulator, row: Row) -> None:
    for step in row.setup:
        code, answer = await _send(emu136, step)
        assert code in (200, 201), (row.case, step, answer)
    call, body = row.call, None
    if row.status is not None:
        claim = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": row.case},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}},
        }
        code, created = await _send(emu136, Call("POST", CLAIMS, claim))
        assert code == 201, created
        call = Call("PUT", f"{CLAIMS}/{row.case}/status")
        body = {**created, "status": row.status}
    code, answer = await _send(emu136, call, body)
    assert code == row.code, (row.rule, answer)
    if row.message:
        message = answer["message"]
        assert message.startswith(row.message) if row.prefix else message == row.message, (row.rule, message)
        assert message.endswith(row.suffix), (row.rule, message)
    if row.reason is None:
        assert "reason" not in answer, (row.rule, answer)
    elif row.reason is not UNSET:
        assert answer["reason"] == row.reason, (row.rule, answer)
    if row.check is not None:
        assert row.check(answer), (row.rule, answer)


async def test_identical_reapply_keeps_the_resource_version(emu136: KubeApiEmulator) -> None:
    """Agreed already (keep): structured-merge-diff finds nothing changed, the apiserver writes nothing."""
    call = Call("PATCH", f"{SLICES}/same", _yaml(_slice("same")), {"fieldManager": "a"}, APPLY)
    _, first = await _send(emu136, call)
    code, second = await _send(emu136, call)
    assert code == 200 and second["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]


async def test_an_update_takes_fields_from_an_applier(emu136: KubeApiEmulator) -> None:
    """structured-merge-diff ``Updater.Update``: an update never conflicts; the fields it changes leave
    the applier, who then conflicts with the updater when it applies its old value again."""
    await _send(emu136, Call("PATCH", f"{SLICES}/u", _yaml(_slice("u")), {"fieldManager": "a"}, APPLY))
    code, patched = await _send(
        emu136,
        Call("PATCH", f"{SLICES}/u", {"spec": {"pool": {"generation": 5}}}, {"fieldManager": "ctl"}, MERGE),
    )
    assert code == 200
    owners = {(m["manager"], m["operation"]): m["fieldsV1"] for m in patched["metadata"]["managedFields"]}
    assert owners[("ctl", "Update")] == {"f:spec": {"f:pool": {"f:generation": {}}}}
    assert "f:generation" not in owners[("a", "Apply")]["f:spec"]["f:pool"]
    code, answer = await _send(
        emu136, Call("PATCH", f"{SLICES}/u", _yaml(_slice("u")), {"fieldManager": "a"}, APPLY)
    )
    assert code == 409
    assert answer["message"] == (
        'Apply failed with 1 conflict: conflict with "ctl" using resource.k8s.io/v1: .spec.pool.generation'
    )


async def test_the_user_agent_names_an_unnamed_updater(emu136: KubeApiEmulator) -> None:
    """handlers ``managerOrUserAgent``: without fieldManager, the user agent up to its first ``/``."""
    code, created = await _send(emu136, Call("POST", SLICES, _slice("ua")))
    assert code == 201
    (entry,) = created["metadata"]["managedFields"]
    assert entry["manager"] == "Python" and entry["operation"] == "Update"
    assert entry["apiVersion"] == "resource.k8s.io/v1"


async def test_conflicts_with_several_managers_are_grouped(emu136: KubeApiEmulator) -> None:
    """conflict.go ``getConflictMessage``: more than one conflict, grouped by sorted manager."""
    await _send(emu136, Call("POST", SLICES, _slice("g"), {"fieldManager": "post"}))
    await _send(
        emu136,
        Call("PATCH", f"{SLICES}/g", {"metadata": {"labels": {"x": "1"}}}, {"fieldManager": "lab"}, MERGE),
    )
    config = _slice("g", 2)
    config["metadata"]["labels"] = {"x": "2"}
    code, answer = await _send(
        emu136, Call("PATCH", f"{SLICES}/g", _yaml(config), {"fieldManager": "a"}, APPLY)
    )
    assert code == 409
    assert answer["message"] == (
        'Apply failed with 2 conflicts: conflicts with "lab" using resource.k8s.io/v1:\n'
        "- .metadata.labels.x\n"
        'conflicts with "post" using resource.k8s.io/v1:\n'
        "- .spec.pool.generation"
    )


async def test_field_manager_is_checked_on_create_too(emu136: KubeApiEmulator) -> None:
    """meta/v1 ``ValidateCreateOptions`` runs ``ValidateFieldManager`` as well."""
    code, answer = await _send(emu136, Call("POST", SLICES, _slice("cm"), {"fieldManager": "m" * 129}))
    assert code == 422
    assert answer["message"] == (
        'CreateOptions.meta.k8s.io "" is invalid: fieldManager: Too long: may not be more than 128 bytes'
    )


@pytest.mark.parametrize(
    ("ips", "ok"),
    [
        (["10.0.0.1/24", "fd00::1/64"], True),
        (["010.0.0.1/24"], False),  # parsed (sloppy), but not canonical
        (["::ffff:10.0.0.1/120"], False),  # canonical form is 10.0.0.1/24
        ([f"10.0.0.{i}/24" for i in range(17)], False),
    ],
)
async def test_interface_addresses(emu136: KubeApiEmulator, ips: list[str], ok: bool) -> None:
    """``IsValidInterfaceAddress`` (apimachinery ``api/validation/ip.go``) and ``NetworkDeviceDataMaxIPs``."""
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "ips"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}},
    }
    _, created = await _send(emu136, Call("POST", CLAIMS, claim))
    code, answer = await _send(
        emu136, Call("PUT", f"{CLAIMS}/ips/status"), {**created, "status": _status(networkData={"ips": ips})}
    )
    assert (code == 200) == ok, answer
