from __future__ import annotations

from agent.observe.readiness import NOT_REPORTED, Readiness


def test_empty_is_ready() -> None:
    assert Readiness().ready() == (True, {})


def test_expected_check_is_not_ready_until_set() -> None:
    readiness = Readiness()
    readiness.expect("registered/gpu.example.com")
    ok, checks = readiness.ready()
    assert not ok
    assert checks == {"registered/gpu.example.com": (False, NOT_REPORTED)}
    readiness.set("registered/gpu.example.com", True)
    assert readiness.ready() == (True, {"registered/gpu.example.com": (True, "")})


def test_expect_does_not_reset_a_set_check() -> None:
    readiness = Readiness()
    readiness.set("published/d", True, "3 slices")
    readiness.expect("published/d")
    assert readiness.ready() == (True, {"published/d": (True, "3 slices")})


def test_any_failing_check_makes_not_ready_and_remove_forgets() -> None:
    readiness = Readiness()
    readiness.set("registered/a", True)
    readiness.set("monitor/a", False, "NVML not answering")
    ok, checks = readiness.ready()
    assert not ok
    assert list(checks) == ["monitor/a", "registered/a"]
    assert checks["monitor/a"] == (False, "NVML not answering")
    readiness.remove("monitor/a")
    readiness.remove("never-set")
    assert readiness.ready()[0]


def test_ready_returns_a_copy() -> None:
    readiness = Readiness()
    readiness.set("x", True)
    _, checks = readiness.ready()
    checks["x"] = (False, "mutated")
    assert readiness.ready()[0]
