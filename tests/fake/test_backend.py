"""The fake backend: discovery, injected faults as health events, prepare, telemetry."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from anyio import wait_all_tasks_blocked

import backends.fake.backend as fake_backend_module
from agent.core.backend import Backend, ClaimRef, ConditionKind, HealthEvent
from agent.core.errors import BackendError, DeviceNotFoundError
from agent.core.model import Severity
from backends.fake.backend import MAX_QUEUED_EVENTS
from backends.fake.conditions import FaultError, condition_defaults
from backends.fake.sharing import FakeGpuPolicy
from tests.fake.helpers import Collector, make_backends
from tests.support.clock import FakeClock

CLAIM = ClaimRef("default", "claim-a", "uid-a")


async def test_backends_implement_the_protocol() -> None:
    backends, _ = make_backends()
    for backend in backends:
        assert isinstance(backend, Backend)
        await backend.start()
        assert await backend.discover()
        await backend.stop()


@pytest.mark.parametrize(
    ("condition", "value", "severity", "kind"),
    [
        ("xid", "79", Severity.CRITICAL, ConditionKind.EVENT),
        ("xid", "13", Severity.INFO, ConditionKind.EVENT),
        ("xid", "109", Severity.INFO, ConditionKind.EVENT),
        ("gpu-lost", "", Severity.CRITICAL, ConditionKind.STATE),
        ("ecc-uncorrectable", "umc", Severity.CRITICAL, ConditionKind.EVENT),
        ("unmonitored", "", Severity.INFO, ConditionKind.STATE),
        ("gpu-reset", "", Severity.CRITICAL, ConditionKind.EVENT),
        ("ring-hang", "", Severity.CRITICAL, ConditionKind.EVENT),
        ("thermal-throttle", "", Severity.INFO, ConditionKind.EVENT),
        ("something-new", "", Severity.WARNING, ConditionKind.EVENT),
    ],
)
def test_condition_table(condition: str, value: str, severity: Severity, kind: ConditionKind) -> None:
    assert condition_defaults(condition, value) == (severity, kind)


async def test_inject_reaches_the_health_monitor(fake_clock: FakeClock) -> None:
    (nvidia, amd), injector = make_backends(clock=fake_clock)
    sink = Collector()
    async with anyio.create_task_group() as tg:
        tg.start_soon(nvidia.monitor_health, sink)
        await wait_all_tasks_blocked()
        assert await injector.inject("gpu-3", "xid", "79") == ["gpu.nvidia.com/gpu-3"]
        await injector.inject("gpu-3", "xid", "13", severity=Severity.CRITICAL, message="forced")
        await injector.inject("gpu-1-128", "ecc-uncorrectable", "umc")  # the AMD backend's queue
        await wait_all_tasks_blocked()
        tg.cancel_scope.cancel()
    assert [(e.device, e.value, e.severity) for e in sink.events] == [
        ("gpu-3", "79", Severity.CRITICAL),
        ("gpu-3", "13", Severity.CRITICAL),
    ]
    assert sink.events[1].message == "forced"
    assert sink.events[0].at == fake_clock.time()
    assert len(amd._queue) == 1


async def test_events_injected_before_the_monitor_starts_are_kept() -> None:
    (nvidia, _), injector = make_backends()
    await injector.inject("gpu-0", "xid", "48")
    sink = Collector()
    async with anyio.create_task_group() as tg:
        tg.start_soon(nvidia.monitor_health, sink)
        await wait_all_tasks_blocked()
        tg.cancel_scope.cancel()
    assert sink.conditions() == [("gpu-0", "xid", "48", False)]


async def test_lose_and_recover_a_mig_gpu() -> None:
    (backend,), injector = make_backends("nvidia-a100-8x")
    affected = await injector.lose("gpu-6-mig-3g40gb-9-0")
    assert affected == ["gpu.nvidia.com/gpu-6-mig-3g40gb-9-0", "gpu.nvidia.com/gpu-6-mig-3g40gb-9-4"]
    names = {d.name for d in await backend.discover()}
    assert not any(n.startswith("gpu-6-") for n in names)
    assert "gpu-7-mig-3g40gb-9-4" in names
    events = list(backend._queue)
    assert all(e.condition == "gpu-lost" and e.kind is ConditionKind.STATE for e in events)
    with pytest.raises(DeviceNotFoundError):
        await backend.prepare("gpu-6-mig-3g40gb-9-0", CLAIM)
    recovered = await injector.recover("gpu-6-mig-3g40gb-9-4")
    assert len(recovered) == 2
    assert len(await backend.discover()) == 12
    cleared = [e for e in backend._queue if e.cleared]
    assert {e.device for e in cleared} == {"gpu-6-mig-3g40gb-9-0", "gpu-6-mig-3g40gb-9-4"}


async def test_inject_gpu_lost_is_lose() -> None:
    (backend,), injector = make_backends("nvidia-a100-8x")
    await injector.inject("gpu-2", "gpu-lost")
    assert "gpu-2" in backend.lost


async def test_recover_one_condition_or_all() -> None:
    (backend,), injector = make_backends("amd-mi300x-8x")
    await injector.inject("gpu-1-128", "ring-hang")
    await injector.inject("gpu-1-128", "ecc-uncorrectable", "umc")
    await injector.inject("gpu-1-128", "ecc-uncorrectable", "umc")
    assert backend.active[("gpu-1-128", "ecc-uncorrectable", "umc")].count == 2
    assert await injector.recover("gpu-1-128", "ring-hang") == ["gpu.amd.com/gpu-1-128"]
    assert set(backend.active) == {("gpu-1-128", "ecc-uncorrectable", "umc")}
    await injector.recover("gpu-1-128")
    assert not backend.active
    # A condition this process does not know is still cleared (the agent may hold it).
    backend._queue.clear()
    assert await injector.recover("gpu-2-129", "gpu-reset") == ["gpu.amd.com/gpu-2-129"]
    assert [(e.condition, e.cleared) for e in backend._queue] == [("gpu-reset", True)]
    # Nothing to recover at all: no events.
    backend._queue.clear()
    assert await injector.recover("gpu-3-130") == []
    assert not backend._queue


async def test_fault_errors_are_clear() -> None:
    _, injector = make_backends()
    with pytest.raises(FaultError, match="no device 'gpu-9' on any fake driver"):
        await injector.inject("gpu-9", "xid", "79")
    with pytest.raises(FaultError, match=r"driver 'gpu\.amd\.com' has no device 'gpu-0'"):
        await injector.inject("gpu-0", "xid", "79", driver="gpu.amd.com")
    with pytest.raises(
        FaultError, match=r"no fake driver 'x\.example\.com'; drivers are gpu\.amd\.com, gpu\.nvidia\.com"
    ):
        await injector.recover("gpu-0", driver="x.example.com")
    with pytest.raises(FaultError, match="condition 'XID 79'"):
        await injector.inject("gpu-0", "XID 79")


async def test_ambiguous_device_needs_a_driver(tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "two.yaml"
    path.write_text(
        "drivers:\n- name: a.example.com\n  devices: [{name: dev-0}]\n"
        "- name: b.example.com\n  devices: [{name: dev-0}]\n"
    )
    _, injector = make_backends(str(path))
    with pytest.raises(FaultError, match=r"several drivers \(a.example.com, b.example.com\)"):
        await injector.inject("dev-0", "xid")
    assert await injector.inject("dev-0", "xid", driver="b.example.com") == ["b.example.com/dev-0"]


async def test_prepare_unknown_device() -> None:
    (backend, _), _ = make_backends()
    with pytest.raises(DeviceNotFoundError, match="no device 'gpu-42'"):
        await backend.prepare("gpu-42", CLAIM)


async def test_injected_prepare_failures() -> None:
    (backend, _), _ = make_backends(prepare_fail="gpu-1+gpu-2")
    with pytest.raises(BackendError, match="injected prepare failure for device 'gpu-1'"):
        await backend.prepare("gpu-1", CLAIM)
    with pytest.raises(BackendError, match="injected prepare failure for device 'gpu-2'"):
        await backend.prepare("gpu-2", CLAIM)
    await backend.prepare("gpu-0", CLAIM)
    (backend, _), _ = make_backends(prepare_fail="*")
    with pytest.raises(BackendError):
        await backend.prepare("gpu-0", CLAIM)
    (backend, _), _ = make_backends(prepare_fail_rate="0.5", seed="7")
    outcomes = []
    for i in range(40):
        try:
            await backend.prepare("gpu-0", ClaimRef("ns", f"c{i}", f"u{i}"))
            outcomes.append(True)
        except BackendError:
            outcomes.append(False)
    assert 5 < outcomes.count(False) < 35
    (again, _), _ = make_backends(prepare_fail_rate="0.5", seed="7")
    repeat = []
    for i in range(40):
        try:
            await again.prepare("gpu-0", ClaimRef("ns", f"c{i}", f"u{i}"))
            repeat.append(True)
        except BackendError:
            repeat.append(False)
    assert repeat == outcomes  # seeded: the same run twice


def files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


async def test_a_planned_prepare_writes_the_device_file_and_an_unused_plan_leaves_nothing(
    tmp_path: Path,
) -> None:
    """`agent.core.backend.PlansPrepare`: checks at planning, the file and the record when the plan runs.

    The core drops the plans of a claim whose other device refused its plan (an injected failure
    here): a later `prepare` of the same device must still write its file.
    """
    (backend, _), _ = make_backends(device_files=str(tmp_path), prepare_fail="gpu-1")
    plan = backend.plan_prepare("gpu-0", CLAIM)
    assert plan is not None and files(tmp_path) == []
    folder = tmp_path / backend.driver_name
    with pytest.raises(BackendError, match="injected prepare failure for device 'gpu-1'"):
        backend.plan_prepare("gpu-1", CLAIM)
    await backend.prepare("gpu-0", CLAIM)  # the plan of gpu-0 never ran
    assert files(folder) == ["uid-a-gpu-0.json"]
    other = ClaimRef("default", "claim-b", "uid-b")
    plan = backend.plan_prepare("gpu-2", other)
    assert plan is not None
    planned = plan()
    assert files(folder) == ["uid-a-gpu-0.json", "uid-b-gpu-2.json"]
    assert planned == await backend.prepare("gpu-2", other)
    unplan = backend.plan_unprepare("gpu-2", other)
    assert unplan is not None
    unplan()
    assert files(folder) == ["uid-a-gpu-0.json"]
    with pytest.raises(DeviceNotFoundError):
        backend.plan_prepare("gpu-42", CLAIM)


async def test_prepare_latency_uses_the_clock(fake_clock: FakeClock) -> None:
    (backend, _), _ = make_backends(clock=fake_clock, prepare_latency="2")
    done = anyio.Event()

    async def prepare() -> None:
        await backend.prepare("gpu-0", CLAIM)
        done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(prepare)
        await wait_all_tasks_blocked()
        fake_clock.advance(1)
        await wait_all_tasks_blocked()
        assert not done.is_set()
        fake_clock.advance(1)
        await wait_all_tasks_blocked()
        assert done.is_set()


async def test_telemetry_is_plausible_and_follows_faults(fake_clock: FakeClock) -> None:
    (nvidia, amd), injector = make_backends(clock=fake_clock)
    readings = await nvidia.telemetry()
    assert [r.device for r in readings] == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
    for r in readings:
        assert r.utilization_ratio is not None and 0 <= r.utilization_ratio <= 1
        assert r.memory_total_bytes == 80 * 2**30
        assert r.memory_used_bytes is not None and 0 <= r.memory_used_bytes <= r.memory_total_bytes
        assert r.temperature_celsius is not None and 30 < r.temperature_celsius < 90
        assert r.last_error_code == 0  # no XID yet: a series at 0 from the start
    assert await nvidia.telemetry() == readings  # same time, same figures
    await injector.inject("gpu-2", "xid", "79")
    await injector.inject("gpu-1-128", "ecc-uncorrectable", "umc")
    assert {r.device: r.last_error_code for r in await nvidia.telemetry()}["gpu-2"] == 79
    assert {r.device: r.ecc_uncorrected_total for r in await amd.telemetry()}["gpu-1-128"] == 1
    await injector.lose("gpu-0")
    assert "gpu-0" not in [r.device for r in await nvidia.telemetry()]


async def test_queue_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    assert MAX_QUEUED_EVENTS >= 10_000
    monkeypatch.setattr(fake_backend_module, "MAX_QUEUED_EVENTS", 100)
    (backend, _), injector = make_backends()
    for _ in range(105):
        injector.inject_now("gpu-0", "xid", "79")
    assert len(backend._queue) == 100
    assert backend._dropped == 5


async def test_sink_failure_propagates_and_a_restart_goes_on() -> None:
    (backend, _), injector = make_backends()
    await injector.inject("gpu-0", "xid", "79")
    await injector.inject("gpu-0", "xid", "48")

    async def broken(event: HealthEvent) -> None:
        raise RuntimeError("sink down")

    with pytest.raises(RuntimeError, match="sink down"):
        await backend.monitor_health(broken)
    sink = Collector()
    async with anyio.create_task_group() as tg:
        tg.start_soon(backend.monitor_health, sink)
        await wait_all_tasks_blocked()
        tg.cancel_scope.cancel()
    # The event the broken sink failed on is delivered again.
    assert sink.conditions() == [("gpu-0", "xid", "79", False), ("gpu-0", "xid", "48", False)]


async def test_the_fake_gpu_policy_keeps_every_change_made_at_once(tmp_path: Path) -> None:
    """Two MPS claims prepared in one call set two GPUs' compute modes at once: none is lost.

    Each change rewrites the whole file; run concurrently, they used to lose an update or fail
    on the other's temp file (FileNotFoundError, seen as a flaky sharing restart test).
    """
    policy = FakeGpuPolicy(tmp_path / "policy")
    uuids = [f"GPU-{i:08d}" for i in range(16)]
    async with anyio.create_task_group() as tg:
        for uuid in uuids:
            tg.start_soon(policy.set_compute_mode, uuid, "EXCLUSIVE_PROCESS")
            tg.start_soon(policy.set_interval, uuid, 2)
    assert policy.modes() == dict.fromkeys(uuids, "EXCLUSIVE_PROCESS")
    assert policy.intervals() == dict.fromkeys(uuids, 2)
