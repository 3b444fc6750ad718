"""422 Invalid for each apiserver rule the emulator enforces, shaped as the apiserver does."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kubernetes_asyncio.client.exceptions import ApiException

from agent.emulator import ApiError, KubeApiEmulator
from agent.emulator.conversion import from_internal
from tests.emulator.conftest import claim_body, client, slice_body, status_of

Mutation = Callable[[dict[str, Any]], None]


def _spec(change: Callable[[dict[str, Any]], None]) -> Mutation:
    return lambda body: change(body["spec"])


def _device(change: Callable[[dict[str, Any]], None]) -> Mutation:
    return lambda body: change(body["spec"]["devices"][0])


def _set(path: str, value: Any) -> Mutation:
    def apply(body: dict[str, Any]) -> None:
        node = body
        parts = path.split(".")
        for part in parts[:-1]:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if isinstance(node, list):
            node[int(parts[-1])] = value
        else:
            node[parts[-1]] = value

    return apply


def _devices(count: int, **extra: Any) -> Mutation:
    return _spec(lambda s: s.update(devices=[{"name": f"d{i}", **extra} for i in range(count)]))


def _taints(count: int) -> Mutation:
    return _device(
        lambda d: d.update(taints=[{"key": f"k{i}", "effect": "NoSchedule"} for i in range(count)])
    )


def _attributes(count: int) -> Mutation:
    return _device(lambda d: d.update(attributes={f"a{i}": {"int": i} for i in range(count)}, capacity={}))


SLICE_CASES: list[tuple[str, Mutation, str, str]] = [
    ("name", _set("metadata.name", "Bad_Name"), "metadata.name", "FieldValueInvalid"),
    ("driver empty", _set("spec.driver", ""), "spec.driver", "FieldValueRequired"),
    ("driver too long", _set("spec.driver", "a" * 64), "spec.driver", "FieldValueTooLong"),
    ("driver not subdomain", _set("spec.driver", "gpu_example.com"), "spec.driver", "FieldValueInvalid"),
    ("pool name empty", _set("spec.pool.name", ""), "spec.pool.name", "FieldValueRequired"),
    ("pool name too long", _set("spec.pool.name", "a" * 254), "spec.pool.name", "FieldValueTooLong"),
    ("pool name segment", _set("spec.pool.name", "a//b"), "spec.pool.name", "FieldValueInvalid"),
    ("generation negative", _set("spec.pool.generation", -1), "spec.pool.generation", "FieldValueInvalid"),
    (
        "slice count zero",
        _set("spec.pool.resourceSliceCount", 0),
        "spec.pool.resourceSliceCount",
        "FieldValueInvalid",
    ),
    ("no node selection", _spec(lambda s: s.pop("nodeName")), "spec", "FieldValueRequired"),
    ("two node selections", _set("spec.allNodes", True), "spec", "FieldValueInvalid"),
    ("empty node name", _set("spec.nodeName", ""), "spec.nodeName", "FieldValueRequired"),
    (
        "two selector terms",
        _spec(lambda s: s.update(nodeName=None, nodeSelector={"nodeSelectorTerms": [{}, {}]})),
        "spec.nodeSelector.nodeSelectorTerms",
        "FieldValueInvalid",
    ),
    ("too many devices", _devices(129), "spec.devices", "FieldValueTooMany"),
    (
        "device name not a label",
        _set("spec.devices.0.name", "GPU.0"),
        "spec.devices[0].name",
        "FieldValueInvalid",
    ),
    ("device name missing", _device(lambda d: d.pop("name")), "spec.devices[0].name", "FieldValueRequired"),
    (
        "duplicate device",
        _spec(lambda s: s.update(devices=[{"name": "x"}, {"name": "x"}])),
        "spec.devices[1].name",
        "FieldValueDuplicate",
    ),
    ("too many attributes", _attributes(33), "spec.devices[0]", "FieldValueInvalid"),
    (
        "attribute name",
        _set("spec.devices.0.attributes", {"9bad": {"int": 1}}),
        "spec.devices[0].attributes",
        "FieldValueInvalid",
    ),
    (
        "attribute id too long",
        _set("spec.devices.0.attributes", {"a" * 33: {"int": 1}}),
        "spec.devices[0].attributes",
        "FieldValueTooLong",
    ),
    (
        "attribute domain",
        _set("spec.devices.0.attributes", {"Bad_Domain/x": {"int": 1}}),
        "spec.devices[0].attributes",
        "FieldValueInvalid",
    ),
    (
        "two value types",
        _set("spec.devices.0.attributes", {"x": {"int": 1, "bool": True}}),
        "spec.devices[0].attributes[x]",
        "FieldValueInvalid",
    ),
    (
        "no value type",
        _set("spec.devices.0.attributes", {"x": {}}),
        "spec.devices[0].attributes[x]",
        "FieldValueInvalid",
    ),
    (
        "string too long",
        _set("spec.devices.0.attributes", {"x": {"string": "s" * 65}}),
        "spec.devices[0].attributes[x].string",
        "FieldValueTooLong",
    ),
    (
        "version not semver",
        _set("spec.devices.0.attributes", {"x": {"version": "1.2.3.4"}}),
        "spec.devices[0].attributes[x].version",
        "FieldValueInvalid",
    ),
    (
        "version leading zero",
        _set("spec.devices.0.attributes", {"x": {"version": "1.02.3"}}),
        "spec.devices[0].attributes[x].version",
        "FieldValueInvalid",
    ),
    (
        "version too long",
        _set("spec.devices.0.attributes", {"x": {"version": "1.2.3-" + "a" * 60}}),
        "spec.devices[0].attributes[x].version",
        "FieldValueTooLong",
    ),
    (
        "bad quantity",
        _set("spec.devices.0.capacity", {"memory": {"value": "lots"}}),
        "spec.devices[0].capacity[memory].value",
        "FieldValueInvalid",
    ),
    ("too many taints", _taints(5), "spec.devices[0].taints", "FieldValueTooMany"),
    (
        "taint key",
        _set("spec.devices.0.taints", [{"key": "bad key", "effect": "NoSchedule"}]),
        "spec.devices[0].taints[0].key",
        "FieldValueInvalid",
    ),
    (
        "taint key missing",
        _set("spec.devices.0.taints", [{"effect": "NoSchedule"}]),
        "spec.devices[0].taints[0].key",
        "FieldValueRequired",
    ),
    (
        "taint value",
        _set("spec.devices.0.taints", [{"key": "k", "value": "a b", "effect": "NoSchedule"}]),
        "spec.devices[0].taints[0].value",
        "FieldValueInvalid",
    ),
    (
        "taint effect None before 1.35",
        _set("spec.devices.0.taints", [{"key": "k", "effect": "None"}]),
        "spec.devices[0].taints[0].effect",
        "FieldValueNotSupported",
    ),
    (
        "taint effect PreferNoSchedule",
        _set("spec.devices.0.taints", [{"key": "k", "effect": "PreferNoSchedule"}]),
        "spec.devices[0].taints[0].effect",
        "FieldValueNotSupported",
    ),
    (
        "taint effect missing",
        _set("spec.devices.0.taints", [{"key": "k"}]),
        "spec.devices[0].taints[0].effect",
        "FieldValueRequired",
    ),
    (
        "taint time",
        _set("spec.devices.0.taints", [{"key": "k", "effect": "NoSchedule", "timeAdded": "yesterday"}]),
        "spec.devices[0].taints[0].timeAdded",
        "FieldValueInvalid",
    ),
    ("label key", _set("metadata.labels", {"bad key": "v"}), "metadata.labels", "FieldValueInvalid"),
    ("label value", _set("metadata.labels", {"k": "bad value"}), "metadata.labels", "FieldValueInvalid"),
    (
        "two controllers",
        _set(
            "metadata.ownerReferences",
            [
                {"apiVersion": "v1", "kind": "Node", "name": "a", "uid": "1", "controller": True},
                {"apiVersion": "v1", "kind": "Node", "name": "b", "uid": "2", "controller": True},
            ],
        ),
        "metadata.ownerReferences",
        "FieldValueInvalid",
    ),
    (
        "owner without uid",
        _set("metadata.ownerReferences", [{"apiVersion": "v1", "kind": "Node", "name": "a"}]),
        "metadata.ownerReferences[0].uid",
        "FieldValueInvalid",
    ),
]


@pytest.mark.parametrize("case", SLICE_CASES, ids=[c[0] for c in SLICE_CASES])
async def test_slice_rules(emu: KubeApiEmulator, api: Any, case: tuple[str, Mutation, str, str]) -> None:
    name, mutate, field, reason = case
    body = slice_body("valid")
    mutate(body)
    with pytest.raises(ApiException) as caught:
        await client.ResourceV1Api(api).create_resource_slice(body)
    assert caught.value.status == 422, name
    status = status_of(caught.value)
    assert status["reason"] == "Invalid" and status["kind"] == "Status" and status["status"] == "Failure"
    assert status["details"]["kind"] == "ResourceSlice" and status["details"]["group"] == "resource.k8s.io"
    causes = [(c["field"], c["reason"]) for c in status["details"]["causes"]]
    assert (field, reason) in causes, causes
    assert status["message"].startswith(
        f'ResourceSlice.resource.k8s.io "{body["metadata"]["name"]}" is invalid: '
    )


@pytest.mark.parametrize(
    ("release", "mutate"),
    [
        ("1.34", _devices(128)),
        ("1.34", _taints(4)),
        ("1.35", _taints(16)),
        ("1.35", _set("spec.devices.0.taints", [{"key": "k", "effect": "None"}])),
        ("1.34", _attributes(32)),
        ("1.34", _set("spec.devices.0.attributes", {"example.com/x_1": {"version": "1.2.3-rc.1+b.5"}})),
        ("1.34", _set("spec.pool.name", "a.b/c-d")),
        ("1.34", _spec(lambda s: s.update(nodeName=None, allNodes=True))),
    ],
)
async def test_limits_themselves_are_valid(release: str, mutate: Mutation) -> None:
    async with KubeApiEmulator(version=release) as emu:
        body = slice_body("ok")
        mutate(body)
        if body["spec"].get("nodeName") is None:
            body["spec"].pop("nodeName", None)
        emu.create("resourceslices", body)


@pytest.mark.parametrize(
    ("mutate", "field", "reason"),
    [
        (_taints(17), "spec.devices[0].taints", "FieldValueTooMany"),
        (_devices(65, taints=[{"key": "k", "effect": "NoSchedule"}]), "spec.devices", "FieldValueTooMany"),
        (
            _spec(lambda s: s.update(sharedCounters=[{"name": "c", "counters": {}}])),
            "spec",
            "FieldValueInvalid",
        ),
    ],
)
async def test_rules_of_1_35(mutate: Mutation, field: str, reason: str) -> None:
    async with KubeApiEmulator(version="1.35", feature_gates={"DRAPartitionableDevices": True}) as emu:
        body = slice_body("s")
        mutate(body)
        with pytest.raises(ApiError) as caught:
            emu.create("resourceslices", body)
        assert (field, reason) in [(c["field"], c["reason"]) for c in caught.value.details["causes"]]


async def test_error_message_lists_several_causes(emu: KubeApiEmulator) -> None:
    body = slice_body("s")
    body["spec"]["driver"] = ""
    body["spec"]["pool"]["resourceSliceCount"] = 0
    with pytest.raises(ApiError) as caught:
        emu.create("resourceslices", body)
    assert caught.value.code == 422
    assert caught.value.message.startswith(
        'ResourceSlice.resource.k8s.io "s" is invalid: [spec.driver: Required value, '
    )


async def test_capacity_and_taint_time_are_canonicalized(emu: KubeApiEmulator) -> None:
    body = slice_body("s")
    body["spec"]["devices"][0]["capacity"] = {"memory": {"value": "1024Mi"}, "cores": {"value": "1000m"}}
    body["spec"]["devices"][0]["taints"] = [
        {"key": "a/b", "effect": "NoSchedule"},
        {"key": "a/c", "effect": "NoExecute", "timeAdded": "2026-01-01T01:00:00+01:00"},
    ]
    stored = emu.create("resourceslices", body)
    device = stored["spec"]["devices"][0]
    assert device["capacity"] == {"memory": {"value": "1Gi"}, "cores": {"value": "1"}}
    first, second = device["taints"]
    assert first["timeAdded"].endswith("Z") and len(first["timeAdded"]) == 20
    assert second["timeAdded"] == "2026-01-01T00:00:00Z"


CLAIM_CASES: list[tuple[str, Mutation, str]] = [
    ("request name", _set("spec.devices.requests.0.name", "Bad"), "spec.devices.requests[0].name"),
    (
        "class missing",
        _set("spec.devices.requests.0.exactly", {}),
        "spec.devices.requests[0].exactly.deviceClassName",
    ),
    (
        "mode",
        _set("spec.devices.requests.0.exactly.allocationMode", "Some"),
        "spec.devices.requests[0].exactly.allocationMode",
    ),
    ("count", _set("spec.devices.requests.0.exactly.count", 0), "spec.devices.requests[0].exactly.count"),
    (
        "neither exactly nor firstAvailable",
        _set("spec.devices.requests.0", {"name": "x"}),
        "spec.devices.requests[0]",
    ),
    (
        "too many requests",
        _set(
            "spec.devices.requests",
            [{"name": f"r{i}", "exactly": {"deviceClassName": "c"}} for i in range(33)],
        ),
        "spec.devices.requests",
    ),
    (
        "duplicate request",
        _set("spec.devices.requests", [{"name": "r", "exactly": {"deviceClassName": "c"}}] * 2),
        "spec.devices.requests[1].name",
    ),
]


@pytest.mark.parametrize(("case", "mutate", "field"), CLAIM_CASES, ids=[c[0] for c in CLAIM_CASES])
async def test_claim_rules(emu: KubeApiEmulator, case: str, mutate: Mutation, field: str) -> None:
    body = claim_body()
    mutate(body)
    with pytest.raises(ApiError) as caught:
        emu.create("resourceclaims", body, namespace="default")
    assert caught.value.code == 422, case
    assert field in [c["field"] for c in caught.value.details["causes"]]


def _allocated(emu: KubeApiEmulator, results: list[dict[str, Any]]) -> dict[str, Any]:
    claim = emu.create("resourceclaims", claim_body(), namespace="default")
    claim["status"] = {"allocation": {"devices": {"results": results}}}
    return claim


STATUS_CASES: list[tuple[str, Mutation, str]] = [
    (
        "too many results",
        lambda c: c["status"]["allocation"]["devices"].update(
            results=[
                {"request": "gpu", "driver": "d.example.com", "pool": "p", "device": f"g{i}"}
                for i in range(33)
            ]
        ),
        "status.allocation.devices.results",
    ),
    (
        "result missing device",
        lambda c: c["status"]["allocation"]["devices"]["results"][0].pop("device"),
        "status.allocation.devices.results[0].device",
    ),
    (
        "not allocated",
        lambda c: c["status"].update(devices=[{"driver": "d.example.com", "pool": "p", "device": "other"}]),
        "status.devices[0]",
    ),
    (
        "duplicate device status",
        lambda c: c["status"].update(devices=[{"driver": "d.example.com", "pool": "p", "device": "g0"}] * 2),
        "status.devices[1]",
    ),
    (
        "too many conditions",
        lambda c: c["status"].update(
            devices=[{"driver": "d.example.com", "pool": "p", "device": "g0", "conditions": [{}] * 9}]
        ),
        "status.devices[0].conditions",
    ),
    (
        "data too big",
        lambda c: c["status"].update(
            devices=[{"driver": "d.example.com", "pool": "p", "device": "g0", "data": {"x": "y" * 11000}}]
        ),
        "status.devices[0].data",
    ),
    (
        "reservedFor without allocation",
        lambda c: c["status"].update(
            allocation=None, reservedFor=[{"resource": "pods", "name": "p", "uid": "u"}]
        ),
        "status.reservedFor",
    ),
]


@pytest.mark.parametrize(("case", "mutate", "field"), STATUS_CASES, ids=[c[0] for c in STATUS_CASES])
async def test_claim_status_rules(emu: KubeApiEmulator, case: str, mutate: Mutation, field: str) -> None:
    claim = _allocated(emu, [{"request": "gpu", "driver": "d.example.com", "pool": "p", "device": "g0"}])
    mutate(claim)
    if claim["status"].get("allocation") is None:
        claim["status"].pop("allocation", None)
    with pytest.raises(ApiError) as caught:
        emu.update("resourceclaims", claim, subresource="status")
    assert caught.value.code == 422, case
    assert field in [c["field"] for c in caught.value.details["causes"]]


async def test_allocation_is_immutable_once_set(emu: KubeApiEmulator) -> None:
    claim = _allocated(emu, [{"request": "gpu", "driver": "d.example.com", "pool": "p", "device": "g0"}])
    stored = emu.update("resourceclaims", claim, subresource="status")
    changed = copy.deepcopy(stored)
    changed["status"]["allocation"]["devices"]["results"][0]["device"] = "g1"
    with pytest.raises(ApiError) as caught:
        emu.update("resourceclaims", changed, subresource="status")
    assert caught.value.details["causes"][0]["field"] == "status.allocation"


async def test_claim_defaults(emu: KubeApiEmulator) -> None:
    stored = emu.create("resourceclaims", claim_body(), namespace="default")
    assert stored["spec"]["devices"]["requests"][0]["exactly"] == {
        "deviceClassName": "gpu.example.com",
        "allocationMode": "ExactCount",
        "count": 1,
    }


def _rule(taint: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1alpha3",
        "kind": "DeviceTaintRule",
        "metadata": {"name": "rule"},
        "spec": {
            "deviceSelector": {"driver": "gpu.example.com", "pool": "node-a", "device": "gpu-0"},
            "taint": taint,
        },
    }


async def test_device_taint_rules(emu: KubeApiEmulator, api: Any) -> None:
    created = await client.ResourceV1alpha3Api(api).create_device_taint_rule(
        _rule({"key": "a/b", "effect": "NoSchedule"})
    )
    assert created.spec.taint.time_added is not None
    with pytest.raises(ApiException) as caught:
        await client.ResourceV1alpha3Api(api).create_device_taint_rule(
            {**_rule({"key": "bad key", "effect": "Bogus"}), "metadata": {"name": "rule2"}}
        )
    assert caught.value.status == 422
    fields = [c["field"] for c in status_of(caught.value)["details"]["causes"]]
    assert fields == ["spec.taint.key", "spec.taint.effect"]
    with pytest.raises(ApiError):
        emu.create(
            "devicetaintrules",
            {**_rule({"key": "k", "effect": "NoSchedule"}), "metadata": {"name": "r3"}, "spec": {}},
        )


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("spec.pool", "node-a"),
        ("spec.devices", {"name": "x"}),
        ("spec.devices.0.attributes", ["x"]),
        ("spec.devices.0.attributes", {"x": {"int": "1"}}),
        ("spec.devices.0.capacity", {"memory": {"value": 1.5}}),
        ("spec.pool.generation", "1"),
        ("metadata.labels", {"a": 1}),
    ],
)
async def test_wrong_types_are_400_like_the_decoder(emu: KubeApiEmulator, path: str, value: Any) -> None:
    body = slice_body("s")
    _set(path, value)(body)
    with pytest.raises(ApiError) as caught:
        emu.create("resourceslices", body)
    assert caught.value.code == 400
    assert caught.value.message.startswith(
        'ResourceSlice in version "v1" cannot be handled as a ResourceSlice: json:'
    )


_JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 3)
    | st.text(max_size=3)
    | st.floats(allow_nan=False, width=16),
    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=3), inner, max_size=2),
    max_leaves=4,
)


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else []
    for key, value in items:
        out += _paths(value, (*prefix, key))
    return out


_BASE = slice_body("s")
_BASE["spec"]["devices"][0]["taints"] = [{"key": "a/b", "effect": "NoSchedule"}]
_PATHS = _paths(_BASE)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
async def test_any_malformed_slice_gets_an_api_error_never_a_crash(
    emu: KubeApiEmulator, data: st.DataObject
) -> None:
    body = copy.deepcopy(_BASE)
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(_PATHS))
        node: Any = body
        try:
            for part in path[:-1]:
                node = node[part]
            node[path[-1]] = data.draw(_JSON_VALUES)
        except (KeyError, IndexError, TypeError):
            continue
    version = data.draw(st.sampled_from(["v1", "v1beta1", "v1beta2"]))
    rtype = emu.registry.type_for("resource.k8s.io", "resourceslices")
    if version == "v1beta1":
        body = from_internal(rtype, "v1beta1", body)
    try:
        created = emu.registry.create(rtype, version, body)
    except ApiError as error:
        assert error.code in (400, 422)
    else:
        emu.delete("resourceslices", created["metadata"]["name"])
