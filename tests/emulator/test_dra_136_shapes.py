"""Consumable capacity, partitionable devices and device taints as a real 1.36 apiserver validates them
(``shared/reference/dra-1.36-verified-shapes.md``), and how the same requests fare on older releases.

Rules: kubernetes/kubernetes ``pkg/apis/resource/validation/validation.go``
(``validateSingleAllocatableDeviceCapacity``, ``validateRequestPolicy``, ``validateRequestPolicyRange``,
``validateRequestPolicyValidValues``, ``validateCounterSet``, ``validateDeviceCounterConsumption``,
``validateResourceSliceSpec`` device limits, ``validateDeviceTaint``), the limits in
``staging/src/k8s.io/api/resource/v1/types.go`` and the gate defaults of ``pkg/features/kube_features.go``
(dropped fields: ``pkg/registry/resource/resourceslice/strategy.go`` ``dropDisabledFields``).
"""

from __future__ import annotations

from typing import Any

import pytest

from agent.emulator import ApiError, KubeApiEmulator

DRIVER = "gpu.nvidia.com"
RP = "spec.devices[0].capacity[memory].requestPolicy"


def _slice(name: str, devices: list[dict[str, Any]] | None = None, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": DRIVER,
            "nodeName": "verify-n1",
            "pool": {"name": "verify-n1", "generation": 1, "resourceSliceCount": 1},
            **spec,
        },
    }
    if devices is not None:
        body["spec"]["devices"] = devices
    return body


def _cap(value: str, **policy: Any) -> dict[str, Any]:
    return {"memory": {"value": value, **({"requestPolicy": policy} if policy else {})}}


def _shared(value: str, **policy: Any) -> list[dict[str, Any]]:
    return [{"name": "gpu-0", "allowMultipleAllocations": True, "capacity": _cap(value, **policy)}]


def _counters(n: int) -> dict[str, Any]:
    return {f"c-{i}": {"value": "1"} for i in range(n)}


def _consumer(name: str, sets: list[str], counters: int = 1) -> dict[str, Any]:
    return {
        "name": name,
        "consumesCounters": [{"counterSet": s, "counters": _counters(counters)} for s in sets],
    }


MIG_COUNTERS = {f"memory-slice-{i}": {"value": "1"} for i in range(8)} | {
    f"compute-slice-{i}": {"value": "1"} for i in range(7)
}

ACCEPTED: list[tuple[str, dict[str, Any]]] = [
    (
        "consumable capacity slice of section 1",
        _slice(
            "cc",
            [
                {
                    "name": "gpu-range",
                    "allowMultipleAllocations": True,
                    "attributes": {"kind": {"string": "range"}},
                    "capacity": _cap(
                        "80Gi", default="10Gi", validRange={"min": "10Gi", "max": "80Gi", "step": "10Gi"}
                    ),
                },
                {
                    "name": "gpu-values",
                    "allowMultipleAllocations": True,
                    "capacity": _cap("40Gi", default="8Gi", validValues=["8Gi", "16Gi", "40Gi"]),
                },
                {"name": "gpu-nopolicy", "allowMultipleAllocations": True, "capacity": _cap("80Gi")},
                {"name": "gpu-nocap", "allowMultipleAllocations": True},
                {"name": "gpu-excl", "capacity": _cap("80Gi")},
            ],
        ),
    ),
    ("range with min only", _slice("r", _shared("80Gi", default="1Gi", validRange={"min": "1Gi"}))),
    ("default alone", _slice("d", _shared("80Gi", default="1Gi"))),
    (
        "counter slice of a MIG-like pool",
        _slice("counters", sharedCounters=[{"name": "gpu-0-counter-set", "counters": MIG_COUNTERS}]),
    ),
    (
        "device slice of a MIG-like pool",
        _slice(
            "devices",
            [
                {
                    "name": "gpu-0",
                    "attributes": {"profile": {"string": "whole"}, "placement": {"int": 0}},
                    "capacity": _cap("40Gi"),
                    "consumesCounters": [{"counterSet": "gpu-0-counter-set", "counters": MIG_COUNTERS}],
                },
                *[
                    {
                        "name": f"gpu-0-mig-1g-{i}",
                        "consumesCounters": [
                            {
                                "counterSet": "gpu-0-counter-set",
                                "counters": {
                                    f"memory-slice-{i}": {"value": "1"},
                                    f"compute-slice-{i}": {"value": "1"},
                                },
                            }
                        ],
                    }
                    for i in range(7)
                ],
            ],
        ),
    ),
    (
        "8 counter sets",
        _slice("sets", sharedCounters=[{"name": f"s-{i}", "counters": _counters(1)} for i in range(8)]),
    ),
    ("64 counter-consuming devices", _slice("c64", [_consumer(f"d-{i}", ["a"]) for i in range(64)])),
    ("128 plain devices", _slice("p128", [{"name": f"d-{i}"} for i in range(128)])),
    ("a counterSet no slice defines", _slice("ref", [_consumer("d", ["a", "b"])])),
    (
        "taints None and NoSchedule, several on one device",
        _slice(
            "taints",
            [
                {
                    "name": "dev-noschedule",
                    "taints": [
                        {"key": "taint.example.com/unhealthy", "value": "ecc", "effect": "NoSchedule"}
                    ],
                },
                {
                    "name": "dev-none",
                    "taints": [
                        {"key": "taint.example.com/degraded", "value": "true", "effect": "None"},
                        {"key": "taint.example.com/failed", "value": "xid79", "effect": "NoExecute"},
                    ],
                },
            ],
        ),
    ),
]


