"""Kubernetes credentials through kubernetes-asyncio, without importing its API and model classes.

kubernetes-asyncio loads the kubeconfig and the in-cluster service account and refreshes tokens
(exec plugins, rotated service-account tokens) for us, but its package ``__init__`` files import
every generated API and model class: ``import kubernetes_asyncio.config`` alone costs about 35 MB
of resident memory and 0.4 s of start-up, for ~700 classes the agent never uses (its requests
are raw JSON, see `agent.kube.client`).

`lazy_kubernetes_asyncio` therefore registers the ``kubernetes_asyncio`` and
``kubernetes_asyncio.client`` packages as package modules whose ``__init__`` has not run yet;
their submodules (``config``, ``client.configuration``...) import normally, and any other
attribute (``client.V1Pod``) runs the real ``__init__`` on first use, so code that needs the
generated classes (the tests, the emulator's tools) still gets them. ``client.ApiClient``
(imported by the kubeconfig loader, used only by ``new_client_from_config``) is, for that module
alone, a stand-in that loads the real class when called. Everything else is the library's own:
the kubeconfig and in-cluster loaders, exec plugins, the OIDC refresh (on aiohttp, which the
agent's client uses too). This relies on the layout of kubernetes-asyncio 31 to 36
(``config.kube_config`` and ``config.incluster_config`` import ``Configuration``/``ApiClient``
from ``kubernetes_asyncio.client``); ``tests/kube/test_credentials.py`` checks it against the
installed version (31.1.0, 33.3.0 and 36.1.0 were checked). Should a later release break it, the
agent falls back to the full import: it still works, at the old cost.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio.to_thread

from agent.core.boundedfile import MIB, BoundedFileError, load_yaml
from agent.core.errors import ConfigError, KubeApiError
from agent.core.logs import log_fields

log = logging.getLogger("agent.kube.credentials")

MAX_KUBECONFIG_BYTES = 16 * MIB
"""Far above a kubeconfig with many clusters and embedded certificates."""
_ROOT = "kubernetes_asyncio"
_CLIENT = f"{_ROOT}.client"


def _deferred_module(name: str, attribute: Any) -> ModuleType:
    """A module for a package's ``__init__`` whose code runs only when `attribute` cannot answer."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ImportError(f"{name} is not installed")
    module = importlib.util.module_from_spec(spec)
    loader = spec.loader

    def load(attr: str) -> Any:
        if not module.__dict__.get("__dra_agent_loaded__"):
            module.__dra_agent_loaded__ = True  # type: ignore[attr-defined]
            loader.exec_module(module)
        try:
            return module.__dict__[attr]
        except KeyError:
            raise AttributeError(f"module {name!r} has no attribute {attr!r}") from None

    def __getattr__(attr: str) -> Any:  # the PEP 562 module hook
        value = attribute(attr)
        if value is not None:
            return value
        if not attr.startswith("__") and importlib.util.find_spec(f"{name}.{attr}") is not None:
            return importlib.import_module(f"{name}.{attr}")  # a submodule: no need for __init__
        return load(attr)

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    module.__dra_agent_load__ = load  # type: ignore[attr-defined]
    return module


def lazy_kubernetes_asyncio() -> None:
    """Register the deferred packages and import the credential loaders through them.

    Nothing to do when kubernetes_asyncio is imported already (it then costs nothing more).
    """
    if _ROOT in sys.modules:
        return
    root = _deferred_module(_ROOT, lambda attr: None)
    sys.modules[_ROOT] = root
    loading_config = True

    def api_client_on_call(*args: Any, **kwargs: Any) -> Any:
        return client.__dra_agent_load__("ApiClient")(*args, **kwargs)

    def client_attribute(attr: str) -> Any:
        if attr == "Configuration":
            return importlib.import_module(f"{_CLIENT}.configuration").Configuration
        # Only the kubeconfig loader gets the stand-in; others (subclasses) need the real class.
        return api_client_on_call if attr == "ApiClient" and loading_config else None

    try:
        client = _deferred_module(_CLIENT, client_attribute)
        sys.modules[_CLIENT] = client
        importlib.import_module(f"{_ROOT}.config")
    except Exception as error:
        # A kubernetes-asyncio laid out differently: forget the partial import, pay for the full one.
        for name in [m for m in sys.modules if m == _ROOT or m.startswith(f"{_ROOT}.")]:
            del sys.modules[name]
        log.debug("kubernetes-asyncio imported in full", extra=log_fields(reason=repr(error)))
    finally:
        loading_config = False


