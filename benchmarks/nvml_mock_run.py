"""The NVIDIA backend through the real pynvml on NVIDIA's own mock NVML (issue 29; not run in CI).

NVIDIA's mock ``libnvidia-ml.so.1`` (github.com/NVIDIA/k8s-test-infra ``pkg/gpu/mocknvml``, a C
library built from Go) stands in for the driver; ``pynvml`` loads it through
``LD_LIBRARY_PATH``. Three parts, each in child processes that get the mock's environment:

1. discovery: ``dra-agent devices --backend nvidia -o yaml`` on each of the mock's seven profiles;
2. health: one ``dra-agent run --kube none`` on the H100 profile while the mock's control tool
   (``nvml-mock-ctl fail``) breaks GPUs; the agent's JSON log says when each condition is raised
   and lifted, and its last printed ResourceSlice which taints were published;
3. dynamic MIG: ``dra-agent devices --backend nvidia:dynamic-mig=true`` with MIG mode on, then a
   prepare of an H100 ``1g.10gb`` placement straight through the backend's dynamic-MIG code (the
   mock stubs the GPU-instance calls: the agent must refuse with an error and leave nothing behind).

Build the mock first (recipe in benchmarks/README.md), then:
``python -m benchmarks.nvml_mock_run /path/to/k8s-test-infra/pkg/gpu/mocknvml`` (``--only
discovery|health|mig``). Prints one table per part; exit status 1 when a check did not hold.
Another nvidia-ml-py: ``PYTHONPATH=<pip --target dir of it>`` (as ``make nvidia-floor`` does).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import yaml

PROFILES = ("a100", "h100", "b200", "gb200", "gb300", "l40s", "t4")
HEALTH_PROFILE = "h100"
WAIT_LIMIT = 30.0
"""Seconds a fault may take to show: well over the mock's 1 s override TTL plus two passes."""


@dataclass(frozen=True)
class Mock:
    """A built mocknvml directory: the library, its configs and its control tool."""

    root: Path
    ctl: Path
    work: Path

    def config(self, profile: str) -> Path:
        return self.root / "configs" / f"mock-nvml-config-{profile}.yaml"

    def env(self, profile: str) -> dict[str, str]:
        return {
            **os.environ,
            "LD_LIBRARY_PATH": str(self.root),
            "MOCK_NVML_CONFIG": str(self.config(profile)),
            # Our own overrides file: the tool's default is a node path under /var/lib/nvml-mock.
            "MOCK_NVML_OVERRIDES": str(self.work / "overrides.yaml"),
        }

    def control(self, profile: str, *args: str) -> None:
        subprocess.run(
            [str(self.ctl), *args], env=self.env(profile), check=True, capture_output=True, text=True
        )


@dataclass(frozen=True)
class Row:
    check: str
    expected: str
    observed: str
    ok: bool


def dra_agent() -> list[str]:
    return [sys.executable, "-m", "agent.cli"]