@pytest.mark.parametrize("body", [b for _, b in ACCEPTED], ids=[n for n, _ in ACCEPTED])
async def test_shapes_a_real_1_36_apiserver_accepts(body: dict[str, Any]) -> None:
    async with KubeApiEmulator(version="1.36") as emu:
        stored = emu.create("resourceslices", body)
    assert len(stored["spec"].get("devices", [])) == len(body["spec"].get("devices", []))


async def test_taints_get_time_added_and_claims_may_request_any_capacity() -> None:
    async with KubeApiEmulator(version="1.36") as emu:
        emu.create("resourceslices", _slice("t", [{"name": "d", "taints": [{"key": "k", "effect": "None"}]}]))
        stored = emu.get("resourceslices", "t")
        assert stored is not None and stored["spec"]["devices"][0]["taints"][0]["timeAdded"].endswith("Z")
        for name, amount in (("neg", "-1Gi"), ("zero", "0")):
            claim = {
                "metadata": {"name": name},
                "spec": {
                    "devices": {
                        "requests": [
                            {
                                "name": "gpu",
                                "exactly": {
                                    "deviceClassName": DRIVER,
                                    "selectors": [
                                        {"cel": {"expression": "!device.allowMultipleAllocations"}}
                                    ],
                                    "capacity": {"requests": {"memory": amount}},
                                },
                            }
                        ]
                    }
                },
            }
            emu.create("resourceclaims", claim)


