"""Parsing ResourceClaims: whole-request checks and the allocation results of this driver and node."""

from __future__ import annotations

from typing import Any

import pytest

from agent.claims.reader import (
    AllocatedDevice,
    ClaimAllocationError,
    base_request_name,
    check_claim,
    parse_allocation,
)
from agent.core.backend import ClaimRef
from agent.core.errors import ClaimRequestError
from tests.kubelet.fakes import DRIVER, NODE, make_claim

REF = ClaimRef("default", "claim-u1", "u1")


def result(device: str, **extra: Any) -> dict[str, Any]:
    return {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device, **extra}


def test_base_request_name_strips_subrequest() -> None:
    assert base_request_name("gpu/large") == "gpu"
    assert base_request_name("gpu") == "gpu"


def test_check_accepts_allocated_claim_with_same_uid() -> None:
    check_claim(REF, make_claim("u1"))


def test_check_rejects_unallocated_claim() -> None:
    with pytest.raises(ClaimRequestError, match="claim default/claim-u1 not allocated") as info:
        check_claim(REF, make_claim("u1", allocated=False))
    assert info.value.code == "FAILED_PRECONDITION"


def test_check_rejects_replaced_claim() -> None:
    with pytest.raises(ClaimRequestError, match="claim default/claim-u1 got replaced"):
        check_claim(REF, make_claim("u2", name="claim-u1"))


def test_other_drivers_results_are_ignored() -> None:
    claim = make_claim(
        "u1",
        results=[
            result("gpu-0"),
            {"request": "nic", "driver": "net.example.com", "pool": "x", "device": "eth0"},
        ],
    )
    parsed = parse_allocation(REF, claim, driver=DRIVER, pool=NODE)
    assert parsed.devices == (AllocatedDevice(pool=NODE, device="gpu-0", requests=("gpu",)),)


def test_claim_of_only_other_drivers_has_no_devices() -> None:
    claim = make_claim(
        "u1", results=[{"request": "a", "driver": "x.example.com", "pool": NODE, "device": "d"}]
    )
    assert parse_allocation(REF, claim, driver=DRIVER, pool=NODE).devices == ()


def test_result_on_another_pool_is_a_claim_error() -> None:
    claim = make_claim("u1", results=[result("gpu-0", pool="node-b")])
    with pytest.raises(ClaimAllocationError, match="allocated on another node") as info:
        parse_allocation(REF, claim, driver=DRIVER, pool=NODE)
    assert info.value.reason == "other_node"


def test_subrequests_become_base_names_and_merge_per_device() -> None:
    claim = make_claim(
        "u1",
        results=[
            result("gpu-0", request="gpu/large"),
            result("gpu-0", request="train"),
            result("gpu-0", request="gpu/small"),
            result("gpu-1", request="gpu/small"),
        ],
    )
    parsed = parse_allocation(REF, claim, driver=DRIVER, pool=NODE)
    assert parsed.devices == (
        AllocatedDevice(pool=NODE, device="gpu-0", requests=("gpu", "train")),
        AllocatedDevice(pool=NODE, device="gpu-1", requests=("gpu",)),
    )


def test_share_id_and_admin_access_are_kept() -> None:
    share = "6f1c2a1e-0000-4000-8000-000000000001"
    claim = make_claim("u1", results=[result("gpu-0", shareID=share, adminAccess=True), result("gpu-0")])
    parsed = parse_allocation(REF, claim, driver=DRIVER, pool=NODE)
    assert parsed.devices == (
        AllocatedDevice(pool=NODE, device="gpu-0", requests=("gpu",), share_id=share, admin_access=True),
        AllocatedDevice(pool=NODE, device="gpu-0", requests=("gpu",)),
    )


@pytest.mark.parametrize(
    "results",
    [
        "not-a-list",
        [{"request": "gpu", "driver": DRIVER, "pool": NODE}],
        [{"request": "", "driver": DRIVER, "pool": NODE, "device": "gpu-0"}],
        ["not-a-dict"],
        [result(f"gpu-{i}") for i in range(33)],
        [result("-bad-")],
        [result("gpu-0", shareID="a/b")],
    ],
)
def test_malformed_allocation_is_a_claim_error(results: Any) -> None:
    claim = make_claim("u1")
    claim["status"]["allocation"]["devices"]["results"] = results
    with pytest.raises(ClaimAllocationError) as info:
        parse_allocation(REF, claim, driver=DRIVER, pool=NODE)
    assert info.value.reason == "invalid"


def test_missing_results_mean_no_devices() -> None:
    claim = make_claim("u1")
    claim["status"]["allocation"] = {}
    assert parse_allocation(REF, claim, driver=DRIVER, pool=NODE).devices == ()