def table(title: str, header: list[str], rows: list[list[str]]) -> None:
    print(f"\n{title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def check_table(title: str, rows: list[Row]) -> bool:
    table(
        title,
        ["check", "expected", "observed", "result"],
        [[r.check, r.expected, r.observed, "ok" if r.ok else "**FAIL**"] for r in rows],
    )
    return all(r.ok for r in rows)


# -- 1. discovery -------------------------------------------------------------------------------


def attribute(device: dict[str, Any], name: str) -> str:
    value = device.get("attributes", {}).get(name, {})
    return str(next(iter(value.values()), "-")) if value else "-"


def discovery(mock: Mock) -> bool:
    rows: list[list[str]] = []
    ok = True
    for profile in PROFILES:
        expected = len(yaml.safe_load(mock.config(profile).read_text())["devices"])
        t0 = time.perf_counter()
        done = subprocess.run(
            [*dra_agent(), "devices", "--backend", "nvidia", "-o", "yaml"],
            env=mock.env(profile),
            check=False,
            capture_output=True,
            text=True,
        )
        seconds = time.perf_counter() - t0
        devices: list[dict[str, Any]] = yaml.safe_load(done.stdout) or [] if done.returncode == 0 else []
        healthy = sum(1 for d in devices if d.get("health") == "Healthy")
        good = done.returncode == 0 and len(devices) == expected == healthy
        ok = ok and good
        first = devices[0] if devices else {}

        def distinct(name: str, found: list[dict[str, Any]] = devices) -> str:
            return ", ".join(sorted({attribute(d, name) for d in found})) or "-"

        memory = ", ".join(sorted({str(d.get("capacity", {}).get("memory", "-")) for d in devices})) or "-"
        rows.append(
            [
                profile,
                f"{len(devices)}/{expected}",
                f"{healthy}",
                attribute(first, "productName"),
                distinct("architecture"),
                distinct("cudaComputeCapability"),
                memory,
                distinct("driverVersion"),
                distinct("cudaDriverVersion"),
                f"{len(first.get('attributes', {}))}",
                f"{seconds:.2f} s",
                "ok" if good else f"**FAIL** (exit {done.returncode}: {done.stderr.strip()[-200:]})",
            ]
        )
    table(
        "Discovery: `dra-agent devices --backend nvidia -o yaml` per profile",
        [
            "profile",
            "devices/config",
            "Healthy",
            "productName",
            "architecture",
            "compute capability",
            "memory",
            "driverVersion",
            "cudaDriverVersion",
            "attributes",
            "time",
            "result",
        ],
        rows,
    )
    return ok


# -- 2. health ----------------------------------------------------------------------------------


class AgentLog:
    """The JSON log of a running agent, read as it grows."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = []
        self._offset = 0

    def read(self) -> list[dict[str, Any]]:
        with self.path.open("rb") as f:
            f.seek(self._offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self._offset += len(complete)
        for line in complete.decode().splitlines():
            if line.startswith("{"):
                self.records.append(json.loads(line))
        return self.records

    def find(self, match: Callable[[dict[str, Any]], bool], since: float) -> dict[str, Any] | None:
        return next((r for r in self.read() if r["ts"] >= since and match(r)), None)

    def wait(self, match: Callable[[dict[str, Any]], bool], since: float) -> dict[str, Any] | None:
        deadline = time.monotonic() + WAIT_LIMIT
        while time.monotonic() < deadline:
            found = self.find(match, since)
            if found is not None:
                return found
            time.sleep(0.05)
        return None


def after(found: dict[str, Any] | None, at: float) -> str:
    return f"after {found['ts'] - at:.1f} s" if found else f"not within {WAIT_LIMIT:.0f} s"


def condition(msg: str, device: str, name: str, value: str | None = None) -> Callable[[dict[str, Any]], bool]:
    def match(record: dict[str, Any]) -> bool:
        return (
            record.get("msg") == msg
            and record.get("device") == device
            and record.get("condition") == name
            and (value is None or str(record.get("value")) == value)
        )

    return match


@contextmanager
def running_agent(mock: Mock, settings: str) -> Iterator[tuple[AgentLog, Path]]:
    log_path, out_path = mock.work / "agent.log", mock.work / "slices.yaml"
    with log_path.open("wb") as err, out_path.open("wb") as out:
        agent = subprocess.Popen(
            [
                *dra_agent(),
                "run",
                "--kube",
                "none",
                "--serve-kubelet",
                "false",
                "--node-name",
                "mock-node",
                "--backend",
                f"nvidia:{settings}",
                "--health-interval",
                "1",
                "--taint-hold",
                "1",
                "--state-dir",
                str(mock.work / "state"),
                "--metrics-address",
                "127.0.0.1:0",
                "--log-format",
                "json",
            ],
            env=mock.env(HEALTH_PROFILE),
            stdout=out,
            stderr=err,
        )
        try:
            yield AgentLog(log_path), out_path
        finally:
            agent.terminate()
            try:
                agent.wait(timeout=15)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()


def last_taints(slices: Path) -> dict[str, list[str]]:
    """Device -> taint keys (with values) in the last slice the agent printed."""
    documents = [d for d in yaml.safe_load_all(slices.read_text()) if d]
    taints: dict[str, list[str]] = {}
    for item in documents[-1]["items"] if documents else []:
        for device in item["spec"].get("devices", []):
            for taint in device.get("taints", []):
                key = taint["key"].rsplit("/", 1)[-1]
                value = f"={taint['value']}" if taint.get("value") else ""
                taints.setdefault(device["name"], []).append(f"{key}{value}:{taint['effect']}")
    return taints


def health(mock: Mock) -> bool:
    rows: list[Row] = []
    raised = "health condition raised"
    with running_agent(mock, "recovery-interval=1") as (log, slices):
        started = log.wait(lambda r: r.get("msg") == "readiness check changed" and r.get("ok") is True, 0)
        if started is None:
            print(f"the agent did not start; its log: {log.path}")
            return False

        def fault(title: str, args: list[str], expect: list[tuple[str, str, str | None]]) -> float:
            at = time.time()
            mock.control(HEALTH_PROFILE, "fail", *args)
            for device, name, value in expect:
                found = log.wait(condition(raised, device, name, value), at)
                shown = f"{name}={value}" if value else name
                rows.append(
                    Row(f"{title}: {shown} on {device}", "raised", after(found, at), found is not None)
                )
            return at

        since = fault(
            "`fail --gpu 0 --mode lost`", ["--gpu", "0", "--mode", "lost"], [("gpu-0", "gpu-lost", None)]
        )
        fault(
            "`fail --gpu 1 --mode ecc_uncorrectable`",
            ["--gpu", "1", "--mode", "ecc_uncorrectable"],
            [("gpu-1", "ecc-uncorrectable", None)],
        )
        fault(
            "`fail --gpu 2 --mode fallen_off_bus --xid 79`",
            ["--gpu", "2", "--mode", "fallen_off_bus", "--xid", "79"],
            [("gpu-2", "xid", "79"), ("gpu-2", "gpu-lost", None)],
        )
        fault(
            "`fail --gpu 3 --mode ecc_uncorrectable --xid 13`",
            ["--gpu", "3", "--mode", "ecc_uncorrectable", "--xid", "13"],
            [("gpu-3", "xid", "13")],
        )
        at = time.time()
        mock.control(HEALTH_PROFILE, "fail", "--gpu", "0", "--mode", "healthy")
        lifted = log.wait(condition("health condition lifted", "gpu-0", "gpu-lost"), at)
        rows.append(
            Row(
                "`fail --gpu 0 --mode healthy`: gpu-lost on gpu-0",
                "lifted",
                after(lifted, at),
                lifted is not None,
            )
        )
        wrongly_lost = sorted(
            {
                r["device"]
                for r in log.read()
                if r["ts"] >= since and r.get("msg") == raised and r.get("condition") == "gpu-lost"
            }
            - {"gpu-0", "gpu-2"}
        )
        rows.append(
            Row(
                "gpu-lost on a GPU the mock did not break (nvml.h: lookups fail while any GPU is lost)",
                "none",
                ", ".join(wrongly_lost) or "none",
                not wrongly_lost,
            )
        )
        crashed = [
            r for r in log.read() if r.get("level") == "error" and "Traceback" in str(r.get("error", ""))
        ]
        rows.append(Row("agent errors with a traceback", "none", str(len(crashed)), not crashed))
        # Printing is debounced: give the last change time to reach stdout.
        time.sleep(2)
        taints = last_taints(slices)
    ok = check_table(
        f"Health: `dra-agent run --kube none --backend nvidia:recovery-interval=1 --health-interval 1 "
        f"--taint-hold 1` on the {HEALTH_PROFILE.upper()} profile, faults by `nvml-mock-ctl`",
        rows,
    )
    table(
        "Taints in the last ResourceSlice the agent printed",
        ["device", "taints"],
        [[device, ", ".join(keys)] for device, keys in sorted(taints.items())] or [["-", "none"]],
    )
    return ok


# -- 3. dynamic MIG -----------------------------------------------------------------------------


def dynamic_mig(mock: Mock) -> bool:
    rows: list[Row] = []
    mock.control(HEALTH_PROFILE, "reset")
    mock.control(HEALTH_PROFILE, "set", "--gpu", "all", "mig.mode_current=enabled")
    journal = mock.work / "mig"
    done = subprocess.run(
        [
            *dra_agent(),
            "devices",
            "--backend",
            f"nvidia:dynamic-mig=true,dynamic-mig-dir={journal}",
            "-o",
            "yaml",
            "--log-format",
            "json",
        ],
        env=mock.env(HEALTH_PROFILE),
        check=False,
        capture_output=True,
        text=True,
    )
    devices: list[dict[str, Any]] = yaml.safe_load(done.stdout) or [] if done.returncode == 0 else []
    warnings = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    refused = [w for w in warnings if w["msg"].startswith("GPU in MIG mode but its GPU-instance calls fail")]
    whole = [d for d in devices if attribute(d, "type") == "gpu"]
    rows.append(
        Row(
            "discovery, MIG mode on, `dynamic-mig=true`",
            "8 whole GPUs, no placement, one warning per GPU",
            f"exit {done.returncode}, {len(whole)} whole GPUs, {len(devices) - len(whole)} other devices, "
            f"{len(refused)} warnings ({refused[0]['error'] if refused else '-'})",
            done.returncode == 0 and len(whole) == len(devices) == len(refused) == 8,
        )
    )
    child = subprocess.run(
        [sys.executable, "-m", "benchmarks.nvml_mock_run", "--mig-prepare-child", str(journal)],
        env=mock.env(HEALTH_PROFILE),
        check=False,
        capture_output=True,
        text=True,
    )
    if child.returncode != 0 or not child.stdout.strip():
        rows.append(
            Row("prepare of a placement (child process)", "an error", f"exit {child.returncode}", False)
        )
    else:
        rows.extend(Row(**item) for item in json.loads(child.stdout.strip().splitlines()[-1]))
    mock.control(HEALTH_PROFILE, "reset")
    return check_table(
        f"Dynamic MIG on the {HEALTH_PROFILE.upper()} profile "
        "(`nvml-mock-ctl set --gpu all mig.mode_current=enabled`)",
        rows,
    )


def mig_prepare_child(journal_dir: Path) -> None:
    """In the mock's environment: what NVML and the backend's dynamic MIG answer; rows as JSON."""
    import ctypes

    from backends.nvidia.discovery import discover_sync
    from backends.nvidia.dynamicmig import DynamicMig, DynamicMigError
    from backends.nvidia.migjournal import MigJournal
    from backends.nvidia.migprofiles import MigProfile, Placement, PlacementDevice
    from backends.nvidia.nvml import Nvml, load_pynvml

    rows: list[dict[str, Any]] = []
    nvml = Nvml(load_pynvml())
    nvml.init_sync()
    lib = nvml.lib
    handle = lib.nvmlDeviceGetHandleByIndex(0)
    # H100 80GB's 1g.10gb: GPU-instance profile ID 19, one memory slice at start 0.
    where = lib.c_nvmlGpuInstancePlacement_t()
    where.start, where.size = 0, 1
    try:
        lib.nvmlDeviceCreateGpuInstanceWithPlacement(handle, 19, ctypes.byref(where))
        answer = "success"
    except lib.NVMLError as error:
        answer = str(error)
    rows.append(
        {
            "check": "pynvml `nvmlDeviceCreateGpuInstanceWithPlacement(gpu 0, 19, byref(start 0, size 1))`",
            "expected": "an NVML error (the mock stubs it)",
            "observed": answer,
            "ok": answer != "success",
        }
    )
    journal = MigJournal(journal_dir / "prepare.json")
    journal.load()
    dynamic = DynamicMig(nvml, journal)
    whole = discover_sync(nvml, "gpu.nvidia.com", partitioner=dynamic).by_name()["gpu-0"]
    placement = PlacementDevice(
        name="gpu-0-mig-1g10gb-19-0",
        gpu_uuid=whole.gpu.uuid,
        minor=whole.gpu.minor,
        profile=MigProfile(19, "1g.10gb", 1, 9856, placements=(Placement(0, 1),)),
        placement=Placement(0, 1),
    )

    async def never(_: Any) -> None:
        raise AssertionError("no MIG device may be created on the mock")

    try:
        anyio.run(dynamic.prepare, placement, "claim-on-mock", whole, never)
        observed = "prepared (unexpected)"
    except DynamicMigError as error:
        observed = f"DynamicMigError: {str(error).split(': ', 1)[1][:120]}..."
    rows.append(
        {
            "check": "backend dynamic-MIG prepare of gpu-0's 1g.10gb placement 0",
            "expected": "DynamicMigError, no crash",
            "observed": observed,
            "ok": observed.startswith("DynamicMigError"),
        }
    )
    left = journal.entries()
    rows.append(
        {
            "check": "journal entries left after the refused prepare",
            "expected": "0",
            "observed": str(len(left)),
            "ok": not left,
        }
    )
    nvml.shutdown_sync()
    print(json.dumps(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mock_dir", type=Path, help="the built k8s-test-infra pkg/gpu/mocknvml directory")
    parser.add_argument("--ctl", type=Path, help="nvml-mock-ctl (default: MOCK_DIR/nvml-mock-ctl)")
    parser.add_argument("--only", choices=("discovery", "health", "mig"), help="run one part only")
    parser.add_argument("--work", type=Path, help="keep the agent's log, slices and overrides here")
    parser.add_argument("--mig-prepare-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mig_prepare_child:
        mig_prepare_child(args.mock_dir)
        return
    root = args.mock_dir.resolve()
    ctl = (args.ctl or root / "nvml-mock-ctl").resolve()
    for needed in (root / "libnvidia-ml.so.1", root / "configs", ctl):
        if not needed.exists():
            sys.exit(f"{needed} is missing: build the mock first (recipe in benchmarks/README.md)")
    import pynvml  # the children import the same one: they inherit PYTHONPATH

    print(f"nvidia-ml-py {importlib.metadata.version('nvidia-ml-py')} ({pynvml.__file__}); mock {root}")
    ok = True
    with tempfile.TemporaryDirectory(prefix="nvml-mock-") as scratch:
        work = args.work.resolve() if args.work else Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        (work / "overrides.yaml").unlink(missing_ok=True)
        mock = Mock(root, ctl, work)
        parts: dict[str, Callable[[Mock], bool]] = {
            "discovery": discovery,
            "health": health,
            "mig": dynamic_mig,
        }
        for name, part in parts.items():
            if args.only in (None, name):
                ok = part(mock) and ok
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