REJECTED: list[tuple[str, list[dict[str, Any]] | None, dict[str, Any], list[str]]] = [
    (
        "requestPolicy without allowMultipleAllocations",
        [{"name": "gpu-0", "capacity": _cap("80Gi", default="1Gi")}],
        {},
        ["spec.devices[0].capacity[memory].requestPolicy: Forbidden: allowMultipleAllocations must be true"],
    ),
    (
        "default and max off the step",
        _shared("80Gi", default="15Gi", validRange={"min": "10Gi", "max": "75Gi", "step": "10Gi"}),
        {},
        [
            'spec.devices[0].capacity[memory].requestPolicy.validRange.step: Invalid value: "15Gi": value is '
            "not a multiple of a given step (10Gi) from (10Gi)",
            'spec.devices[0].capacity[memory].requestPolicy.validRange.step: Invalid value: "75Gi": value is '
            "not a multiple of a given step (10Gi) from (10Gi)",
        ],
    ),
    (
        "max above the capacity",
        _shared("80Gi", default="10Gi", validRange={"min": "10Gi", "max": "90Gi", "step": "10Gi"}),
        {},
        [
            'spec.devices[0].capacity[memory].requestPolicy.validRange.max: Invalid value: "90Gi": max is '
            "larger than capacity value: 80Gi"
        ],
    ),
    (
        "unsorted values",
        _shared("40Gi", default="8Gi", validValues=["16Gi", "8Gi"]),
        {},
        [f'{RP}.validValues[1]: Invalid value: "8Gi": values must be sorted in ascending order'],
    ),
    (
        "a value above the capacity",
        _shared("40Gi", default="8Gi", validValues=["8Gi", "16Gi", "80Gi"]),
        {},
        [
            'spec.devices[0].capacity[memory].requestPolicy.validValues[2]: Invalid value: "80Gi": option is '
            "larger than capacity value: 40Gi"
        ],
    ),
    (
        "default not among the values",
        _shared("40Gi", default="10Gi", validValues=["8Gi", "16Gi"]),
        {},
        [
            f'{RP}.validValues: Invalid value: "10Gi": default value is not valid according to the '
            "requestPolicy"
        ],
    ),
    (
        "11 validValues (and the default then reported as not valid)",
        _shared("80Gi", default="1Gi", validValues=[f"{i}Gi" for i in range(1, 12)]),
        {},
        [
            f"{RP}.validValues: Too many: 11: must have at most 10 items",
            'spec.devices[0].capacity[memory].requestPolicy.validValues: Invalid value: "1Gi": default value '
            "is not valid according to the requestPolicy",
        ],
    ),
    (
        "sharedCounters and devices in one slice",
        [{"name": "d"}],
        {"sharedCounters": [{"name": "a", "counters": _counters(1)}]},
        ['spec: Invalid value: "": only one of `sharedCounters` or `devices` is allowed'],
    ),
    (
        "9 counter sets",
        None,
        {"sharedCounters": [{"name": f"s-{i}", "counters": _counters(1)} for i in range(9)]},
        ["spec.sharedCounters: Too many: 9: must have at most 8 items"],
    ),
    (
        "33 counters in a set",
        None,
        {"sharedCounters": [{"name": "a", "counters": _counters(33)}]},
        ["spec.sharedCounters[0].counters: Too many: 33: must have at most 32 items"],
    ),
    (
        "3 consumesCounters entries",
        [_consumer("d", ["a", "b", "c"])],
        {},
        ["spec.devices[0].consumesCounters: Too many: 3: must have at most 2 items"],
    ),
    (
        "33 counters in a consumption",
        [_consumer("d", ["a"], counters=33)],
        {},
        ["spec.devices[0].consumesCounters[0].counters: Too many: 33: must have at most 32 items"],
    ),
    (
        "65 counter-consuming devices",
        [_consumer(f"d-{i}", ["a"]) for i in range(65)],
        {},
        ["spec.devices: Too many: 65: must have at most 64 items"],
    ),
    (
        "129 plain devices",
        [{"name": f"d-{i}"} for i in range(129)],
        {},
        ["spec.devices: Too many: 129: must have at most 128 items"],
    ),
    (
        "the same counterSet twice in one device",
        [_consumer("d", ["a", "a"])],
        {},
        ['spec.devices[0].consumesCounters[1]: Duplicate value: "a"'],
    ),
    (
        "a counter-set name that is not a DNS label",
        None,
        {"sharedCounters": [{"name": "gpu0Set", "counters": _counters(1)}]},
        ['spec.sharedCounters[0].name: Invalid value: "gpu0Set": a lowercase RFC 1123 label'],
    ),
    (
        "a counter name that is not a DNS label",
        None,
        {"sharedCounters": [{"name": "a", "counters": {"memorySlice0": {"value": "1"}}}]},
        ['spec.sharedCounters[0].counters: Invalid value: "memorySlice0": a lowercase RFC 1123 label'],
    ),
    (
        "taint effect PreferNoSchedule",
        [{"name": "d", "taints": [{"key": "k", "effect": "PreferNoSchedule"}]}],
        {},
        [
            'spec.devices[0].taints[0].effect: Unsupported value: "PreferNoSchedule": supported values: '
            '"NoExecute", "NoSchedule", "None"'
        ],
    ),
    (
        "taint effect missing",
        [{"name": "d", "taints": [{"key": "k"}]}],
        {},
        ["spec.devices[0].taints[0].effect: Required value"],
    ),
    (
        "17 taints",
        [{"name": "d", "taints": [{"key": f"k{i}", "effect": "NoSchedule"} for i in range(17)]}],
        {},
        ["spec.devices[0].taints: Too many: 17: must have at most 16 items"],
    ),
]


@pytest.mark.parametrize(
    ("devices", "spec", "errors"), [r[1:] for r in REJECTED], ids=[r[0] for r in REJECTED]
)
async def test_rejections_of_a_real_1_36_apiserver(
    devices: list[dict[str, Any]] | None, spec: dict[str, Any], errors: list[str]
) -> None:
    async with KubeApiEmulator(version="1.36") as emu:
        with pytest.raises(ApiError) as caught:
            emu.create("resourceslices", _slice("s", devices, **spec))
    assert caught.value.code == 422
    causes = [f"{c['field']}: {c['message']}" for c in caught.value.details["causes"]]
    assert len(causes) == len(errors), causes
    for cause, expected in zip(causes, errors, strict=True):
        assert cause.startswith(expected), (cause, expected)


