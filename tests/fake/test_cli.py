"""``dra-agent fake ...`` against a running fake backend: exit codes, output and error lines."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import anyio.to_thread
import pytest

from agent.cli import main
from tests.fake.helpers import Collector, make_backends, short_socket_path, write_text


@asynccontextmanager
async def agent_socket() -> AsyncIterator[str]:
    path = short_socket_path()
    backends, _ = make_backends(control=path)
    async with anyio.create_task_group() as tg:
        for backend in backends:
            tg.start_soon(backend.monitor_health, Collector())
        for _ in range(1000):
            try:
                stream = await anyio.connect_unix(path)
            except OSError:
                await anyio.sleep(0.005)
            else:
                await stream.aclose()
                break
        yield path
        tg.cancel_scope.cancel()


async def cli(*argv: str) -> int:
    """`agent.cli.main` in a worker thread (it runs its own event loop)."""
    return await anyio.to_thread.run_sync(main, list(argv))


async def test_inject_list_recover_lose(capsys: pytest.CaptureFixture[str]) -> None:
    async with agent_socket() as sock:
        assert (
            await cli(
                "fake", "inject", "--device", "gpu-3", "--condition", "xid", "--value", "79", "--socket", sock
            )
            == 0
        )
        assert capsys.readouterr().out == "injected: gpu.nvidia.com/gpu-3\n"
        assert (
            await cli(
                "fake",
                "inject",
                "--device",
                "gpu-1-128",
                "--condition",
                "ring-hang",
                "--driver",
                "gpu.amd.com",
                "--severity",
                "warning",
                "--kind",
                "state",
                "--message",
                "hung",
                "--socket",
                sock,
            )
            == 0
        )
        capsys.readouterr()
        assert await cli("fake", "list", "--socket", sock) == 0
        table = capsys.readouterr().out.splitlines()
        assert table[0].split() == ["DRIVER", "DEVICE", "STATE", "FAULTS"]
        assert any("gpu-3" in line and "xid=79(critical, x1)" in line for line in table)
        assert any("gpu-1-128" in line and "ring-hang(warning, x1)" in line for line in table)
        assert await cli("fake", "lose", "--device", "gpu-2", "--socket", sock) == 0
        assert capsys.readouterr().out == "lost: gpu.nvidia.com/gpu-2\n"
        assert await cli("fake", "list", "-o", "json", "--socket", sock) == 0
        rows = json.loads(capsys.readouterr().out)
        assert {r["device"] for r in rows if r["lost"]} == {"gpu-2"}
        assert await cli("fake", "recover", "--device", "gpu-3", "--condition", "xid", "--socket", sock) == 0
        assert capsys.readouterr().out == "recovered: gpu.nvidia.com/gpu-3\n"
        assert await cli("fake", "recover", "--device", "gpu-0", "--socket", sock) == 0
        assert capsys.readouterr().out == "recovered: nothing to do\n"


async def test_unknown_device_is_one_error_line_and_the_agent_goes_on(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with agent_socket() as sock:
        assert await cli("fake", "inject", "--device", "gpu-9", "--condition", "xid", "--socket", sock) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1
        assert err.startswith("dra-agent: error: no device 'gpu-9' on any fake driver")
        assert await cli("fake", "inject", "--device", "gpu-0", "--condition", "xid", "--socket", sock) == 0


async def test_scenario_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = str(tmp_path / "good.yaml")
    write_text(good, "steps:\n- at: 0\n  inject: {device: gpu-0, condition: xid, value: 79}\n")
    bad_step = str(tmp_path / "bad-step.yaml")
    write_text(bad_step, "steps:\n- at: 0\n  inject: {device: gpu-77, condition: xid}\n")
    async with agent_socket() as sock:
        assert await cli("fake", "scenario", good, "--socket", sock) == 0
        assert capsys.readouterr().out == f"scenario {good}: 1 actions, 1 events\n"
        assert await cli("fake", "scenario", bad_step, "--socket", sock) == 1
        captured = capsys.readouterr()
        assert "0 actions" in captured.out and "gpu-77" in captured.err


async def test_invalid_scenario_file_fails_before_sending(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(tmp_path / "s.yaml")
    write_text(path, "steps:\n- at: 0\n  explode: {device: gpu-0}\n")
    assert await cli("fake", "scenario", path, "--socket", short_socket_path()) == 1
    assert (
        capsys.readouterr().err == f"dra-agent: error: scenario {path}: steps[0].explode: unknown field "
        "(allowed: at, inject, recover, lose, storm)\n"
    )


async def test_no_agent_running(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    sock = short_socket_path()
    monkeypatch.setenv("DRA_AGENT_FAKE_SOCKET", sock)
    assert await cli("fake", "list") == 1
    err = capsys.readouterr().err
    assert f"cannot reach the fake backend's control socket {sock}" in err
    monkeypatch.delenv("DRA_AGENT_FAKE_SOCKET")
    monkeypatch.setenv("NODE_NAME", "node-zz-test")
    assert await cli("fake", "list") == 1
    assert "/tmp/dra-agent-fake-node-zz-test.sock" in capsys.readouterr().err
    assert await cli("fake", "list", "--node-name", "node-yy-test") == 1
    assert "/tmp/dra-agent-fake-node-yy-test.sock" in capsys.readouterr().err


def test_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["fake", "inject", "--condition", "xid"])
    assert caught.value.code == 2
    assert "--device" in capsys.readouterr().err
    with pytest.raises(SystemExit) as caught:
        main(["fake", "inject", "--device", "gpu-0", "--condition", "xid", "--severity", "fatal"])
    assert caught.value.code == 2
    with pytest.raises(SystemExit) as caught:
        main(["fake"])
    assert caught.value.code == 2
