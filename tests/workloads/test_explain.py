"""``dra-agent explain``: every device of this node, matched or excluded with the reason.

The checks and their order follow the scheduler's allocator
(staging/src/k8s.io/dynamic-resource-allocation/structured/internal/stable/allocator_stable.go:
``isSelectable``/``selectorsMatch`` for the class then the claim selectors and the wording of CEL
errors, ``allocateDevice`` for devices in use, ``taintPreventsAllocation`` for NoSchedule/NoExecute
taints and ``resourceclaim.ToleratesTaint``, and the ``matchAttribute`` constraint).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.claims.state.machine import DeviceState
from agent.cli import main
from agent.core.backend import ClaimRef
from agent.core.errors import KubeApiError
from agent.emulator import KubeApiEmulator
from agent.explain.evaluate import ExplainError, Report, explain
from agent.explain.sources import from_api, placement
from agent.kube.client import KubeClient
from tests.kubelet.fakes import FakeBackend, FakeClaimSource

NODE = "node-a"
NV = "gpu.nvidia.com"
AMD = "gpu.amd.com"


def device(
    name: str, root: str, *, memory: str = "80Gi", taints: list[dict[str, str]] | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "name": name,
        "attributes": {
            "productName": {"string": "NVIDIA A100-SXM4-80GB"},
            "resource.kubernetes.io/pcieRoot": {"string": root},
            "driverVersion": {"version": "550.54.15"},
        },
        "capacity": {"memory": {"value": memory}},
    }
    if taints:
        body["taints"] = taints
    return body


XID = {"key": f"{NV}/xid", "value": "79", "effect": "NoSchedule"}


def slices() -> list[dict[str, Any]]:
    nvidia = [
        device("gpu-0", "pci-a"),
        device("gpu-1", "pci-a"),
        device("gpu-2", "pci-b"),
        device("gpu-3", "pci-b", taints=[XID]),
    ]
    return [
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": f"{NODE}-{NV}-x"},
            "spec": {
                "driver": NV,
                "nodeName": NODE,
                "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1},
                "devices": nvidia,
            },
        },
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": f"{NODE}-{AMD}-x"},
            "spec": {
                "driver": AMD,
                "nodeName": NODE,
                "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1},
                "devices": [{"name": "gpu-0", "attributes": {"productName": {"string": "MI300X"}}}],
            },
        },
    ]


def device_class(name: str = NV, driver: str = NV) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{driver}'"}}]},
    }


def claim(name: str = "train", *, count: int = 1, uid: str = "uid-train", **exactly: Any) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": "ml", "name": name, "uid": uid},
        "spec": {
            "devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": NV, "count": count, **exactly}}]
            }
        },
    }


def run(
    c: dict[str, Any], *, classes: dict[str, Any] | None = None, others: Sequence[dict[str, Any]] = ()
) -> Report:
    return explain(
        c,
        node=NODE,
        classes=classes if classes is not None else {NV: device_class()},
        slices=slices(),
        other_claims=others,
    )


def verdicts(report: Report, request: int = 0) -> dict[str, tuple[str, ...]]:
    return {d.device: d.reasons for d in report.requests[request].devices}


def test_matched_devices_and_a_taint_not_tolerated() -> None:
    report = run(claim())
    seen = verdicts(report)
    assert seen[f"{NV}/{NODE}/gpu-0"] == () and seen[f"{NV}/{NODE}/gpu-2"] == ()
    assert seen[f"{NV}/{NODE}/gpu-3"] == (f"taint {NV}/xid=79:NoSchedule not tolerated",)
    assert report.requests[0].summary == "needs 1 device(s); 3 of 5 on this node match"


def test_a_tolerated_taint_does_not_exclude() -> None:
    report = run(claim(tolerations=[{"key": f"{NV}/xid", "operator": "Exists", "effect": "NoSchedule"}]))
    assert verdicts(report)[f"{NV}/{NODE}/gpu-3"] == ()


def test_wrong_class_shows_the_expression_and_the_driver_it_saw() -> None:
    (reason,) = verdicts(run(claim()))[f"{AMD}/{NODE}/gpu-0"]
    assert reason == f"class {NV} selector #0 is false: device.driver == '{NV}' (saw driver={AMD})"
    missing = run(claim(), classes={})
    assert all(r[0] == f"DeviceClass {NV} not found" for r in verdicts(missing).values())


def test_cel_false_shows_the_attribute_values_it_saw() -> None:
    expression = (
        f"device.attributes['{NV}'].productName == 'NVIDIA H100' && "
        f"device.capacity['{NV}'].memory.compareTo(quantity('40Gi')) >= 0"
    )
    report = run(claim(selectors=[{"cel": {"expression": expression}}]))
    (reason,) = verdicts(report)[f"{NV}/{NODE}/gpu-0"]
    assert reason == (
        f"claim ml/train selector #0 is false: {expression} "
        f"(saw {NV}/productName=NVIDIA A100-SXM4-80GB, {NV}/memory=80Gi)"
    )


def test_a_cel_runtime_error_reads_as_the_scheduler_reports_it() -> None:
    report = run(claim(selectors=[{"cel": {"expression": f"device.attributes['{NV}'].nosuch == 'x'"}}]))
    (reason,) = verdicts(report)[f"{NV}/{NODE}/gpu-0"]
    assert reason.startswith(f"claim ml/train: selector #0 on device {NV}/{NODE}/gpu-0: CEL runtime error: ")


def test_a_selector_that_does_not_compile_is_an_error() -> None:
    with pytest.raises(ExplainError, match=r"claim ml/train request gpu: selector #0: CEL compile error"):
        run(claim(selectors=[{"cel": {"expression": "device.driver =="}}]))


def test_match_attribute_that_cannot_hold() -> None:
    c = claim(count=3)
    c["spec"]["devices"]["constraints"] = [{"matchAttribute": "resource.kubernetes.io/pcieRoot"}]
    (constraint,) = run(c).constraints
    assert constraint == (
        "constraint #0 matchAttribute resource.kubernetes.io/pcieRoot: impossible: "
        "no single value serves gpu (matching devices per value: pci-a: {'gpu': 2}; pci-b: {'gpu': 1})"
    )
    c = claim(count=2)
    c["spec"]["devices"]["constraints"] = [{"matchAttribute": "resource.kubernetes.io/pcieRoot"}]
    assert run(c).constraints[0].endswith("possible with pci-a")


def test_a_device_allocated_to_another_claim_names_it() -> None:
    other = claim("other", uid="uid-other")
    other["status"] = {
        "allocation": {
            "devices": {"results": [{"request": "gpu", "driver": NV, "pool": NODE, "device": "gpu-0"}]}
        }
    }
    assert verdicts(run(claim(), others=[other]))[f"{NV}/{NODE}/gpu-0"] == ("allocated to claim ml/other",)


def test_capacity_too_small() -> None:
    report = run(claim(capacity={"requests": {"memory": "100Gi"}}))
    assert verdicts(report)[f"{NV}/{NODE}/gpu-0"] == (
        "capacity memory too small: the device has 80Gi, the request wants 100Gi",
    )


# ----------------------------------------------------------------- the command


def write(path: Path, *docs: Any) -> Path:
    path.write_text(yaml.safe_dump_all(docs))
    return path


def kube_none_output(path: Path) -> Path:
    """As `dra-agent run --kube none` prints: a List per pool, printed again on every change."""
    stale = slices()
    stale[0]["spec"]["devices"] = stale[0]["spec"]["devices"][:1]
    text = "".join(
        "---\n" + yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": [s]})
        for s in (*stale, slices()[0])
    )
    path.write_text(text)
    return path


def test_offline_with_the_kube_none_output_as_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    c = claim()
    c["status"] = {
        "allocation": {
            "devices": {"results": [{"request": "gpu", "driver": NV, "pool": NODE, "device": "gpu-1"}]}
        },
        "reservedFor": [{"resource": "pods", "name": "trainer-0", "uid": "p1"}],
    }
    claim_file = write(tmp_path / "claim.yaml", c, device_class())
    cdi = tmp_path / "cdi"
    cdi.mkdir()
    (cdi / f"k8s.{NV}-claim_uid-train.yaml").write_text("cdiVersion: 0.5.0\n")
    args = [
        "explain",
        "claim",
        "--file",
        str(claim_file),
        "--slices",
        str(kube_none_output(tmp_path / "s.yaml")),
    ]
    assert main([*args, "--state-dir", str(tmp_path / "state"), "--cdi-root", str(cdi), "-o", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["node"] == NODE  # taken from the slices
    assert len(report["requests"][0]["devices"]) == 5  # the last print of the NVIDIA pool won
    assert report["onThisNode"] == {
        "devices": [f"{NV}/{NODE}/gpu-1"],
        "prepared": "no",
        "cdiSpecs": [str(cdi / f"k8s.{NV}-claim_uid-train.yaml")],
        "pods": ["trainer-0"],
    }


def test_a_claim_of_another_node_is_one_line_and_a_failure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    c = claim()
    c["status"] = {
        "allocation": {
            "devices": {"results": []},
            "nodeSelector": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-b"]}]}
                ]
            },
        }
    }
    claim_file = write(tmp_path / "claim.yaml", c, device_class())
    slices_file = write(tmp_path / "s.yaml", *slices())
    assert main(["explain", "claim", "--file", str(claim_file), "--slices", str(slices_file)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "dra-agent: error: claim ml/train is allocated on node node-b, not on this node node-a: "
        "run explain there (or with --node-name node-b)"
    ]


def test_a_selector_that_does_not_compile_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    claim_file = write(
        tmp_path / "claim.yaml",
        claim(selectors=[{"cel": {"expression": "device.driver =="}}]),
        device_class(),
    )
    slices_file = write(tmp_path / "s.yaml", *slices())
    assert main(["explain", "claim", "--file", str(claim_file), "--slices", str(slices_file)]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("dra-agent: error: claim ml/train request gpu: selector #0: CEL compile error")


def test_bad_usage_is_one_line_naming_what_is_accepted(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", "claim", "just-a-name"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "NAMESPACE/NAME" in line


async def test_from_the_api_server_and_a_missing_claim() -> None:
    async with KubeApiEmulator(version="1.34") as emu:
        emu.add_node(NODE)
        emu.create("namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ml"}})
        emu.create("deviceclasses", device_class())
        for s in slices():
            emu.create("resourceslices", s)
        emu.create("resourceclaims", claim(), namespace="ml")
        kube = KubeClient.from_configuration(emu.configuration(), request_timeout=2.0)
        try:
            inputs = await from_api(kube, "ml", "train", NODE)
            assert {
                d.device
                for d in explain(inputs.claim, node=NODE, classes=inputs.classes, slices=inputs.slices)
                .requests[0]
                .devices
                if d.matched
            } == {
                f"{NV}/{NODE}/gpu-0",
                f"{NV}/{NODE}/gpu-1",
                f"{NV}/{NODE}/gpu-2",
            }
            with pytest.raises(ExplainError, match=r"^ResourceClaim ml/absent not found$"):
                await from_api(kube, "ml", "absent", NODE)
        finally:
            await kube.close()


class ForbiddenLists:
    """An API reader whose credentials may read the claim and classes but not list claims."""

    slice_version = "v1"

    def __init__(self, forbid_classes: bool = False) -> None:
        self.forbid_classes = forbid_classes

    async def ensure_discovered(self) -> object:
        return None

    async def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        return claim()

    async def request(
        self, method: str, path: str, *, query: Sequence[tuple[str, str]] = (), body: Any = None
    ) -> dict[str, Any]:
        if path.endswith("/resourceclaims") or (self.forbid_classes and "/deviceclasses/" in path):
            raise KubeApiError(f"{method} {path}: forbidden", status=403)
        if "/deviceclasses/" in path:
            return device_class()
        return {"items": slices()}


async def test_forbidden_lists_are_a_note_and_forbidden_classes_one_clear_error() -> None:
    inputs = await from_api(ForbiddenLists(), "ml", "train", NODE)
    assert inputs.notes == (
        "cannot list ResourceClaims (forbidden): devices allocated to other claims are not shown",
    )
    with pytest.raises(ExplainError, match=f"cannot read DeviceClass {NV}: forbidden; run explain with"):
        await from_api(ForbiddenLists(forbid_classes=True), "ml", "train", NODE)


async def test_an_allocated_claim_prepared_here_shows_checkpoint_cdi_spec_and_pods(tmp_path: Path) -> None:
    c = claim()
    c["status"] = {
        "allocation": {
            "devices": {"results": [{"request": "gpu", "driver": NV, "pool": NODE, "device": "gpu-1"}]}
        },
        "reservedFor": [{"resource": "pods", "name": "trainer-0", "uid": "p1"}],
    }
    state = DeviceState(
        NV,
        FakeBackend(driver=NV),
        FakeClaimSource([c]),
        node_name=NODE,
        cdi_root=tmp_path / "cdi",
        state_dir=tmp_path / "state" / NV,  # as the runner lays it out: <state dir>/<driver>
        boot_id="boot-1",
    )
    await state.start()
    await state.prepare([ClaimRef("ml", "train", "uid-train")])
    where = placement(c, NODE, tmp_path / "state", tmp_path / "cdi")
    assert where is not None
    assert (where.devices, where.prepared, where.pods) == ((f"{NV}/{NODE}/gpu-1",), "yes", ("trainer-0",))
    assert where.cdi_spec == (str(tmp_path / "cdi" / f"k8s.{NV}-claim_uid-train.yaml"),)


def test_an_unreadable_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "claim.yaml").write_bytes(b"\xff\xfe not utf-8")
    slices_file = write(tmp_path / "s.yaml", *slices())
    assert (
        main(["explain", "claim", "--file", str(tmp_path / "claim.yaml"), "--slices", str(slices_file)]) == 1
    )
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("dra-agent: error: --file") and "claim.yaml" in line


# ------------------------------------------- issue 24: explain agrees with kube-scheduler v1.36


def shared_slices(*, policy: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One shareable GPU (allowMultipleAllocations) with 80Gi of consumable memory."""
    memory: dict[str, Any] = {"value": "80Gi"}
    if policy is not None:
        memory["requestPolicy"] = policy
    gpu = {**device("gpu-0", "pci-a"), "allowMultipleAllocations": True, "capacity": {"memory": memory}}
    s = slices()[0]
    s["spec"]["devices"] = [gpu]
    return [s]


