"""The chart gives the NVIDIA backend the host's / at /host (its host-root), read-only."""

from __future__ import annotations

import pytest

from agent.config import build_config
from agent.core.backend import BackendOptions
from backends.nvidia import NvidiaBackend
from tests.deploy.chart import CI_VALUES, load_values, render_objects


@pytest.mark.parametrize("variant", sorted(CI_VALUES))
def test_nvidia_backend_sees_the_host_root_read_only(variant: str) -> None:
    (ds,) = [o for o in render_objects(load_values(variant)) if o["kind"] == "DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    env = {e["name"]: e.get("value") for e in container["env"]}
    backends = {
        b.name: b for b in build_config({}, {"DRA_AGENT_BACKENDS": env["DRA_AGENT_BACKENDS"]}).backends
    }
    if "nvidia" not in backends:
        assert "nvidia-host-root" not in mounts and "nvidia-host-root" not in volumes
        return
    assert mounts["nvidia-host-root"] == {
        "name": "nvidia-host-root",
        "mountPath": "/host",
        "readOnly": True,
        "mountPropagation": "HostToContainer",
    }
    assert volumes["nvidia-host-root"]["hostPath"] == {"path": "/", "type": "Directory"}
    settings = backends["nvidia"].backend_settings
    assert settings["host-root"] == "/host"
    backend = NvidiaBackend(BackendOptions("node", None, settings))
    assert backend.cdi_mode == "auto"
