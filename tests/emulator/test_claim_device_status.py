"""The API server's rules for a claim's ``status.devices``, 1.34-1.37, as a driver meets them.

Upstream, read for each rule:

- ``pkg/apis/resource/validation/validation.go``: ``validateResourceClaimStatusUpdate`` (entries are a
  set keyed by driver, pool, device and shareID) and ``validateDeviceStatus`` (each entry must be
  an allocated device *with its shareID*, ``gatherAllocatedDevices`` /
  ``structured.MakeSharedDeviceID``; at most 8 conditions, metav1 ``ValidateConditions``; ``data``
  a JSON object of at most 10 KiB, ``validateRawExtension``; ``networkData``);
- ``pkg/registry/resource/resourceclaim/strategy.go``: the status strategy drops ``shareID`` while
  ``DRAConsumableCapacity`` is off and unused (1.34, 1.35 by default), and checks device-status
  authorization;
- ``pkg/registry/resource/authz.go``: ``AuthorizedForDeviceStatus`` (``getModifiedDrivers``,
  ``nodeNameFromAllocation``, ``saAssociatedWithAllocatedNode``): from 1.36
  (``DRAResourceClaimGranularStatusAuthorization``, beta, on) a changed entry of a driver needs
  ``associated-node:<verb>`` (the writer's ServiceAccount token is bound to the claim's node) or
  ``arbitrary-node:<verb>`` on ``resourceclaims/driver`` named after the driver: a Forbidden field
  error, so a 422;
- ``staging/src/k8s.io/api/resource/v1/types.go``: ``status.devices`` is ``+listType=map`` keyed by
  driver, device, pool and shareID, so two drivers' server-side applies keep each other's entries.

The first test is the issue-31 report: the entry of a share without its shareID, refused with the
real server's words.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import yaml

from agent.emulator import KubeApiEmulator
from agent.emulator.authz import Identity, Rule
from agent.emulator.errors import ApiError
from tests.deploy.chart import cluster_role_rules
from tests.emulator.conftest import send

NODE = "node1"
NVIDIA, AMD = "gpu.nvidia.com", "gpu.amd.com"
APPLY = "application/apply-patch+yaml"
TOKEN = "agent-token"
SHARE_A, SHARE_B = str(uuid.uuid4()), str(uuid.uuid4())


def _result(device: str, share: str | None = None, driver: str = NVIDIA) -> dict[str, Any]:
    result = {"request": "gpu", "driver": driver, "pool": NODE, "device": device}
    return {**result, "shareID": share} if share else result


def _selector(node: str) -> dict[str, Any]:
    return {
        "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]
    }


def allocate(
    emu: KubeApiEmulator, name: str, results: list[dict[str, Any]], node: str = NODE
) -> dict[str, Any]:
    """A claim the scheduler allocated `results` to, on `node` (no selector when `node` is empty)."""
    claim = emu.create(
        "resourceclaims",
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu"}}]}},
        },
    )
    allocation: dict[str, Any] = {"devices": {"results": results}}
    if node:
        allocation["nodeSelector"] = _selector(node)
    claim["status"] = {"allocation": allocation}
    return emu.update("resourceclaims", claim, subresource="status")


def entry(device: str, share: str | None = None, driver: str = NVIDIA, **extra: Any) -> dict[str, Any]:
    """A ``status.devices`` entry as the agent writes it."""
    item: dict[str, Any] = {"driver": driver, "pool": NODE, "device": device}
    if share:
        item["shareID"] = share
    condition = {
        "type": "Ready",
        "status": "True",
        "reason": "Prepared",
        "message": "",
        "lastTransitionTime": "2026-11-23T20:25:27Z",
    }
    return {**item, "conditions": [condition], "data": {"uuid": "GPU-1"}, **extra}


async def apply(
    emu: KubeApiEmulator, name: str, entries: list[dict[str, Any]], *, driver: str = NVIDIA, token: str = ""
) -> tuple[int, dict[str, Any]]:
    """The agent's server-side apply of its entries (field manager ``dra-agent/<driver>``)."""
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "status": {"devices": entries},
    }
    code, answer, _ = await send(
        emu,
        "PATCH",
        f"/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/{name}/status",
        yaml.safe_dump(body),
        query={"fieldManager": f"dra-agent/{driver}", "force": "true"},
        content_type=APPLY,
        token=token,
    )
    return code, answer


@pytest.fixture
async def emu() -> AsyncIterator[KubeApiEmulator]:
    async with KubeApiEmulator(version="1.36") as emulator:
        yield emulator


