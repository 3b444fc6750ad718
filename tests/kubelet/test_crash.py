"""Crash tests: kill -9 the agent at every step of prepare and unprepare, restart, check the state.

The operation runs in a subprocess (`crash_harness.py`) that SIGKILLs itself at the step; the
restart (start-up reconcile) and the kubelet's retry run here on the same directories.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agent.claims.checkpoint.format import ClaimPhase, decode
from agent.claims.state.hooks import Step
from agent.claims.state.machine import DeviceState
from agent.core.backend import ClaimRef
from tests.kubelet.fakes import DRIVER, NODE, FakeClaimSource, FileBackend, make_claim, ref_of

HARNESS = Path(__file__).with_name("crash_harness.py")
REPO = Path(__file__).resolve().parents[2]
U1 = "0b7c6a2e-1111-4222-8333-444455556666"
U2 = "a1b2c3d4-1111-4222-8333-444455556666"
CLAIMS = [make_claim(U1, devices=("gpu-0", "gpu-1")), make_claim(U2, devices=("gpu-2",))]
REFS = [ref_of(c) for c in CLAIMS]
PREPARE_STEPS = [s for s in Step if s.value.startswith("prepare-")]
UNPREPARE_STEPS = [s for s in Step if s.value.startswith("unprepare-")]


def harness(
    root: Path,
    op: str,
    *,
    crash_at: Step | None = None,
    boot: str = "boot-1",
    uids: tuple[str, ...] = (U1, U2),
    crash_in_group_write: int = 0,
    planned: bool = False,
) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, str(HARNESS), str(root), op, *uids, "--boot-id", boot]
    if planned:
        args.append("--planned")
    if crash_at is not None:
        args += ["--crash-at", crash_at.value]
    if crash_in_group_write:
        args += ["--crash-in-group-write", str(crash_in_group_write)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(args, capture_output=True, text=True, timeout=60, env=env, check=False)


def setup_root(tmp_path: Path, claims: list[dict[str, Any]] = CLAIMS) -> Path:
    (tmp_path / "claims.json").write_text(json.dumps(claims))
    return tmp_path


def agent(
    root: Path, boot: str = "boot-1", claims: list[dict[str, Any]] = CLAIMS
) -> tuple[DeviceState, FileBackend]:
    backend = FileBackend(root / "backend.json")
    state = DeviceState(
        DRIVER,
        backend,
        FakeClaimSource(claims),
        node_name=NODE,
        cdi_root=root / "cdi",
        state_dir=root / "state",
        boot_id=boot,
    )
    return state, backend


def check_invariants(root: Path, backend: FileBackend, *, backend_matches: bool) -> dict[str, Any]:
    entries = dict(decode((root / "state" / "checkpoint.json").read_bytes()).entries)
    assert all(e.phase is ClaimPhase.COMPLETED for e in entries.values()), "a stale PrepareStarted survived"
    specs = {p.name for p in (root / "cdi").iterdir()} if (root / "cdi").exists() else set()
    assert specs == {f"k8s.{DRIVER}-claim_{uid}.yaml" for uid in entries}, "CDI specs and entries differ"
    if backend_matches:
        assert backend.prepared == {uid: {d.device for d in e.devices} for uid, e in entries.items()}
    return entries


PATHS = pytest.mark.parametrize("planned", [False, True], ids=["hops", "planned"])
"""Both prepare paths: a hop per step, and a backend that plans (every step in one hop)."""


@PATHS
@pytest.mark.parametrize("step", PREPARE_STEPS, ids=lambda s: s.value)
async def test_kill_during_prepare(tmp_path: Path, step: Step, planned: bool) -> None:
    root = setup_root(tmp_path)
    crashed = harness(root, "prepare", crash_at=step, planned=planned)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr

    state, backend = agent(root)
    await state.start()
    check_invariants(root, backend, backend_matches=True)

    # The kubelet got no answer and retries; then the claims are unprepared.
    results = await state.prepare(REFS)
    assert {uid: r.error for uid, r in results.items()} == {U1: "", U2: ""}
    check_invariants(root, backend, backend_matches=True)
    assert await state.unprepare(REFS) == {U1: "", U2: ""}
    assert check_invariants(root, backend, backend_matches=True) == {}


@PATHS
@pytest.mark.parametrize("step", UNPREPARE_STEPS, ids=lambda s: s.value)
async def test_kill_during_unprepare(tmp_path: Path, step: Step, planned: bool) -> None:
    root = setup_root(tmp_path)
    state, _ = agent(root)
    await state.start()
    await state.prepare(REFS)

    crashed = harness(root, "unprepare", crash_at=step, planned=planned)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr

    state, backend = agent(root)
    await state.start()
    check_invariants(root, backend, backend_matches=False)

    assert await state.unprepare(REFS) == {U1: "", U2: ""}
    assert check_invariants(root, backend, backend_matches=True) == {}


@pytest.mark.parametrize(
    "step", [Step.PREPARE_AFTER_CDI_WRITE, Step.PREPARE_AFTER_PREPARE_COMPLETED], ids=lambda s: s.value
)
async def test_kill_then_reboot(tmp_path: Path, step: Step) -> None:
    root = setup_root(tmp_path)
    assert harness(root, "prepare", crash_at=step).returncode == -signal.SIGKILL
    # Reboot: the CDI tmpfs and the devices' state are gone.
    for spec in (root / "cdi").iterdir():
        spec.unlink()
    (root / "backend.json").unlink(missing_ok=True)

    restarted = harness(root, "start", boot="boot-2")
    assert restarted.returncode == 0, restarted.stderr
    state, backend = agent(root, boot="boot-2")
    entries = check_invariants(root, backend, backend_matches=True)
    assert decode((root / "state" / "checkpoint.json").read_bytes()).boot_id == "boot-2"
    await state.start()
    results = await state.prepare(REFS)
    assert {uid: r.error for uid, r in results.items()} == {U1: "", U2: ""}
    assert set(entries) <= {U1, U2}


def test_harness_runs_to_completion_without_crash(tmp_path: Path) -> None:
    root = setup_root(tmp_path)
    done = harness(root, "prepare")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        U1: {"error": "", "devices": ["gpu-0", "gpu-1"]},
        U2: {"error": "", "devices": ["gpu-2"]},
    }
    undone = harness(root, "unprepare")
    assert json.loads(undone.stdout) == {U1: "", U2: ""}


def test_claimref_of_harness_claims() -> None:
    assert REFS[0] == ClaimRef("default", f"claim-{U1}", U1)


MANY = [make_claim(f"{i}a2e-1111-4222-8333-444455556666", devices=(f"gpu-{i}",)) for i in range(6)]
MANY_UIDS = tuple(c["metadata"]["uid"] for c in MANY)


@PATHS
@pytest.mark.parametrize(("op", "k"), [("prepare", 1), ("prepare", 2), ("unprepare", 1)])
async def test_kill_in_the_middle_of_a_group_commit(tmp_path: Path, op: str, k: int, planned: bool) -> None:
    """Six claims in one call share checkpoint writes; kill -9 while one such append is half done.

    A prepare makes two group commits (PrepareStarted, PrepareCompleted), an unprepare one.
    """
    root = setup_root(tmp_path, MANY)
    refs = [ref_of(c) for c in MANY]
    if op == "unprepare":
        state, _ = agent(root, claims=MANY)
        await state.start()
        assert {r.error for r in (await state.prepare(refs)).values()} == {""}
    crashed = harness(root, op, uids=MANY_UIDS, crash_in_group_write=k, planned=planned)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr or crashed.stdout

    state, backend = agent(root, claims=MANY)
    await state.start()  # the cut-short record is dropped, the whole ones before it replayed
    assert [p.name for p in (root / "state").iterdir()] == ["checkpoint.json"]
    check_invariants(root, backend, backend_matches=op == "prepare")
    if op == "prepare":
        assert {r.error for r in (await state.prepare(refs)).values()} == {""}
        assert set(check_invariants(root, backend, backend_matches=True)) == set(MANY_UIDS)
    assert set((await state.unprepare(refs)).values()) == {""}
    assert check_invariants(root, backend, backend_matches=True) == {}
