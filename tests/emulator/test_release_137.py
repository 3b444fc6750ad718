"""Release 1.37: where the emulated apiserver differs from 1.36.

From ``shared/reference/kubernetes-1.37-for-drivers.md``, then the upstream rules (kubernetes/kubernetes,
1.37 line): ``pkg/features/kube_features.go`` (gate defaults and locks; ``featuregate.Set`` refuses a
locked gate), ``pkg/registry/resource/rest/storage_resource.go`` (DeviceTaintRule GA in resource.k8s.io/v1),
``pkg/registry/resource/resourceslice/strategy.go`` (``ResourceSliceSelectableFields`` with
``spec.pool.name``; ``dropDisabledFields`` for the new alpha fields), ``staging/src/k8s.io/api/resource/v1/
types.go`` (``nodeAllocatableResources`` replaces ``nodeAllocatableResourceMappings``;
``partitionTypeAttribute``, ``skipNodeOperations``) and ``pkg/apis/resource/validation/validation.go``
(``validateRequestPolicyRange`` with ``DRAFractionalCapacityRange``: milli-unit arithmetic, see
``validation_resourceslice_capacity_test.go``).
"""

from __future__ import annotations

from typing import Any

import pytest

from agent.emulator import KubeApiEmulator
from agent.emulator.__main__ import _parse, main
from tests.emulator.conftest import send

DRIVER = "gpu.example.com"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"


def _slice(name: str, pool: str = "node-a", **device: Any) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": DRIVER,
            "nodeName": "node-a",
            "pool": {"name": pool, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "gpu-0", **device}],
        },
    }


def _rule(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceTaintRule",
        "metadata": {"name": name},
        "spec": {
            "deviceSelector": {"driver": DRIVER, "pool": "node-a", "device": "gpu-0"},
            "taint": {"key": "example.com/maintenance", "effect": "NoSchedule"},
        },
    }


async def test_release_137_is_served_with_every_resource_version() -> None:
    """1.37 serves v1 first and still v1beta2/v1beta1 (removed in 1.39/1.38)."""
    async with KubeApiEmulator(version="1.37") as emu:
        code, group, _ = await send(emu, "GET", "/apis/resource.k8s.io")
        assert code == 200 and [v["version"] for v in group["versions"]][:3] == ["v1", "v1beta2", "v1beta1"]
        _, version, _ = await send(emu, "GET", "/version")
        assert version["gitVersion"] == "v1.37.0" and version["minor"] == "37"
    assert _parse(["--version", "1.37"]).version == "1.37"


@pytest.mark.parametrize(
    ("release", "gates"),
    [
        (
            "1.36",
            {"DRADeviceTaints": True, "DRADeviceTaintRules": False, "DRAExtendedResource": True},
        ),
        (
            "1.37",
            {
                "DRADeviceTaints": True,
                "DRADeviceTaintRules": True,
                "DRAExtendedResource": True,
                "DRAResourceClaimDeviceStatus": True,
                "DRAPrioritizedList": True,
                "DRAFractionalCapacityRange": True,
                "DRAWorkloadResourceClaims": False,
                "DRAOptionalNodeOperations": False,
                "DRADerivedAttributes": False,
                "DRADeviceCompatibilityGroups": False,
                "DRAPartitionableDevicesType": False,
                "DRAListTypeAttributes": False,
                "DRANodeAllocatableResources": False,
            },
        ),
    ],
)
async def test_gate_defaults(release: str, gates: dict[str, bool]) -> None:
    """kube_features.go: DeviceTaintRules GA and on in 1.37, fractional ranges beta and on."""
    async with KubeApiEmulator(version=release) as emu:
        assert {name: emu.feature_gates.get(name, False) for name in gates} == gates


