"""What the agent imports before the kubelet sockets serve.

After a kill -9 the kubelet waits for our registration socket, and every module imported before
it serves delays it (issue 14: start to registration socket <= 400 ms). The modules below are
imported where they are used: by the profiles and settings that need them. (The API client, the
publisher and the metrics server are imported at start since issue 33: importing them in a
worker thread once the sockets served saved less than 100 ms to the first prepare answered
after a kill -9, which waits for the API client anyway; see benchmarks/README.md.) Each check
runs in a fresh interpreter and looks at ``sys.modules``; the time itself is measured in
`benchmarks/` (never in a test).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

START_UP = "import agent.cli, agent.runner, backends.fake"
"""What `dra-agent run` imports before it starts (its backend set, the fake one here)."""

LATE = (
    # kubernetes-asyncio's credential loaders: by the API client's connect, in a worker thread.
    "kubernetes_asyncio.config",
    # The AMD backend: the fake backend needs only AMD's claim configuration.
    "backends.amd.backend",
    "backends.amd.discovery",
    "backends.amd.health",
    # The fake backend's dynamic MIG (dynamic-mig=true) and NVIDIA's MIG tables.
    "backends.fake.dynamicmig",
    "backends.fake.migtables",
    "backends.nvidia.migprofiles",
    "backends.nvidia.discovery",
    # NVIDIA time-slicing and MPS: NVIDIA profiles only, at the first share or the resume at start.
    "backends.fake.sharing",
    "backends.nvidia.sharing",
    "backends.nvidia.mps",
    # The fake control socket: only with control on, in a worker thread.
    "backends.fake.control",
    "backends.fake.scenario",
    # YAML: only when a YAML file is parsed (a fake profile, a kubeconfig, a taint policy).
    "yaml",
)

CREATE = """
import sys, tempfile
from pathlib import Path
from agent.core.backend import BackendOptions
from backends.fake import create_backend
settings = dict(profile=sys.argv[1], control="off", **dict(a.split("=", 1) for a in sys.argv[2:]))
backends = create_backend(BackendOptions("node-1", None, settings, Path(tempfile.mkdtemp())))
"""
RESUME = """
import anyio
for backend in backends:
    anyio.run(backend.resume_shares, [])
"""


def imported_after(code: str, *args: str) -> set[str]:
    """The modules in ``sys.modules`` after `code` ran in a fresh interpreter."""
    script = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=60, check=True
    )
    return set(json.loads(out.stdout.splitlines()[-1]))


def test_the_start_up_imports_leave_out_what_serves_after_the_sockets_or_other_profiles() -> None:
    loaded = imported_after(START_UP)
    assert "agent.kubelet.plugin" in loaded  # the check itself sees what is imported
    assert sorted(name for name in LATE if name in loaded) == []


NV_SHARING = {"backends.nvidia.sharing", "backends.nvidia.mps", "backends.fake.sharing"}


def test_an_nvidia_profile_imports_nvidia_sharing_at_the_resume_and_no_amd_backend_nor_dynamic_mig() -> None:
    created = imported_after(CREATE, "nvidia-a100-8x")
    unused = {"backends.amd.backend", "backends.fake.dynamicmig", "backends.nvidia.migprofiles"}
    assert sorted((unused | NV_SHARING) & created) == []
    resumed = imported_after(CREATE + RESUME, "nvidia-a100-8x")
    assert resumed >= NV_SHARING
    assert sorted(unused & resumed) == []


@pytest.mark.parametrize("profile", ["amd-mi300x-8x", "amd-mi300x-8x-cpx"])
def test_an_amd_profile_imports_no_nvidia_sharing(profile: str) -> None:
    loaded = imported_after(CREATE + RESUME, profile)
    assert "backends.amd.sharingconfig" in loaded
    assert sorted((NV_SHARING | {"backends.amd.backend"}) & loaded) == []


def test_dynamic_mig_imports_the_mig_tables_when_asked() -> None:
    loaded = imported_after(CREATE, "nvidia-a100-8x", "dynamic-mig=true")
    assert {"backends.fake.dynamicmig", "backends.nvidia.migprofiles"} <= loaded


def test_the_amd_package_still_exports_its_backend_class() -> None:
    import backends.amd
    from backends.amd.backend import AmdBackend

    assert backends.amd.AmdBackend is AmdBackend
    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        getattr(backends.amd, "Nothing")  # noqa: B009 - the module's __getattr__ under test
