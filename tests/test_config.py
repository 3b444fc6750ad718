"""Configuration: flags over environment over defaults; bad values name the flag and what is accepted."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.cli import main
from agent.config import OPTIONS, AgentConfig, BackendSpec, build_config, parse_backend_spec
from agent.core.errors import BackendError, ConfigError


def test_defaults() -> None:
    config = build_config({}, env={})
    assert config == AgentConfig()
    assert config.backends == (BackendSpec("fake", {"profile": "mixed"}),)


def test_flags_win_over_environment() -> None:
    env = {"NODE_NAME": "from-env", "DRA_AGENT_LOG_LEVEL": "debug", "CDI_ROOT": "/env/cdi"}
    config = build_config({"node_name": "from-flag"}, env=env)
    assert config.node_name == "from-flag"
    assert config.log_level == "debug"
    assert config.cdi_root == Path("/env/cdi")


def test_every_option_has_a_flag_and_an_env_var() -> None:
    flags = [o.flag for o in OPTIONS]
    envs = [o.env for o in OPTIONS]
    assert len(set(flags)) == len(flags) and len(set(envs)) == len(envs)
    assert all(f.startswith("--") for f in flags)


def test_backend_specs() -> None:
    assert parse_backend_spec("nvidia") == BackendSpec("nvidia", {})
    spec = parse_backend_spec("nvidia:driver=gpu.nvidia.com, driver-root=/run/nvidia/driver")
    assert spec.driver_name == "gpu.nvidia.com"
    assert spec.settings["driver-root"] == "/run/nvidia/driver"
    config = build_config({"backends": ["nvidia", "amd:driver=gpu.amd.com"]}, env={})
    assert [b.name for b in config.backends] == ["nvidia", "amd"]
    assert build_config({}, env={"DRA_AGENT_BACKENDS": "nvidia;amd"}).backends[1].name == "amd"


@pytest.mark.parametrize(
    ("flags", "env", "flag"),
    [
        ({"backends": ["Nvidia!"]}, {}, "--backend"),
        ({"backends": ["nvidia:driver"]}, {}, "--backend"),
        ({"backends": ["nvidia:driver=NOT A NAME"]}, {}, "--backend"),
        ({"node_name": "Node_1"}, {}, "--node-name"),
        ({"log_format": "xml"}, {}, "--log-format"),
        ({"metrics_address": "9478"}, {}, "--metrics-address"),
        ({"taint_hold_seconds": "-1"}, {}, "--taint-hold"),
        ({"taint_hold_seconds": "nan"}, {}, "--taint-hold"),
        ({"resync_seconds": "0"}, {}, "--resync"),
        ({"serve_kubelet": "maybe"}, {}, "--serve-kubelet"),
        ({"pod_uid": "not a uid!"}, {}, "--pod-uid"),
        ({}, {"DRA_AGENT_KUBE": "sometimes"}, "--kube (from $DRA_AGENT_KUBE)"),
    ],
)
def test_bad_values_name_the_flag(flags: dict[str, object], env: dict[str, str], flag: str) -> None:
    with pytest.raises(ConfigError) as info:
        build_config(flags, env=env)  # type: ignore[arg-type]
    assert info.value.option == flag
    assert "expected" in str(info.value)


def test_cli_bad_option_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--log-level", "loud"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--log-level" in err and "'loud'" in err and "debug, info, warning, error" in err


def test_cli_unknown_backend(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["devices", "--backend", "nosuch"]) == 1
    err = capsys.readouterr().err
    assert "unknown backend 'nosuch'" in err and "fake" in err


def test_cli_unknown_flag_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["run", "--no-such-flag"])
    assert info.value.code == 2
    assert "--no-such-flag" in capsys.readouterr().err


def test_cli_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["version"]) == 0
    assert capsys.readouterr().out.startswith("dra-agent ")


@pytest.mark.parametrize(
    ("raised", "code"),
    [
        (ExceptionGroup("task group", [BackendError("cannot load the NVML library")]), 1),
        (ExceptionGroup("outer", [ExceptionGroup("inner", [ConfigError("--x", "y", "z")])]), 2),
    ],
)
def test_cli_start_up_error_inside_the_task_group_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], raised: BaseException, code: int
) -> None:
    import agent.runner

    async def failing(config: AgentConfig) -> None:
        raise raised

    monkeypatch.setattr(agent.runner, "run_agent", failing)
    assert main(["run", "--kube", "none"]) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dra-agent: error: ")


def test_cli_other_failures_in_the_task_group_are_not_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    import agent.runner

    async def failing(config: AgentConfig) -> None:
        raise ExceptionGroup("task group", [BackendError("known"), RuntimeError("a bug")])

    monkeypatch.setattr(agent.runner, "run_agent", failing)
    with pytest.raises(ExceptionGroup):
        main(["run", "--kube", "none"])