def holder(name: str, consumed: str) -> dict[str, Any]:
    other = claim(name, uid=f"uid-{name}")
    result = {
        "request": "gpu",
        "driver": NV,
        "pool": NODE,
        "device": "gpu-0",
        "shareID": "0a1b2c",
        "consumedCapacity": {"memory": consumed},
    }
    other["status"] = {"allocation": {"devices": {"results": [result]}}}
    return other


def run_shared(c: dict[str, Any], others: Sequence[dict[str, Any]], **kw: Any) -> Report:
    return explain(
        c, node=NODE, classes={NV: device_class()}, slices=shared_slices(**kw), other_claims=others
    )


def test_a_shareable_device_with_capacity_left_is_a_candidate() -> None:
    """consumable_capacity.go cmpRequestOverCapacity: a share fits while consumed + request <= value;
    found (a): explain said "allocated to claim X" where the scheduler allocated a share."""
    c = claim(capacity={"requests": {"memory": "16Gi"}})
    report = run_shared(c, [holder("other", "64Gi")])
    assert verdicts(report)[f"{NV}/{NODE}/gpu-0"] == ()
    assert not report.requests[0].summary.endswith("unsatisfiable here")


def test_a_share_too_large_is_explained_by_the_capacity_left() -> None:
    """consumable_capacity.go: the capacity left, not the other claim, excludes the device."""
    c = claim(capacity={"requests": {"memory": "48Gi"}})
    report = run_shared(c, [holder("other", "64Gi")])
    assert verdicts(report)[f"{NV}/{NODE}/gpu-0"] == ("memory: requested 48Gi, 16Gi left of 80Gi",)


