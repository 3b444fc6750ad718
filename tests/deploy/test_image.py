"""The container image's install steps: build the wheel, install it into a fresh venv, run it.

Docker cannot run here, so these tests run the Dockerfile's pip steps directly. The fast test
takes the dependencies from the current venv; the full one (``DRA_AGENT_SLOW_TESTS=1``, about a
minute) builds every dependency wheel and installs offline exactly as the Dockerfile does.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent import __version__

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
EXTRAS = "nvidia,amd"


@pytest.fixture
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="dra-image-") as path:
        yield Path(path)


def run(*args: str | Path, cwd: Path) -> str:
    result = subprocess.run(
        [str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


def build_wheel(out: Path, *, deps: bool) -> Path:
    spec = f".[{EXTRAS}]" if deps else "."
    extra = () if deps else ("--no-deps", "--no-build-isolation")
    run(sys.executable, "-m", "pip", "wheel", "-q", *extra, "--wheel-dir", out, spec, cwd=ROOT)
    (wheel,) = out.glob("dra_agent-*.whl")
    return wheel


def test_dockerfile_builds_wheels_then_installs_offline_as_non_root() -> None:
    text = DOCKERFILE.read_text()
    stages = re.findall(r"^FROM (\S+)", text, re.M)
    assert len(stages) == 2 and "AS" in text
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.\d+-slim$", text, re.M)
    assert f'pip wheel --wheel-dir /wheels ".[{EXTRAS}]"' in text
    assert f'pip install --no-index --find-links /wheels "dra-agent[{EXTRAS}]"' in text
    user = re.findall(r"^USER (\S+)", text, re.M)
    assert user and not user[-1].startswith(("0", "root"))
    assert "EXPOSE 9478" in text
    assert 'ENTRYPOINT ["dra-agent"]' in text
    # Everything the build copies is let in by .dockerignore.
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    for copied in re.findall(r"^COPY (?!--)(.+) \S+$", text, re.M):
        for name in copied.split():
            assert f"!{name}" in ignore or f"!{name}/" in ignore, name


def test_wheel_installs_into_a_fresh_venv(workdir: Path) -> None:
    wheel = build_wheel(workdir / "wheels", deps=False)
    venv = workdir / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=workdir)
    python = venv / "bin" / "python"
    # This venv's pip installs into the fresh one (pip --python): no pip bootstrap needed.
    run(
        sys.executable,
        "-m",
        "pip",
        "--python",
        python,
        "install",
        "-q",
        "--no-deps",
        "--no-index",
        wheel,
        cwd=workdir,
    )
    # Dependencies come from this venv (a .pth adds its site-packages after the fresh one's).
    purelib = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=workdir)
    Path(purelib.strip(), "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    assert run(venv / "bin" / "dra-agent", "version", cwd=workdir).strip() == f"dra-agent {__version__}"
    where = run(
        python,
        "-c",
        "import agent, backends.fake.profile as p, importlib.metadata as m, pathlib;"
        "print(agent.__file__);"
        "print(sorted(e.name for e in m.entry_points(group='dra_agent.backends')));"
        "print(sorted(x.name for x in pathlib.Path(p.__file__).parent.glob('profiles/*.yaml'))[:1])",
        cwd=workdir,
    ).splitlines()
    assert where[0].startswith(str(venv)), "imported the agent from outside the fresh venv"
    assert where[1] == "['amd', 'fake', 'nvidia']"
    assert where[2] != "[]", "the fake backend's profiles are missing from the wheel"


@pytest.mark.skipif(
    os.environ.get("DRA_AGENT_SLOW_TESTS") != "1", reason="set DRA_AGENT_SLOW_TESTS=1 (about a minute)"
)
def test_full_offline_install_like_the_dockerfile(workdir: Path) -> None:
    wheels = workdir / "wheels"
    build_wheel(wheels, deps=True)
    venv = workdir / "venv"
    run(sys.executable, "-m", "venv", venv, cwd=workdir)
    run(
        venv / "bin" / "python",
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--find-links",
        wheels,
        f"dra-agent[{EXTRAS}]",
        cwd=workdir,
    )
    assert run(venv / "bin" / "dra-agent", "version", cwd=workdir).strip() == f"dra-agent {__version__}"
