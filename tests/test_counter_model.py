"""Counter sets and counter consumption in the device model, limited as the API server limits them
(upstream ``pkg/apis/resource/validation/validation.go``: ``validateCounterSet``,
``validateDeviceCounterConsumption``; limits from ``staging/src/k8s.io/api/resource/v1/types.go``)."""

from __future__ import annotations

import pytest

from agent.core.errors import DeviceModelError
from agent.core.model import CounterConsumption, CounterSet, Device
from agent.core.quantity import Quantity

ONE = Quantity.parse(1)


def test_a_partitionable_device_is_a_frozen_value() -> None:
    counters = {"memory-slice-0": ONE}
    device = Device(
        name="gpu-0",
        driver="gpu.nvidia.com",
        consumes_counters=[CounterConsumption("gpu-0-counters", counters)],  # type: ignore[arg-type]
        counter_sets=(CounterSet("gpu-0-counters", counters),),
    )
    counters["memory-slice-1"] = ONE
    assert isinstance(device.consumes_counters, tuple)
    assert set(device.counter_sets[0].counters) == {"memory-slice-0"}


@pytest.mark.parametrize(
    ("build", "where"),
    [
        (lambda: CounterSet("gpu0Set", {"a": ONE}), "counterSet.name"),
        (lambda: CounterSet("set", {"memorySlice0": ONE}), "counterSet.counters[memorySlice0]"),
        (lambda: CounterSet("set", {}), "counterSet.counters"),
        (lambda: CounterSet("set", {f"c-{i}": ONE for i in range(33)}), "counterSet.counters"),
        (
            lambda: Device(
                name="d",
                driver="x.example.com",
                consumes_counters=tuple(CounterConsumption(f"s-{i}", {"a": ONE}) for i in range(3)),
            ),
            "consumesCounters",
        ),
        (
            lambda: Device(
                name="d",
                driver="x.example.com",
                consumes_counters=(CounterConsumption("s", {"a": ONE}), CounterConsumption("s", {"b": ONE})),
            ),
            "consumesCounters[1].counterSet",
        ),
        (
            lambda: Device(
                name="d",
                driver="x.example.com",
                consumes_counters=(CounterConsumption("s", {f"c-{i}": ONE for i in range(33)}),),
            ),
            "consumesCounters[0].counters",
        ),
        (
            lambda: Device(
                name="d", driver="x.example.com", consumes_counters=(CounterConsumption("S", {"a": ONE}),)
            ),
            "consumesCounters[0].counterSet",
        ),
    ],
)
def test_what_the_api_server_refuses_is_refused_here(build: object, where: str) -> None:
    with pytest.raises(DeviceModelError) as raised:
        build()  # type: ignore[operator]
    assert raised.value.field == where