def test_the_request_policy_rounds_the_share_as_the_allocator_does() -> None:
    """consumable_capacity.go roundUpRange (min, step), violatesPolicy (max) and fillEmptyRequestQuantity."""
    policy = {"default": "8Gi", "validRange": {"min": "8Gi", "max": "40Gi", "step": "8Gi"}}
    c = claim(capacity={"requests": {"memory": "10Gi"}})
    (reason,) = verdicts(run_shared(c, [holder("other", "72Gi")], policy=policy))[f"{NV}/{NODE}/gpu-0"]
    assert reason == "memory: requested 10Gi, rounded up to 16Gi by the request policy, 8Gi left of 80Gi"
    assert verdicts(run_shared(c, [holder("other", "56Gi")], policy=policy))[f"{NV}/{NODE}/gpu-0"] == ()
    too_big = claim(capacity={"requests": {"memory": "48Gi"}})
    (reason,) = verdicts(run_shared(too_big, [], policy=policy))[f"{NV}/{NODE}/gpu-0"]
    assert reason == "memory: requested 48Gi: more than the device's maximum of 40Gi per allocation"
    # Not requested: an allocation takes the policy's default.
    full = verdicts(run_shared(claim(), [holder("other", "76Gi")], policy=policy))[f"{NV}/{NODE}/gpu-0"]
    assert full == ("memory: not requested, an allocation takes 8Gi, 4Gi left of 80Gi",)


