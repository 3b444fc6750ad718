"""Every file the agent parses is bounded: one line naming the flag or file, the limit, exit 2.

Issue 12 point 6 and issue 13 point 5: a nested ``--taint-policy`` printed a 2,980-line
traceback, a 60 MB policy was read whole, a binary ``--kubeconfig`` or ``--taint-policy`` printed
a traceback. The checkpoint and CDI specs are covered in ``tests/kubelet``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import agent.kube.credentials
from agent.cli import main
from agent.core.errors import ConfigError
from agent.health.taints import MAX_POLICY_BYTES
from agent.kube.credentials import check_kubeconfig
from backends.fake.profile import ProfileError, load_profile
from backends.fake.scenario import ScenarioError, load_scenario

REPO = Path(__file__).resolve().parent.parent
GARBAGE = bytes(range(256)) * 16
DEEP_FLOW = b"[" * 5000 + b"]" * 5000
DEEP_BLOCK = b"".join(b"  " * i + b"a:\n" for i in range(100)) + b"  " * 100 + b"b: 1\n"
KUBECONFIG = b"""apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:1"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
"""


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("dra-agent: error: ")
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (DEEP_FLOW, "expected a YAML file"),  # libyaml or our depth limit stops it first
        (DEEP_BLOCK, "expected a YAML file nested at most 64 levels; it is nested more than 64 levels deep"),
        (GARBAGE, "expected a YAML file in UTF-8; it is not UTF-8 text (byte 128 is 0x80)"),
        (b"#" * (MAX_POLICY_BYTES + 1), "expected a YAML file of at most 1 MiB; it is larger than 1 MiB"),
        (b"rules: [\n", "it is not valid YAML at line 2"),
    ],
    ids=["deep-flow", "deep-block", "binary", "too-large", "invalid"],
)
def test_bad_taint_policy_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, expected: str
) -> None:
    path = tmp_path / "policy.yaml"
    path.write_bytes(content)
    assert main(["run", "--kube", "none", "--taint-policy", str(path)]) == 2
    err = one_line_error(capsys)
    assert f"invalid value '{path}' for --taint-policy: " in err
    assert expected in err


def run_with_kubeconfig(tmp_path: Path, kubeconfig: Path) -> int:
    return main(
        [
            "run",
            "--kube",
            "kubeconfig",
            "--kubeconfig",
            str(kubeconfig),
            "--backend",
            "fake:profile=mixed,control=off",
            "--state-dir",
            str(tmp_path / "state"),
            "--cdi-root",
            str(tmp_path / "cdi"),
            "--plugins-dir",
            str(tmp_path / "plugins"),
            "--registry-dir",
            str(tmp_path / "registry"),
        ]
    )


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (GARBAGE, "expected a kubeconfig YAML file in UTF-8; it is not UTF-8 text"),
        (DEEP_BLOCK, "nested at most 64 levels; it is nested more than 64 levels deep"),
        (b"- just\n- a list\n", "expected a kubeconfig YAML file: a mapping of clusters, users, contexts"),
        (b"clusters: [\n", "it is not valid YAML at line 2"),
    ],
    ids=["binary", "deep", "not-a-mapping", "invalid"],
)
def test_bad_kubeconfig_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, expected: str
) -> None:
    path = tmp_path / "kubeconfig"
    path.write_bytes(content)
    assert run_with_kubeconfig(tmp_path, path) == 2
    err = one_line_error(capsys)
    assert f"invalid value '{path}' for --kubeconfig: " in err
    assert expected in err


def test_oversized_kubeconfig(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(agent.kube.credentials, "MAX_KUBECONFIG_BYTES", 64)
    path = tmp_path / "kubeconfig"
    path.write_bytes(KUBECONFIG)
    assert run_with_kubeconfig(tmp_path, path) == 2
    assert (
        "expected a kubeconfig YAML file of at most 64 bytes; it is larger than 64 bytes"
        in one_line_error(capsys)
    )


def test_kubeconfig_lists_are_checked_file_by_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    good, bad, empty = tmp_path / "good", tmp_path / "bad", tmp_path / "empty"
    good.write_bytes(KUBECONFIG)
    bad.write_bytes(GARBAGE)
    empty.write_bytes(b"")
    missing = tmp_path / "missing"  # one missing file of a list is skipped, as the library does
    check_kubeconfig(os.pathsep.join([str(good), str(missing), str(empty)]))
    with pytest.raises(ConfigError) as caught:
        check_kubeconfig(os.pathsep.join([str(good), str(bad)]))
    assert caught.value.value == str(bad)
    monkeypatch.setenv("KUBECONFIG", str(bad))
    with pytest.raises(ConfigError, match="not UTF-8"):
        check_kubeconfig(None)
    monkeypatch.delenv("KUBECONFIG")
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ConfigError, match="expected an existing kubeconfig file"):
        check_kubeconfig(None)  # no ~/.kube/config at all
    (tmp_path / ".kube").mkdir()
    (tmp_path / ".kube" / "config").write_bytes(DEEP_BLOCK)
    with pytest.raises(ConfigError, match=r"~/\.kube/config.*nested more than 64 levels"):
        check_kubeconfig(None)


def test_binary_taint_policy_through_the_console_script(tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_bytes(DEEP_FLOW)
    done = subprocess.run(
        [sys.executable, "-m", "agent.cli", "run", "--kube", "none", "--taint-policy", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"dra-agent: error: invalid value '{path}' for --taint-policy: expected")


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (GARBAGE, "not UTF-8 text (byte 128 is 0x80); expected a YAML profile in UTF-8"),
        (DEEP_FLOW, "expected a YAML profile"),
        (DEEP_BLOCK, "nested more than 64 levels deep; expected a YAML profile nested at most 64 levels"),
    ],
    ids=["binary", "deep-flow", "deep-block"],
)
def test_bad_fake_profile_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, expected: str
) -> None:
    path = tmp_path / "profile.yaml"
    path.write_bytes(content)
    with pytest.raises(ProfileError) as caught:
        load_profile(str(path))
    assert str(caught.value).startswith(f"profile {path}: ")
    assert expected in str(caught.value)
    assert main(["devices", "--backend", f"fake:profile={path},control=off"]) == 1
    assert expected in one_line_error(capsys)


def test_oversized_fake_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import backends.fake.profile

    monkeypatch.setattr(backends.fake.profile, "MAX_PROFILE_BYTES", 10)
    path = tmp_path / "profile.yaml"
    path.write_bytes(b"drivers: []\n")
    with pytest.raises(
        ProfileError, match="larger than 10 bytes; expected a YAML profile of at most 10 bytes"
    ):
        load_profile(str(path))


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (GARBAGE, "not UTF-8 text"),
        (DEEP_BLOCK, "nested more than 64 levels deep"),
        (b"#" * (1024 * 1024 + 1), "larger than 1 MiB; expected a YAML scenario of at most 1 MiB"),
    ],
    ids=["binary", "deep", "too-large"],
)
def test_bad_fake_scenario_file(tmp_path: Path, content: bytes, expected: str) -> None:
    path = tmp_path / "scenario.yaml"
    path.write_bytes(content)
    with pytest.raises(ScenarioError) as caught:
        load_scenario(path)
    assert expected in str(caught.value)
    assert "\n" not in str(caught.value)