@pytest.mark.parametrize(
    "gate", ["DRAExtendedResource", "DRAResourceClaimDeviceStatus", "DRAPrioritizedList"]
)
async def test_locked_gates_cannot_be_turned_off(gate: str) -> None:
    """featuregate ``LockToDefault``: kube-apiserver refuses to start with a locked gate changed."""
    message = f"cannot set feature gate {gate} to false, feature is locked to true"
    with pytest.raises(ValueError, match=message):
        KubeApiEmulator(version="1.37", feature_gates={gate: False})
    async with KubeApiEmulator(version="1.37", feature_gates={gate: True}) as emu:
        with pytest.raises(ValueError, match=message):
            emu.set_feature_gate(gate, False)
    with pytest.raises(SystemExit, match=message):
        main(["--version", "1.37", "--feature-gate", f"{gate}=false"])
    # 1.36 does not lock them.
    async with KubeApiEmulator(version="1.36", feature_gates={gate: False}) as emu:
        assert emu.feature_gates[gate] is False


async def test_device_taint_rules_are_ga_in_v1() -> None:
    """1.37 serves DeviceTaintRule (with status) in resource.k8s.io/v1, on by default; 1.36 does not."""
    async with KubeApiEmulator(version="1.37") as emu:
        _, resources, _ = await send(emu, "GET", "/apis/resource.k8s.io/v1")
        names = {r["name"] for r in resources["resources"]}
        assert {"devicetaintrules", "devicetaintrules/status"} <= names
        code, created, _ = await send(emu, "POST", "/apis/resource.k8s.io/v1/devicetaintrules", _rule("r"))
        assert code == 201 and created["apiVersion"] == "resource.k8s.io/v1"
        assert created["spec"]["taint"]["timeAdded"]
        code, listed, _ = await send(emu, "GET", "/apis/resource.k8s.io/v1beta2/devicetaintrules")
        assert code == 200 and [i["metadata"]["name"] for i in listed["items"]] == ["r"]
    async with KubeApiEmulator(version="1.37", feature_gates={"DRADeviceTaintRules": False}) as emu:
        code, _, _ = await send(emu, "GET", "/apis/resource.k8s.io/v1/devicetaintrules")
        assert code == 404
    async with KubeApiEmulator(version="1.36") as emu:
        code, _, _ = await send(emu, "GET", "/apis/resource.k8s.io/v1/devicetaintrules")
        assert code == 404


async def test_resource_slices_select_by_pool_name_from_137() -> None:
    """1.37 adds the ``spec.pool.name`` field selector on ResourceSlices; 1.36 refuses it (400)."""
    async with KubeApiEmulator(version="1.37") as emu:
        await send(emu, "POST", SLICES, _slice("a", pool="pool-a"))
        await send(emu, "POST", SLICES, _slice("b", pool="pool-b"))
        code, listed, _ = await send(emu, "GET", SLICES, query={"fieldSelector": "spec.pool.name=pool-b"})
        assert code == 200 and [i["metadata"]["name"] for i in listed["items"]] == ["b"]
    async with KubeApiEmulator(version="1.36") as emu:
        code, answer, _ = await send(emu, "GET", SLICES, query={"fieldSelector": "spec.pool.name=pool-b"})
        assert code == 400 and answer["message"] == "field label not supported: spec.pool.name"


@pytest.mark.parametrize(
    ("release", "field", "known"),
    [
        ("1.36", "nodeAllocatableResourceMappings", True),
        ("1.37", "nodeAllocatableResourceMappings", False),
        ("1.36", "nodeAllocatableResources", False),
        ("1.37", "nodeAllocatableResources", True),
    ],
)
async def test_node_allocatable_field_was_renamed(release: str, field: str, known: bool) -> None:
    """The device field of DRANodeAllocatableResources was renamed in 1.37; the old name is unknown."""
    gates = {"DRANodeAllocatableResources": True}
    async with KubeApiEmulator(version=release, feature_gates=gates) as emu:
        body = _slice("s")
        body["spec"]["devices"][0][field] = {"cpu": {}}
        code, answer, _ = await send(emu, "POST", SLICES, body, query={"fieldValidation": "Strict"})
        if known:
            assert code == 201 and answer["spec"]["devices"][0][field] == {"cpu": {}}
        else:
            assert code == 400
            assert answer["message"].endswith(f'unknown field "spec.devices[0].{field}"')