def test_shared_counters_left_by_allocated_partitions() -> None:
    """allocator_experimental.go / pools: a device consuming shared counters fits while the pool's
    allocated devices leave enough of each counter (partitionable devices)."""
    s = slices()[0]
    s["spec"]["sharedCounters"] = [{"name": "gpu-0-set", "counters": {"memory": {"value": "80Gi"}}}]
    whole = {
        **device("gpu-0", "pci-a"),
        "consumesCounters": [{"counterSet": "gpu-0-set", "counters": {"memory": {"value": "80Gi"}}}],
    }
    part = {
        **device("gpu-0-mig-1", "pci-a", memory="40Gi"),
        "consumesCounters": [{"counterSet": "gpu-0-set", "counters": {"memory": {"value": "40Gi"}}}],
    }
    part2 = {**part, "name": "gpu-0-mig-2"}
    s["spec"]["devices"] = [whole, part, part2]
    other = claim("other", uid="uid-other")
    other["status"] = {
        "allocation": {
            "devices": {"results": [{"request": "gpu", "driver": NV, "pool": NODE, "device": "gpu-0-mig-1"}]}
        }
    }
    report = explain(claim(), node=NODE, classes={NV: device_class()}, slices=[s], other_claims=[other])
    seen = verdicts(report)
    assert seen[f"{NV}/{NODE}/gpu-0"] == (
        "counter gpu-0-set/memory: needs 80Gi, 40Gi left of 80Gi (allocated: gpu-0-mig-1)",
    )
    assert seen[f"{NV}/{NODE}/gpu-0-mig-1"] == ("allocated to claim ml/other",)
    assert seen[f"{NV}/{NODE}/gpu-0-mig-2"] == ()


def test_nvidia_e2e_style_selector_matches_as_the_scheduler_allocates() -> None:
    """Found (b): dynamic-resource-allocation/cel/compile.go uses the base environment with the
    strings extension (cel-go ext/strings.go lowerAscii); the scheduler allocated the device."""
    expression = f"device.attributes[\"{NV}\"].productName.lowerAscii().matches('^.*a100.*$')"
    report = run(claim(selectors=[{"cel": {"expression": expression}}]))
    assert report.requests[0].summary == "needs 1 device(s); 3 of 5 on this node match"


def test_a_missing_attribute_reads_as_the_scheduler_reports_it() -> None:
    """Found (c): cel-go's missing map key, ``no such key: index``, with the allocator's
    ``claim ...: selector #0: CEL runtime error:`` wording (allocator selectorsMatch)."""
    expression = f"device.attributes['{NV}'].index == 0"
    (reason,) = verdicts(run(claim(selectors=[{"cel": {"expression": expression}}])))[f"{NV}/{NODE}/gpu-0"]
    assert (
        reason
        == f"claim ml/train: selector #0 on device {NV}/{NODE}/gpu-0: CEL runtime error: no such key: index"
    )