def agent_identity(node: str = NODE, drivers: tuple[str, ...] = (NVIDIA,)) -> Identity:
    """The agent's ServiceAccount with the chart's ClusterRole, its token bound to a pod on `node`."""
    values = {"backends": {"nvidia": {"enabled": NVIDIA in drivers}, "amd": {"enabled": AMD in drivers}}}
    rules = tuple(Rule.from_policy(r) for r in cluster_role_rules(values))
    return Identity("system:serviceaccount:kube-system:dra-agent", rules, node=node)


# -- shareID -------------------------------------------------------------------------------------


async def test_a_shares_entry_without_its_share_id_is_refused_as_the_real_server_does(
    emu: KubeApiEmulator,
) -> None:
    allocate(emu, "share", [_result("gpu-5", SHARE_A)])
    code, answer = await apply(emu, "share", [entry("gpu-5")])
    assert code == 422
    assert answer["message"] == (
        'ResourceClaim.resource.k8s.io "share" is invalid: status.devices[0]: Invalid value: '
        '{"Driver":"gpu.nvidia.com","Pool":"node1","Device":"gpu-5","ShareID":""}: '
        "must be an allocated device in the claim"
    )


async def test_each_share_of_one_device_is_its_own_entry(emu: KubeApiEmulator) -> None:
    allocate(emu, "two", [_result("gpu-5", SHARE_A), _result("gpu-5", SHARE_B)])
    code, answer = await apply(emu, "two", [entry("gpu-5", SHARE_A), entry("gpu-5", SHARE_B)])
    assert code == 200, answer
    assert {d["shareID"] for d in answer["status"]["devices"]} == {SHARE_A, SHARE_B}

    claim = emu.get("resourceclaims", "two", namespace="default")
    assert claim is not None
    claim["status"]["devices"] = [entry("gpu-5", SHARE_A), entry("gpu-5", SHARE_A)]  # a PUT, not an apply
    with pytest.raises(ApiError, match=r"status.devices\[1\]: Duplicate value"):
        emu.update("resourceclaims", claim, subresource="status")
    wrong = str(uuid.uuid4())
    code, answer = await apply(emu, "two", [entry("gpu-5", wrong)])
    assert code == 422 and f'"ShareID":"{wrong}"' in answer["message"]


async def test_with_consumable_capacity_off_the_share_ids_are_dropped_and_the_entry_matches() -> None:
    async with KubeApiEmulator(version="1.35") as emu:
        stored = allocate(emu, "old", [_result("gpu-5", SHARE_A)])
        assert "shareID" not in stored["status"]["allocation"]["devices"]["results"][0]
        code, answer = await apply(emu, "old", [entry("gpu-5", SHARE_A)])
        assert code == 200 and "shareID" not in answer["status"]["devices"][0]


# -- data, conditions -----------------------------------------------------------------------------


async def test_data_is_a_json_object_of_at_most_10_kib(emu: KubeApiEmulator) -> None:
    allocate(emu, "data", [_result("gpu-0")])
    code, _ = await apply(emu, "data", [entry("gpu-0", data={"blob": "x" * (10 * 1024 - 20)})])
    assert code == 200
    code, answer = await apply(emu, "data", [entry("gpu-0", data={"blob": "x" * (10 * 1024)})])
    assert code == 422 and "status.devices[0].data: Too long" in answer["message"]
    code, answer = await apply(emu, "data", [entry("gpu-0", data=["not", "an", "object"])])
    assert code == 422 and "must be a valid JSON object" in answer["message"]


async def test_conditions_are_at_most_8_and_complete(emu: KubeApiEmulator) -> None:
    allocate(emu, "cond", [_result("gpu-0")])
    many = [{**entry("gpu-0")["conditions"][0], "type": f"T{i}"} for i in range(9)]
    code, answer = await apply(emu, "cond", [entry("gpu-0", conditions=many)])
    assert (
        code == 422
        and "status.devices[0].conditions: Too many: 9: must have at most 8 items" in answer["message"]
    )
    code, answer = await apply(
        emu, "cond", [entry("gpu-0", conditions=[{"type": "Ready", "status": "True"}])]
    )
    assert code == 422
    assert "conditions[0].lastTransitionTime: Required value" in answer["message"]
    assert "conditions[0].reason: Required value" in answer["message"]


# -- server-side apply: each driver owns its entries ------------------------------------------------


async def test_two_drivers_keep_each_others_entries_and_an_empty_apply_removes_only_ones_own(
    emu: KubeApiEmulator,
) -> None:
    allocate(emu, "mixed", [_result("gpu-0"), _result("gpu-1-128", driver=AMD)])
    assert (await apply(emu, "mixed", [entry("gpu-0")]))[0] == 200
    code, answer = await apply(emu, "mixed", [entry("gpu-1-128", driver=AMD)], driver=AMD)
    assert code == 200 and [d["driver"] for d in answer["status"]["devices"]] == [NVIDIA, AMD]
    owners = {m["manager"] for m in answer["metadata"]["managedFields"]}
    assert {"dra-agent/gpu.nvidia.com", "dra-agent/gpu.amd.com"} <= owners

    code, answer = await apply(emu, "mixed", [])
    assert code == 200 and [d["driver"] for d in answer["status"]["devices"]] == [AMD]
    assert answer["status"]["allocation"]["devices"]["results"][0]["device"] == "gpu-0"