@pytest.mark.parametrize(
    ("field", "gate"),
    [
        ("partitionTypeAttribute", "DRAPartitionableDevicesType"),
        ("skipNodeOperations", "DRAOptionalNodeOperations"),
    ],
)
async def test_new_slice_spec_fields_follow_their_alpha_gates(field: str, gate: str) -> None:
    """Unknown before 1.37; dropped while their alpha gate is off (dropDisabledFields), kept when on."""
    value: Any = "example.com/type" if field == "partitionTypeAttribute" else True
    body = _slice("s")
    body["spec"][field] = value
    async with KubeApiEmulator(version="1.36") as emu:
        code, answer, _ = await send(emu, "POST", SLICES, body, query={"fieldValidation": "Strict"})
        assert code == 400 and answer["message"].endswith(f'unknown field "spec.{field}"')
    async with KubeApiEmulator(version="1.37") as emu:
        code, answer, _ = await send(emu, "POST", SLICES, body, query={"fieldValidation": "Strict"})
        assert code == 201 and field not in answer["spec"]
    async with KubeApiEmulator(version="1.37", feature_gates={gate: True}) as emu:
        code, answer, _ = await send(emu, "POST", SLICES, body)
        assert code == 201 and answer["spec"][field] == value


def _ranged(name: str, capacity: str, **policy: Any) -> dict[str, Any]:
    return _slice(
        name, allowMultipleAllocations=True, capacity={"cores": {"value": capacity, "requestPolicy": policy}}
    )


RANGE = "spec.devices[0].capacity[cores].requestPolicy.validRange"


@pytest.mark.parametrize(
    ("policy", "message_136", "message_137"),
    [
        # validation_resourceslice_capacity_test.go: valid-range-fractional-step
        ({"default": "200m", "validRange": {"min": "200m", "max": "1", "step": "100m"}}, "", ""),
        # invalid-range-fractional-step-not-aligned: only caught with milli-unit arithmetic
        (
            {"default": "250m", "validRange": {"min": "200m", "max": "1", "step": "100m"}},
            "",
            f'{RANGE}.step: Invalid value: "250m": value is not a multiple of a given step (100m) '
            "from (200m)",
        ),
        # fractional-too-fine-precision
        (
            {"default": "20u", "validRange": {"min": "10u"}},
            "",
            f'[{RANGE}.default: Invalid value: "20u": value cannot be represented as a milli value, '
            f'{RANGE}.min: Invalid value: "10u": value cannot be represented as a milli value]',
        ),
    ],
)
async def test_fractional_capacity_ranges(policy: dict[str, Any], message_136: str, message_137: str) -> None:
    """DRAFractionalCapacityRange (beta, on in 1.37): a range with a fractional bound or step uses
    milli-unit arithmetic; 1.36 rounds every value up to an integer (``Quantity.Value()``)."""
    for release, expected in (("1.36", message_136), ("1.37", message_137)):
        async with KubeApiEmulator(version=release) as emu:
            code, answer, _ = await send(emu, "POST", SLICES, _ranged("s", "1", **policy))
            if not expected:
                assert code == 201, (release, answer)
            else:
                assert code == 422, (release, answer)
                assert answer["message"] == f'ResourceSlice.resource.k8s.io "s" is invalid: {expected}'


async def test_fractional_ranges_follow_the_gate() -> None:
    """With DRAFractionalCapacityRange off, 1.37 validates ranges as 1.36 does."""
    policy = {"default": "250m", "validRange": {"min": "200m", "max": "1", "step": "100m"}}
    async with KubeApiEmulator(version="1.37", feature_gates={"DRAFractionalCapacityRange": False}) as emu:
        code, answer, _ = await send(emu, "POST", SLICES, _ranged("s", "1", **policy))
        assert code == 201, answer