def check_kubeconfig(kubeconfig: Path | str | None) -> None:
    """Refuse, before anything starts, a kubeconfig the client could not load (blocking).

    Each file the library would read (``KUBECONFIG`` may join several with ``:``, default
    ``~/.kube/config``) must be bounded UTF-8 YAML holding a mapping, at least one must exist, and
    merged as the library merges them (the first file that sets a name wins) they must name a
    current context whose cluster has a server and whose user is defined. Raises `ConfigError`
    (one line, exit 2) naming the file and what is missing.
    """
    names = [
        n for n in str(kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config").split(os.pathsep) if n
    ]
    shown = os.pathsep.join(names)
    merged: dict[str, Any] = {"current-context": None, "contexts": {}, "clusters": {}, "users": {}}
    found = False
    for name in names:
        path = Path(name).expanduser()
        if not path.exists():
            continue
        found = True
        try:
            data = load_yaml(path, max_bytes=MAX_KUBECONFIG_BYTES, what="kubeconfig YAML file")
        except BoundedFileError as error:
            raise ConfigError("--kubeconfig", name, error.detail) from None
        if data is None:
            continue
        if not isinstance(data, dict):
            raise ConfigError(
                "--kubeconfig", name, "a kubeconfig YAML file: a mapping of clusters, users, contexts"
            )
        if merged["current-context"] is None and data.get("current-context"):
            merged["current-context"] = str(data["current-context"])
        for section in ("contexts", "clusters", "users"):
            entries = data.get(section) or []
            if not isinstance(entries, list):
                raise ConfigError("--kubeconfig", name, f"a kubeconfig whose {section} is a list")
            for entry in entries:
                if isinstance(entry, dict) and isinstance(entry.get("name"), str):
                    merged[section].setdefault(entry["name"], entry.get(section[:-1]) or {})
    if not found:
        raise ConfigError(
            "--kubeconfig", shown, "an existing kubeconfig file (or --kube in-cluster in a Pod)"
        )
    context_name = merged["current-context"]
    if not context_name:
        raise ConfigError("--kubeconfig", shown, "a kubeconfig with a current-context")
    context = merged["contexts"].get(context_name)
    if not isinstance(context, dict):
        raise ConfigError(
            "--kubeconfig", shown, f"a kubeconfig defining its current context {context_name!r}"
        )
    cluster = merged["clusters"].get(context.get("cluster"))
    if not isinstance(cluster, dict) or not cluster.get("server"):
        raise ConfigError(
            "--kubeconfig",
            shown,
            f"a kubeconfig whose context {context_name!r} names a cluster with a server "
            f"(cluster {context.get('cluster')!r} is missing or has no server)",
        )
    if context.get("user") is not None and context.get("user") not in merged["users"]:
        raise ConfigError(
            "--kubeconfig", shown, f"a kubeconfig defining the user {context.get('user')!r} of its context"
        )


SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
"""Where the kubelet mounts a Pod's service-account token and CA (client-go's in-cluster config)."""


def check_in_cluster(account_dir: Path = SERVICE_ACCOUNT_DIR) -> None:
    """Refuse ``--kube in-cluster`` outside a Pod, before anything starts (blocking): the service
    host and port variables and the token and CA files must be there (`ConfigError`, exit 2)."""
    missing = [v for v in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT") if not os.environ.get(v)]
    missing += [str(account_dir / f) for f in ("token", "ca.crt") if not (account_dir / f).is_file()]
    if missing:
        raise ConfigError(
            "--kube",
            "in-cluster",
            f"a Pod with a service account ({', '.join(missing)} missing); outside a cluster use "
            "--kube kubeconfig --kubeconfig FILE",
        )


def in_cluster(mode: str, kubeconfig: Path | str | None) -> bool:
    """Whether `load_credentials` uses the service account (else the kubeconfig file)."""
    return mode == "in-cluster" or (
        mode == "auto" and kubeconfig is None and bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
    )


async def load_credentials(mode: str = "auto", kubeconfig: Path | str | None = None) -> Any:
    """A kubernetes-asyncio ``Configuration`` from the service account or a kubeconfig file.

    `mode` is ``in-cluster``, ``kubeconfig`` or ``auto`` (in-cluster inside a Pod unless a
    kubeconfig is given). Raises `KubeApiError` saying what to set when nothing can be loaded.
    """
    # Importing the loaders takes ~40 ms (urllib3, yaml): not on the event loop, which serves the kubelet.
    await anyio.to_thread.run_sync(lazy_kubernetes_asyncio)
    from kubernetes_asyncio import config
    from kubernetes_asyncio.client.configuration import Configuration

    cfg = Configuration()
    in_pod = in_cluster(mode, kubeconfig)
    try:
        if in_pod:
            config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
        else:
            await anyio.to_thread.run_sync(check_kubeconfig, kubeconfig)
            await config.load_kube_config(
                config_file=str(kubeconfig) if kubeconfig else None, client_configuration=cfg
            )
    except (config.ConfigException, OSError) as error:
        where = "in-cluster service account" if in_pod else f"kubeconfig {kubeconfig or '~/.kube/config'}"
        raise KubeApiError(
            f"cannot load Kubernetes credentials from the {where}: {error} "
            "(set --kube and --kubeconfig, or run inside a Pod with a service account)"
        ) from error
    return cfg