# -- authorization ---------------------------------------------------------------------------------


async def test_the_charts_role_writes_claims_allocated_on_its_own_node(emu: KubeApiEmulator) -> None:
    emu.add_identity(TOKEN, agent_identity())
    allocate(emu, "own", [_result("gpu-0")])
    code, answer = await apply(emu, "own", [entry("gpu-0")], token=TOKEN)
    assert code == 200, answer


async def test_a_claim_of_another_node_needs_arbitrary_node(emu: KubeApiEmulator) -> None:
    emu.add_identity(TOKEN, agent_identity())
    allocate(emu, "elsewhere", [_result("gpu-0")], node="node2")
    code, answer = await apply(emu, "elsewhere", [entry("gpu-0")], token=TOKEN)
    assert code == 422
    assert answer["details"]["causes"] == [
        {
            "reason": "FieldValueForbidden",
            "field": "status.devices",
            "message": 'Forbidden: changing status.devices requires resource="resourceclaims/driver", '
            'verb="[arbitrary-node:patch]" permission: resourceclaims.resource.k8s.io "gpu.nvidia.com" '
            'is forbidden: User "system:serviceaccount:kube-system:dra-agent" cannot arbitrary-node:patch '
            'resource "resourceclaims/driver" in API group "resource.k8s.io" in the namespace "default"',
        }
    ]


async def test_an_allocation_without_a_single_node_selector_is_not_associated(emu: KubeApiEmulator) -> None:
    emu.add_identity(TOKEN, agent_identity())
    allocate(emu, "anywhere", [_result("gpu-0")], node="")
    code, answer = await apply(emu, "anywhere", [entry("gpu-0")], token=TOKEN)
    assert code == 422 and 'verb="[arbitrary-node:patch]"' in answer["message"]


async def test_another_drivers_entries_need_that_drivers_name(emu: KubeApiEmulator) -> None:
    emu.add_identity(TOKEN, agent_identity(drivers=(NVIDIA,)))
    allocate(emu, "amd", [_result("gpu-1-128", driver=AMD)])
    code, answer = await apply(emu, "amd", [entry("gpu-1-128", driver=AMD)], driver=AMD, token=TOKEN)
    assert code == 422
    assert 'verb="[associated-node:patch arbitrary-node:patch]"' in answer["message"]
    assert 'resourceclaims.resource.k8s.io "gpu.amd.com" is forbidden' in answer["message"]


async def test_without_patch_on_the_status_subresource_rbac_answers_403(emu: KubeApiEmulator) -> None:
    reader = Identity("system:serviceaccount:default:reader", (Rule(("get",), ("resourceclaims",)),))
    emu.add_identity("reader", reader)
    allocate(emu, "ro", [_result("gpu-0")])
    code, answer = await apply(emu, "ro", [entry("gpu-0")], token="reader")
    assert code == 403 and answer["reason"] == "Forbidden"
    assert answer["message"] == (
        'resourceclaims.resource.k8s.io "ro" is forbidden: User "system:serviceaccount:default:reader" '
        'cannot patch resource "resourceclaims/status" in API group "resource.k8s.io" '
        'in the namespace "default"'
    )


@pytest.mark.parametrize(
    ("version", "gates"),
    [("1.35", {}), ("1.36", {"DRAResourceClaimGranularStatusAuthorization": False})],
    ids=["1.35", "1.36-gate-off"],
)
async def test_before_1_36_or_with_the_gate_off_status_rbac_is_enough(
    version: str, gates: dict[str, bool]
) -> None:
    async with KubeApiEmulator(version=version, feature_gates=gates) as emu:
        emu.add_identity(TOKEN, agent_identity())
        allocate(emu, "elsewhere", [_result("gpu-0")], node="node2")
        code, answer = await apply(emu, "elsewhere", [entry("gpu-0")], token=TOKEN)
        assert code == 200, answer


async def test_an_unchanged_entry_needs_no_driver_permission(emu: KubeApiEmulator) -> None:
    """``getModifiedDrivers``: only added, changed or removed entries are authorized."""
    allocate(emu, "same", [_result("gpu-0")], node="node2")
    assert (await apply(emu, "same", [entry("gpu-0")]))[0] == 200  # the administrator wrote it
    emu.add_identity(TOKEN, agent_identity())
    code, answer = await apply(emu, "same", [entry("gpu-0")], token=TOKEN)
    assert code == 200, answer
