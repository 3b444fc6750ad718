"""Server-side apply, request options (dryRun) and body decoding beyond the 36 rows.

Upstream: ``staging/src/k8s.io/apiserver/pkg/endpoints/handlers/patch.go`` (apply needs a
fieldManager, creates missing objects), ``staging/src/k8s.io/apiserver/pkg/endpoints/handlers/
fieldmanager`` (managedFields, conflicts, force), ``staging/src/k8s.io/apimachinery/pkg/apis/meta/v1/
validation/validation.go`` (``ValidateDryRun``, ``ValidatePatchOptions``), ``sigs.k8s.io/json``
(duplicate fields are warnings unless fieldValidation=Strict).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import yaml

from agent.emulator import KubeApiEmulator
from tests.emulator.conftest import send

DRIVER = "gpu.example.com"
PATH = "/apis/resource.k8s.io/v1/resourceslices"
APPLY = "application/apply-patch+yaml"


def _config(devices: list[str], **spec: Any) -> str:
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "s"},
        "spec": {
            "driver": DRIVER,
            "nodeName": "node-a",
            "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": d} for d in devices],
            **spec,
        },
    }
    return yaml.safe_dump(body)


@pytest.fixture
async def emu() -> AsyncIterator[KubeApiEmulator]:
    async with KubeApiEmulator(version="1.36") as emulator:
        yield emulator


async def _apply(emu: KubeApiEmulator, body: str, manager: str = "a", **query: str) -> tuple[int, Any]:
    code, answer, _ = await send(
        emu, "PATCH", f"{PATH}/s", body, query={"fieldManager": manager, **query}, content_type=APPLY
    )
    return code, answer


async def test_apply_creates_then_updates_and_records_the_manager(emu: KubeApiEmulator) -> None:
    code, created = await _apply(emu, _config(["gpu-0"]))
    assert code == 201
    entry = created["metadata"]["managedFields"][0]
    assert entry["manager"] == "a" and entry["operation"] == "Apply" and entry["fieldsType"] == "FieldsV1"
    # The name identifies the object: it is not a managed field.
    assert "f:devices" in entry["fieldsV1"]["f:spec"] and "f:metadata" not in entry["fieldsV1"]
    code, updated = await _apply(emu, _config(["gpu-0", "gpu-1"]))
    assert code == 200 and [d["name"] for d in updated["spec"]["devices"]] == ["gpu-0", "gpu-1"]
    assert updated["metadata"]["generation"] == 2


async def test_a_repeated_apply_writes_nothing(emu: KubeApiEmulator) -> None:
    _, first = await _apply(emu, _config(["gpu-0"]))
    emu.reset_writes()
    _, second = await _apply(emu, _config(["gpu-0"]))
    assert second["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]


async def test_a_field_the_applier_stops_sending_is_removed(emu: KubeApiEmulator) -> None:
    await _apply(
        emu,
        yaml.safe_dump(
            {**yaml.safe_load(_config(["gpu-0"])), "metadata": {"name": "s", "labels": {"x": "1"}}}
        ),
    )
    _, answer = await _apply(emu, _config(["gpu-0"]))
    assert "labels" not in answer["metadata"]


async def test_another_appliers_field_conflicts_unless_forced(emu: KubeApiEmulator) -> None:
    await _apply(emu, _config(["gpu-0"]), manager="a")
    code, answer = await _apply(emu, _config(["gpu-9"]), manager="b")
    assert code == 409 and answer["reason"] == "Conflict"
    assert answer["message"] == 'Apply failed with 1 conflict: conflict with "a": .spec.devices'
    assert answer["details"]["causes"] == [
        {"reason": "FieldManagerConflict", "message": 'conflict with "a"', "field": ".spec.devices"}
    ]
    code, answer = await _apply(emu, _config(["gpu-9"]), manager="b", force="true")
    assert code == 200 and answer["spec"]["devices"] == [{"name": "gpu-9"}]
    owners = {m["manager"]: m["fieldsV1"]["f:spec"] for m in answer["metadata"]["managedFields"]}
    assert "f:devices" in owners["b"] and "f:devices" not in owners["a"]


async def test_the_same_value_from_two_appliers_is_shared(emu: KubeApiEmulator) -> None:
    await _apply(emu, _config(["gpu-0"]), manager="a")
    code, answer = await _apply(emu, _config(["gpu-0"]), manager="b")
    assert code == 200 and {m["manager"] for m in answer["metadata"]["managedFields"]} == {"a", "b"}


async def test_apply_to_status_owns_only_status(emu: KubeApiEmulator) -> None:
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}},
    }
    path = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/c"
    code, _, _ = await send(
        emu, "PATCH", f"{path}/status", yaml.safe_dump(claim), query={"fieldManager": "d"}, content_type=APPLY
    )
    assert code == 404
    await send(emu, "POST", "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims", claim)
    result = {"request": "gpu", "driver": DRIVER, "pool": "node-a", "device": "gpu-0"}
    status = {**claim, "status": {"allocation": {"devices": {"results": [result]}}}}
    code, answer, _ = await send(
        emu,
        "PATCH",
        f"{path}/status",
        yaml.safe_dump(status),
        query={"fieldManager": "d"},
        content_type=APPLY,
    )
    assert code == 200 and answer["status"]["allocation"]["devices"]["results"] == [result]
    # The POST that created the claim is an Update manager of the spec; the applier owns status only.
    (entry,) = [m for m in answer["metadata"]["managedFields"] if m["operation"] == "Apply"]
    assert entry["subresource"] == "status" and list(entry["fieldsV1"]) == ["f:status"]


async def test_apply_needs_a_field_manager_and_a_matching_name(emu: KubeApiEmulator) -> None:
    code, answer, _ = await send(emu, "PATCH", f"{PATH}/s", _config(["gpu-0"]), content_type=APPLY)
    assert code == 422
    assert (
        answer["message"]
        == 'PatchOptions.meta.k8s.io "" is invalid: fieldManager: Required value: is required for apply patch'
    )
    code, answer = await _apply(emu, _config(["gpu-0"]).replace("name: s\n", "name: other\n"))
    assert code == 400 and "does not match the name on the URL" in answer["message"]
    code, answer, _ = await send(
        emu, "PATCH", f"{PATH}/s", "a: [", query={"fieldManager": "a"}, content_type=APPLY
    )
    assert code == 400 and "unknown format" in answer["message"]


async def test_apply_validates_like_a_create(emu: KubeApiEmulator) -> None:
    code, answer = await _apply(emu, _config(["gpu-0"], allNodes=False))
    assert code == 422 and "spec.allNodes: Invalid value: false" in answer["message"]
    assert emu.get("resourceslices", "s") is None


async def test_apply_dry_run_stores_nothing(emu: KubeApiEmulator) -> None:
    code, _ = await _apply(emu, _config(["gpu-0"]), dryRun="All")
    assert code == 201 and emu.get("resourceslices", "s") is None


@pytest.mark.parametrize(
    ("method", "path", "kind"),
    [
        ("PUT", f"{PATH}/s", "UpdateOptions"),
        ("DELETE", f"{PATH}/s", "DeleteOptions"),
        ("DELETE", PATH, "DeleteOptions"),
        ("PATCH", f"{PATH}/s", "PatchOptions"),
    ],
)
async def test_dry_run_values_other_than_all_are_refused_for_every_write(
    emu: KubeApiEmulator, method: str, path: str, kind: str
) -> None:
    await _apply(emu, _config(["gpu-0"]))
    code, answer, _ = await send(
        emu, method, path, {}, query={"dryRun": "true"}, content_type="application/merge-patch+json"
    )
    assert code == 422
    assert (
        answer["message"]
        == f'{kind}.meta.k8s.io "" is invalid: dryRun: Unsupported value: ["true"]: supported values: "All"'
    )
    assert answer["details"]["causes"][0]["field"] == "dryRun"
    assert emu.get("resourceslices", "s") is not None


async def test_duplicate_fields_are_a_warning_without_strict(emu: KubeApiEmulator) -> None:
    spec = json.dumps(yaml.safe_load(_config(["gpu-0"]))["spec"])
    raw = '{"kind": "ResourceSlice", "metadata": {"name": "s", "name": "s"}, "spec": ' + spec + "}"
    code, _, warning = await send(emu, "POST", PATH, raw)
    assert code == 201 and warning == '299 - "duplicate field \\"metadata.name\\""'


async def test_devicetaintrules_are_v1beta2_only_from_1_36() -> None:
    async with KubeApiEmulator(version="1.35") as emu:
        code, _, _ = await send(emu, "GET", "/apis/resource.k8s.io/v1beta2/devicetaintrules")
        assert code == 404
        code, _, _ = await send(emu, "GET", "/apis/resource.k8s.io/v1alpha3/devicetaintrules")
        assert code == 200