async def test_older_releases_drop_the_fields_of_their_off_gates() -> None:
    """1.35 has DRAConsumableCapacity and DRAPartitionableDevices off by default: their fields are
    dropped (strategy.go ``dropDisabledFields``), so what 1.36 rejects is stored without them."""
    body = _slice(
        "s",
        [
            {
                "name": "d",
                "capacity": _cap("80Gi", default="1Gi"),
                "consumesCounters": [{"counterSet": "Bad_Set"}],
            }
        ],
    )
    async with KubeApiEmulator(version="1.35") as emu:
        stored = emu.create("resourceslices", body)
    assert stored["spec"]["devices"][0] == {"name": "d", "capacity": {"memory": {"value": "80Gi"}}}
    async with KubeApiEmulator(version="1.36") as emu:
        with pytest.raises(ApiError) as caught:
            emu.create("resourceslices", body)
    assert [c["field"] for c in caught.value.details["causes"]] == [
        "spec.devices[0].capacity[memory].requestPolicy",
        "spec.devices[0].consumesCounters[0].counterSet",
        "spec.devices[0].consumesCounters[0].counters",
    ]


@pytest.mark.parametrize(
    ("release", "gates", "answer"),
    [
        ("1.35", {}, 'unknown field "spec.devices[0].attributes.l.strings"'),
        ("1.36", {}, 'spec.devices[0].attributes[l]: Invalid value: "": exactly one value must be specified'),
        ("1.36", {"DRAListTypeAttributes": True}, ""),
    ],
)
async def test_list_attributes_exist_from_1_36_behind_their_gate(
    release: str, gates: dict[str, bool], answer: str
) -> None:
    async with KubeApiEmulator(version=release, feature_gates=gates) as emu:
        emu.registry.field_validation = "Strict"
        body = _slice("s", [{"name": "d", "attributes": {"l": {"strings": ["a"]}}}])
        if not answer:
            assert emu.create("resourceslices", body)["spec"]["devices"][0]["attributes"] == {
                "l": {"strings": ["a"]}
            }
            return
        with pytest.raises(ApiError) as caught:
            emu.create("resourceslices", body)
    assert answer in caught.value.message


async def test_list_items_count_toward_48_attribute_values() -> None:
    async with KubeApiEmulator(version="1.36", feature_gates={"DRAListTypeAttributes": True}) as emu:
        fits = {"l": {"ints": list(range(47))}, "x": {"int": 1}}
        emu.create("resourceslices", _slice("ok", [{"name": "d", "attributes": fits}]))
        with pytest.raises(ApiError) as caught:
            emu.create(
                "resourceslices", _slice("s", [{"name": "d", "attributes": {**fits, "y": {"int": 2}}}])
            )
    assert caught.value.details["causes"][0]["message"] == (
        "Invalid value: 49: the total number of attribute values must not exceed 48"
    )


@pytest.mark.parametrize(
    ("release", "gates", "kept"),
    [
        ("1.35", {}, False),
        ("1.36", {}, True),
        ("1.36", {"DRAResourceClaimDeviceStatus": False}, False),
    ],
)
async def test_binding_conditions_need_both_gates(release: str, gates: dict[str, bool], kept: bool) -> None:
    async with KubeApiEmulator(version=release, feature_gates=gates) as emu:
        device = {
            "name": "d",
            "bindsToNode": True,
            "bindingConditions": ["c"],
            "bindingFailureConditions": ["f"],
        }
        stored = emu.create("resourceslices", _slice("s", [device]))
    assert (stored["spec"]["devices"][0] == device) is kept


def test_1_36_gate_defaults_follow_kube_features() -> None:
    from agent.emulator.registry import default_gates

    gates = default_gates("1.36")
    for name in (
        "DRAConsumableCapacity",
        "DRADeviceBindingConditions",
        "DRAPartitionableDevices",
        "DRADeviceTaints",
    ):
        assert gates[name] is True, name
    assert gates["DRAListTypeAttributes"] is False and gates["DRADeviceTaintRules"] is False
    assert default_gates("1.35")["DRAConsumableCapacity"] is False
