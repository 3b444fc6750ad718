"""Credentials through kubernetes-asyncio without its generated classes (`agent.kube.credentials`).

The import checks run in a fresh interpreter: the test process may have imported
kubernetes_asyncio fully already. `CHECK` is also the script to run by hand against another
kubernetes-asyncio release (``PYTHONPATH=<release dir>:. python -c "$CHECK" KUBECONFIG``): the
supported range (pyproject: >=31) was checked with 31.1.0, 33.3.0 and 36.1.0.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from agent.core.errors import ConfigError
from agent.kube.credentials import load_credentials

REPO = Path(__file__).resolve().parents[2]

CHECK = """
import asyncio, json, sys
from agent.kube.credentials import load_credentials
cfg = asyncio.run(load_credentials("kubeconfig", sys.argv[1]))
def await_(value):  # auth_settings is a coroutine from kubernetes-asyncio 32 on
    return asyncio.run(value) if asyncio.iscoroutine(value) else value
out = {
    "host": cfg.host,
    "auth": (await_(cfg.auth_settings())).get("BearerToken", {}).get("value"),
    "models_after_load": "kubernetes_asyncio.client.models" in sys.modules,
    "apis_after_load": "kubernetes_asyncio.client.api" in sys.modules,
}
# Everything else of the package still works, loaded on first use.
import kubernetes_asyncio
from kubernetes_asyncio import client, watch
out["version"] = kubernetes_asyncio.__version__
out["pod"] = client.V1Pod.__name__
out["same_configuration"] = client.Configuration is type(cfg)
async def api_client():
    from kubernetes_asyncio.config import new_client_from_config
    api = await new_client_from_config(sys.argv[1])  # the loader's own ApiClient, loaded on call
    await api.close()
    return type(api).__name__
out["api_client"] = asyncio.run(api_client())
out["watch"] = watch.Watch.__name__
from kubernetes_asyncio.config import kube_config  # its OIDC refresh: the library's own
out["oidc_refresh"] = type(kube_config.OpenIDRequestor("id", "secret", "https://issuer")).__name__
import kubernetes_asyncio.config.openid as openid
from kubernetes_asyncio.config.openid import OpenIDRequestor
out["openid"] = [OpenIDRequestor.__name__, openid.OpenIDRequestor is OpenIDRequestor]
print(json.dumps(out))
"""


def write_kubeconfig(path: Path, token: str = "t0ken") -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "c", "cluster": {"server": "https://10.0.0.1:6443", "insecure-skip-tls-verify": True}}
        ],
        "users": [{"name": "u", "user": {"token": token}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    path.write_text(yaml.safe_dump(config))
    return path


def test_kubeconfig_loads_without_the_generated_classes(tmp_path: Path) -> None:
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig")
    result = subprocess.run(
        [sys.executable, "-c", CHECK, str(kubeconfig)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["host"] == "https://10.0.0.1:6443"
    assert out["auth"] == "Bearer t0ken"
    assert out["models_after_load"] is False and out["apis_after_load"] is False
    assert out["openid"] == ["OpenIDRequestor", True] and out["oidc_refresh"] == "OpenIDRequestor"
    assert out["pod"] == "V1Pod" and out["api_client"] == "ApiClient" and out["watch"] == "Watch"
    assert out["same_configuration"] is True
    assert out["version"]


async def test_loads_in_this_process_too(tmp_path: Path) -> None:
    """Whether or not kubernetes_asyncio was imported before (then the shim stands aside)."""
    cfg = await load_credentials("kubeconfig", write_kubeconfig(tmp_path / "kubeconfig", "abc"))
    assert cfg.host == "https://10.0.0.1:6443"
    assert cfg.api_key["BearerToken"].endswith("abc")


async def test_missing_kubeconfig_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"'{tmp_path / 'nope'}' for --kubeconfig: expected an existing"):
        await load_credentials("kubeconfig", tmp_path / "nope")
