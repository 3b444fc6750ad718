"""The device model enforces the API server's ResourceSlice rules, naming device and field."""

from __future__ import annotations

import pytest

from agent.core.errors import DeviceModelError
from agent.core.model import (
    Device,
    DeviceHealth,
    HealthCondition,
    HealthStatus,
    Severity,
    Version,
    check_qualified_name,
)
from agent.core.quantity import Quantity


def capacities(n: int) -> dict[str, Quantity]:
    return {f"c{i}": Quantity.parse("1") for i in range(n)}


def make(**kwargs: object) -> Device:
    args: dict[str, object] = {"name": "gpu-0", "driver": "gpu.example.com"}
    args.update(kwargs)
    return Device(**args)  # type: ignore[arg-type]


def test_valid_device() -> None:
    device = make(
        attributes={
            "productName": "X",
            "index": 0,
            "mig": False,
            "driverVersion": Version("550.54.15"),
            "resource.kubernetes.io/pciBusID": "0000:3b:00.0",
        },
        capacity={"memory": Quantity.binary(80 * 1024**3)},
    )
    assert device.health.status is HealthStatus.HEALTHY
    with pytest.raises(TypeError):
        device.attributes["x"] = 1  # type: ignore[index]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"name": "GPU-0"}, "name"),
        ({"name": "gpu_0"}, "name"),
        ({"name": "g" * 64}, "name"),
        ({"name": ""}, "name"),
        ({"driver": "Not A Domain"}, "driver"),
        ({"driver": "a" * 64}, "driver"),
        ({"attributes": {"s": "x" * 65}}, "attributes[s]"),
        ({"attributes": {"v": Version("1.2.3.4")}}, "attributes[v]"),
        ({"attributes": {"v": Version("01.2.3")}}, "attributes[v]"),
        ({"attributes": {"i": 2**63}}, "attributes[i]"),
        ({"attributes": {"bad-name": 1}}, "attributes[bad-name]"),
        ({"attributes": {"a" * 33: 1}}, f"attributes[{'a' * 33}]"),
        ({"attributes": {"Bad_Domain/x": 1}}, "attributes[Bad_Domain/x]"),
        ({"attributes": {"f": 1.5}}, "attributes[f]"),
        ({"capacity": {"memory": "80Gi"}}, "capacity[memory]"),
        ({"capacity": {"bad name": Quantity.parse("1")}}, "capacity[bad name]"),
        ({"attributes": {f"a{i}": i for i in range(20)}, "capacity": capacities(13)}, "attributes"),
    ],
)
def test_limits_name_device_and_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(DeviceModelError) as info:
        make(**kwargs)
    assert info.value.field == field
    assert "device " in str(info.value) and field in str(info.value)


def test_exactly_32_attributes_and_capacities_are_allowed() -> None:
    make(attributes={f"a{i}": i for i in range(20)}, capacity=capacities(12))


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("productName", True),
        ("gpu.nvidia.com/productName", True),
        ("resource.kubernetes.io/pcieRoot", True),
        ("_x", True),
        ("9x", False),
        ("a/b/c", False),
        ("/x", False),
        ("x/", False),
    ],
)
def test_qualified_names(name: str, ok: bool) -> None:
    assert (check_qualified_name(name) is None) is ok


def test_health_status_from_conditions() -> None:
    info = HealthCondition("thermal", Severity.INFO)
    warn = HealthCondition("unmonitored", Severity.WARNING)
    crit = HealthCondition("xid", Severity.CRITICAL, "79", "GPU fell off the bus")
    assert DeviceHealth((info,)).status is HealthStatus.HEALTHY
    assert DeviceHealth((info, warn)).status is HealthStatus.UNKNOWN
    assert DeviceHealth((warn, crit)).status is HealthStatus.UNHEALTHY
    assert DeviceHealth((warn, crit)).message.startswith("xid=79: GPU fell off the bus")
