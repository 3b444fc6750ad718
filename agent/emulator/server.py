"""The HTTP front end (aiohttp) and `KubeApiEmulator`, the object tests and demos use."""

from __future__ import annotations

import asyncio
import base64
import binascii
import builtins
import contextlib
import json
import logging
import socket
import struct
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import yaml
from aiohttp import web

from agent.emulator import authz
from agent.emulator.errors import ApiError, bad_request, gone
from agent.emulator.faults import Faults
from agent.emulator.patch import APPLY
from agent.emulator.registry import Registry, check_gate, rfc3339, store_key
from agent.emulator.requestlog import RequestLog
from agent.emulator.resources import (
    EVENTS_GROUP,
    RESOURCE_GROUP,
    SUPPORTED_RELEASES,
    ResourceType,
    field_value,
    git_version,
)
from agent.emulator.schema import parse_json
from agent.emulator.selectors import matcher
from agent.emulator.store import Store

JSON = dict[str, Any]
log = logging.getLogger("agent.emulator")

_WRITE_VERBS = frozenset({"create", "update", "patch", "delete", "deletecollection"})
_GROUPS = ("", EVENTS_GROUP, RESOURCE_GROUP)
_TABLE_COLUMNS: Mapping[str, tuple[tuple[str, str], ...]] = {
    "resourceslices": (("Node", "spec.nodeName"), ("Driver", "spec.driver"), ("Pool", "spec.pool.name")),
    "nodes": (("Status", ""),),
    "events": (("Type", "type"), ("Reason", "reason"), ("Message", "message")),
    "namespaces": (("Status", "status.phase"),),
}


def _json(body: object, status: int = 200, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(
        status=status, text=json.dumps(body), content_type="application/json", headers=dict(headers or {})
    )


def _error_response(error: ApiError) -> web.Response:
    headers = {}
    if error.code == 429:
        headers["Retry-After"] = str(error.details.get("retryAfterSeconds", 1))
    return _json(error.status(), error.code, headers)


class KubeApiEmulator:
    """A strict, in-process Kubernetes API server for tests and demos (see the package docstring).

    Use as ``async with KubeApiEmulator(version="1.34") as emu``; direct methods (`create`, `get`, ...)
    have the same semantics as HTTP calls (validation, resourceVersions, watch events) but are not
    counted in `writes` and do not see faults.
    """

    def __init__(
        self,
        version: str = "1.34",
        feature_gates: Mapping[str, bool] | None = None,
        *,
        dra: bool = True,
        host: str = "127.0.0.1",
        port: int = 0,
        bookmark_interval: float = 1.0,
        history: int = 100_000,
        now: Callable[[], float] = time.time,
    ) -> None:
        if version == "none":
            version, dra = "1.34", False
        if version not in SUPPORTED_RELEASES:
            raise ValueError(
                f"unsupported Kubernetes version {version!r}: "
                f"use one of {', '.join(SUPPORTED_RELEASES)} or 'none'"
            )
        self.version = version
        self.store = Store(history=history)
        self.registry = Registry(self.store, version, dra, feature_gates or {}, now)
        self.faults = Faults()
        self.faults._on_outage = self._set_outage
        self.faults._on_drop_watches = self._drop_watches
        self.writes: Counter[tuple[str, str]] = Counter()
        self.requests: Counter[tuple[str, str]] = Counter()
        self.request_log = RequestLog()
        """Every request answered, with its time and client (`agent.emulator.requestlog`)."""
        self.identities: dict[str, authz.Identity] = {}
        """Bearer token -> who it authenticates (`agent.emulator.authz`); other requests are the admin."""
        self._host = host
        self._port = port
        self._bookmark_interval = bookmark_interval
        self._now = now
        self._drop_generation = 0
        self._runner: web.AppRunner | None = None
        self._server: asyncio.AbstractServer | None = None
        self._closing = False

    # ----- lifecycle
    # No task group is held between __aenter__ and __aexit__: test fixtures may run them in
    # different tasks. Garbage collection therefore runs synchronously after each write.
    async def __aenter__(self) -> KubeApiEmulator:
        app = web.Application(middlewares=[self._middleware], client_max_size=16 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        # Requests still held (a slow-fault test) get 2 s at exit, not aiohttp's default 60 s.
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=2.0)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self._host, self._port))
        sock.listen(128)
        sock.setblocking(False)
        self._port = sock.getsockname()[1]
        self._server = await asyncio.get_running_loop().create_server(self._protocol, sock=sock)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._closing = True
        self._drop_watches()
        if self._server is not None:
            self._server.close()
        if self._runner is not None:
            await self._runner.shutdown()
            await self._runner.cleanup()

    def _protocol(self) -> asyncio.BaseProtocol:
        # During an outage every new connection is reset as soon as it is accepted.
        if self.faults.down:
            return _ResetProtocol()
        assert self._runner is not None and self._runner.server is not None
        return self._runner.server()

    def _set_outage(self, down: bool) -> None:
        if not down:
            return
        self._drop_watches()
        server = self._runner.server if self._runner is not None else None
        for handler in list(server.connections) if server is not None else []:
            transport = handler.transport
            if transport is not None:
                transport.abort()

    # ----- connection details
    @property
    def port(self) -> int:
        """The TCP port served."""
        return self._port

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://{self._host}:{self._port}"

    def configuration(self) -> Any:
        """A kubernetes_asyncio ``Configuration`` pointing at the emulator."""
        from kubernetes_asyncio.client import Configuration

        config = Configuration(host=self.url)
        config.verify_ssl = False
        return config

    def add_identity(self, token: str, identity: authz.Identity) -> None:
        """Authenticate requests bearing `token` as `identity`, held to its rules (`agent.emulator.authz`)."""
        self.identities[token] = identity

    def write_kubeconfig(self, path: str | Path, token: str = "") -> Path:
        """Write a kubeconfig for the emulator (for kubectl and load_kube_config); returns its path.

        With `token`, requests carry it as a bearer token (see `add_identity`)."""
        target = Path(path)
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "emulator", "user": {"token": token} if token else {}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "emulator"}}],
            "current-context": "emulator",
        }
        target.write_text(yaml.safe_dump(config))
        return target

    # ----- direct access (same semantics as HTTP, internal v1 shape)
    def _type(self, resource: str) -> ResourceType:
        for group in _GROUPS:
            try:
                return self.registry.type_for(group, resource)
            except ApiError:
                continue
        raise ValueError(f"unknown resource {resource!r}")

    def _ns(self, rtype: ResourceType, namespace: str | None) -> str:
        if rtype.namespaced:
            return namespace or "default"
        return ""

    def get(self, resource: str, name: str, namespace: str | None = None) -> JSON | None:
        """The stored object (v1 shape), or None."""
        rtype = self._type(resource)
        try:
            return self.registry.get(rtype, rtype.storage_version, self._ns(rtype, namespace), name)
        except ApiError as error:
            if error.code == 404:
                return None
            raise

    def list(
        self,
        resource: str,
        namespace: str | None = None,
        field_selector: str | None = None,
        label_selector: str | None = None,
    ) -> builtins.list[JSON]:
        """Stored objects (v1 shape) matching the selectors; all namespaces unless one is given."""
        rtype = self._type(resource)
        items, _ = self.registry.list(
            rtype,
            rtype.storage_version,
            namespace=namespace or "",
            field_selector=field_selector,
            label_selector=label_selector,
        )
        return items

    def create(self, resource: str, obj: JSON, namespace: str | None = None) -> JSON:
        """Create an object (v1 shape); raises `ApiError` as the HTTP API would answer."""
        rtype = self._type(resource)
        return self.registry.create(rtype, rtype.storage_version, obj, namespace=self._ns(rtype, namespace))

    def update(self, resource: str, obj: JSON, namespace: str | None = None, subresource: str = "") -> JSON:
        """Replace an object (v1 shape; ``subresource="status"`` for status)."""
        rtype = self._type(resource)
        name = obj.get("metadata", {}).get("name", "")
        ns = self._ns(rtype, namespace or obj.get("metadata", {}).get("namespace"))
        return self.registry.update(
            rtype, rtype.storage_version, name, obj, namespace=ns, subresource=subresource
        )

    def patch(
        self,
        resource: str,
        name: str,
        body: Any,
        *,
        namespace: str | None = None,
        content_type: str = "application/merge-patch+json",
        subresource: str = "",
    ) -> JSON:
        """Patch an object (merge patch by default)."""
        rtype = self._type(resource)
        return self.registry.patch(
            rtype,
            rtype.storage_version,
            name,
            content_type,
            body,
            namespace=self._ns(rtype, namespace),
            subresource=subresource,
        )

    def delete(self, resource: str, name: str, namespace: str | None = None) -> JSON:
        """Delete an object; raises `ApiError` 404 when absent."""
        rtype = self._type(resource)
        return self.registry.delete(rtype, rtype.storage_version, name, namespace=self._ns(rtype, namespace))

    def delete_collection(
        self,
        resource: str,
        namespace: str | None = None,
        field_selector: str | None = None,
        label_selector: str | None = None,
    ) -> builtins.list[JSON]:
        """Delete every matching object; returns them."""
        rtype = self._type(resource)
        return self.registry.delete_collection(
            rtype,
            rtype.storage_version,
            namespace=namespace or "",
            field_selector=field_selector,
            label_selector=label_selector,
        )

    def add_node(self, name: str, labels: Mapping[str, str] | None = None) -> str:
        """Create a Ready core/v1 Node; returns its uid."""
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}},
            "spec": {},
            "status": {
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "KubeletReady",
                        "message": "kubelet is posting ready status",
                        "lastHeartbeatTime": rfc3339(self._now()),
                        "lastTransitionTime": rfc3339(self._now()),
                    }
                ],
                "nodeInfo": {
                    "architecture": "amd64",
                    "bootID": "00000000-0000-0000-0000-000000000000",
                    "containerRuntimeVersion": "containerd://2.0.0",
                    "kernelVersion": "6.8.0",
                    "kubeProxyVersion": git_version(self.version),
                    "kubeletVersion": git_version(self.version),
                    "machineID": "emulated",
                    "operatingSystem": "linux",
                    "osImage": "Emulated Linux",
                    "systemUUID": "00000000-0000-0000-0000-000000000000",
                },
            },
        }
        return str(self.create("nodes", node)["metadata"]["uid"])

    def set_feature_gate(self, name: str, enabled: bool) -> None:
        """Turn a simulated feature gate on or off (takes effect on the next request); a gate the
        release locks to its default raises ValueError."""
        check_gate(self.version, name, enabled)
        self.registry.gates[name] = enabled

    @property
    def feature_gates(self) -> dict[str, bool]:
        """The simulated gates and their state."""
        return dict(self.registry.gates)

    def reset_writes(self) -> None:
        """Zero the write counter."""
        self.writes.clear()

    def compact(self) -> None:
        """Forget history: watches and lists from older resourceVersions get 410 Gone."""
        self.store.compact()

    def collect_garbage(self) -> int:
        """Run one garbage-collector pass now; returns how many objects it deleted."""
        return self.registry.collect_garbage()

    def _drop_watches(self) -> None:
        self._drop_generation += 1
        self.store.notify()

    # ----- HTTP
    @web.middleware
    async def _middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if self.faults.down:
            if request.transport is not None:
                request.transport.abort()  # connection reset, as a dead apiserver behind a proxy
            raise web.HTTPServiceUnavailable()
        self.request_log.record(request.method, request.path, request.query, request.headers)
        if self.faults.latency > 0:
            await anyio.sleep(self.faults.latency)
        try:
            return await handler(request)
        except ApiError as error:
            return _error_response(error)
        except web.HTTPException:
            raise
        except Exception as error:
            # A bug here must still answer like an apiserver would, and be visible in the log.
            log.exception("emulator request failed", extra={"fields": {"path": request.path}})
            return _error_response(ApiError(500, f"emulator internal error: {type(error).__name__}: {error}"))

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        parts = [p for p in request.path.split("/") if p]
        if not parts:
            return _json({"paths": ["/api", "/api/v1", "/apis", "/version"]})
        if parts == ["version"]:
            return _json(self._version_info())
        if parts[0] == "api":
            if len(parts) == 1:
                return _json(
                    {
                        "kind": "APIVersions",
                        "versions": ["v1"],
                        "serverAddressByClientCIDRs": [
                            {"clientCIDR": "0.0.0.0/0", "serverAddress": f"{self._host}:{self._port}"}
                        ],
                    }
                )
            if parts[1] != "v1":
                raise self._no_route(request)
            group, version, rest = "", "v1", parts[2:]
        elif parts[0] == "apis":
            if len(parts) == 1:
                return _json(
                    {
                        "kind": "APIGroupList",
                        "apiVersion": "v1",
                        "groups": [self._group(g) for g in self._groups()],
                    }
                )
            group = parts[1]
            if group not in self._groups():
                raise self._no_route(request)
            if len(parts) == 2:
                return _json(self._group(group))
            version, rest = parts[2], parts[3:]
            if version not in self.registry.served_versions(group):
                raise self._no_route(request)
        else:
            raise self._no_route(request)
        if not rest:
            return _json(self._resource_list(group, version))
        return await self._resource_request(request, group, version, rest)

    def _no_route(self, request: web.Request) -> ApiError:
        return ApiError(404, "the server could not find the requested resource", details={})

    def _version_info(self) -> JSON:
        major, minor = self.version.split(".")
        return {
            "major": major,
            "minor": minor,
            "gitVersion": git_version(self.version),
            "gitCommit": "0000000000000000000000000000000000000000",
            "gitTreeState": "clean",
            "buildDate": "2026-01-01T00:00:00Z",
            "goVersion": "go1.24.0",
            "compiler": "gc",
            "platform": "linux/amd64",
        }

    def _groups(self) -> builtins.list[str]:
        return [g for g in _GROUPS if g and self.registry.served_versions(g)]

    def _group(self, group: str) -> JSON:
        versions = [
            {"groupVersion": f"{group}/{v}", "version": v} for v in self.registry.served_versions(group)
        ]
        return {
            "kind": "APIGroup",
            "apiVersion": "v1",
            "name": group,
            "versions": versions,
            "preferredVersion": versions[0],
        }

    def _resource_list(self, group: str, version: str) -> JSON:
        resources: builtins.list[JSON] = []
        for rtype in self.registry.served_types(group, version):
            entry: JSON = {
                "name": rtype.plural,
                "singularName": rtype.singular,
                "namespaced": rtype.namespaced,
                "kind": rtype.kind,
                "verbs": ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"],
            }
            if rtype.short_names:
                entry["shortNames"] = list(rtype.short_names)
            resources.append(entry)
            if rtype.has_status:
                resources.append(
                    {
                        "name": f"{rtype.plural}/status",
                        "singularName": "",
                        "namespaced": rtype.namespaced,
                        "kind": rtype.kind,
                        "verbs": ["get", "patch", "update"],
                    }
                )
        gv = f"{group}/{version}" if group else version
        return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources}

    async def _resource_request(
        self, request: web.Request, group: str, version: str, rest: builtins.list[str]
    ) -> web.StreamResponse:
        namespace = ""
        if rest[0] == "namespaces" and len(rest) >= 3 and rest[2] not in ("status", "finalize"):
            namespace, rest = rest[1], rest[2:]
        plural = rest[0]
        name = rest[1] if len(rest) > 1 else ""
        subresource = rest[2] if len(rest) > 2 else ""
        rtype = self.registry.serving(group, version, plural)
        if rtype is None or len(rest) > 3 or (namespace and not rtype.namespaced):
            raise self._no_route(request)
        if subresource and (subresource != "status" or not rtype.has_status):
            raise self._no_route(request)
        query = request.query
        method = request.method
        if method == "GET":
            verb = "get" if name else ("watch" if _flag(query.get("watch")) else "list")
        elif method == "POST" and not name:
            verb = "create"
        elif method == "PUT" and name:
            verb = "update"
        elif method == "PATCH" and name:
            verb = "patch"
        elif method == "DELETE":
            verb = "delete" if name else "deletecollection"
        else:
            raise ApiError(405, "the server does not allow this method on the requested resource")
        label = f"{plural}/{subresource}" if subresource else plural
        self.requests[(verb, label)] += 1
        if verb in _WRITE_VERBS and not query.getall("dryRun", []):
            self.writes[(verb, label)] += 1  # a dry run stores nothing: not a write
        slow = self.faults.slow.get(label, 0.0) or self.faults.slow.get(plural, 0.0)
        if slow > 0:
            await anyio.sleep(slow)
        injected = self.faults.take(verb, label)
        if injected is not None:
            raise injected
        identity = self.identities.get(authz.token_of(request.headers))
        if identity is not None:
            authz.check(identity, verb, label, group=group, namespace=namespace, name=name)
        if verb == "watch":
            return await self._watch(request, rtype, version, namespace)
        mode = query.get("fieldValidation", "Warn") or "Warn"
        if mode not in ("Strict", "Warn", "Ignore"):
            raise bad_request(
                f"fieldValidation parameter unsupported: {mode}. Supported values are: Ignore, Warn, Strict"
            )
        dry_run = _dry_run(verb, query.getall("dryRun", []))
        _check_options(verb, query, _media(request) == APPLY)
        body, duplicates = await self._body(request, required=verb in ("create", "update", "patch"))
        call = _Call(rtype, version, verb, namespace, name, subresource, dry_run, body)
        # The registry is synchronous: no other request runs between setting the mode and reading warnings.
        self.registry.field_validation = mode
        self.registry.warnings = []
        self.registry.duplicate_fields = duplicates
        self.registry.requester = (identity, verb) if identity is not None else None
        try:
            response = self._call(request, call)
        finally:
            warnings, self.registry.warnings = self.registry.warnings, []
            self.registry.field_validation = "Warn"
            self.registry.duplicate_fields = []
            self.registry.requester = None
        if warnings:
            response.headers["Warning"] = ", ".join(_warning(w) for w in warnings)
        return response

    def _call(self, request: web.Request, call: _Call) -> web.Response:
        query = request.query
        rtype, version, namespace, name = call.rtype, call.version, call.namespace, call.name
        if call.verb == "get":
            return _json(self.registry.get(rtype, version, namespace, name))
        if call.verb == "list":
            return self._list(request, rtype, version, namespace)
        if call.verb == "deletecollection":
            items = self.registry.delete_collection(
                rtype,
                version,
                namespace=namespace,
                field_selector=query.get("fieldSelector"),
                label_selector=query.get("labelSelector"),
                dry_run=call.dry_run,
            )
            return _json(self._list_body(rtype, version, items))
        if call.verb == "create":
            created = self.registry.create(
                rtype,
                version,
                call.body,
                namespace=namespace,
                dry_run=call.dry_run,
                manager=_manager(request),
            )
            return _json(created, 201)
        if call.verb == "update":
            return _json(
                self.registry.update(
                    rtype,
                    version,
                    name,
                    call.body,
                    namespace=namespace,
                    subresource=call.subresource,
                    dry_run=call.dry_run,
                    manager=_manager(request),
                )
            )
        if call.verb == "patch" and _media(request) == APPLY:
            manager = query.get("fieldManager", "")
            applied, is_new = self.registry.apply(
                rtype,
                version,
                name,
                call.body,
                manager=manager,
                force=_flag(query.get("force")),
                namespace=namespace,
                subresource=call.subresource,
                dry_run=call.dry_run,
            )
            return _json(applied, 201 if is_new else 200)
        if call.verb == "patch":
            return _json(
                self.registry.patch(
                    rtype,
                    version,
                    name,
                    request.headers.get("Content-Type", ""),
                    call.body,
                    namespace=namespace,
                    subresource=call.subresource,
                    dry_run=call.dry_run,
                    manager=_manager(request),
                )
            )
        preconditions = call.body.get("preconditions") if isinstance(call.body, dict) else None
        return _json(
            self.registry.delete(
                rtype, version, name, namespace=namespace, preconditions=preconditions, dry_run=call.dry_run
            )
        )

    async def _body(self, request: web.Request, required: bool) -> tuple[Any, builtins.list[str]]:
        """The decoded body and the keys it repeats (apply configurations are YAML)."""
        raw = await request.read()
        if not raw:
            if required:
                raise bad_request("the body of the request is empty")
            return None, []
        try:
            if _media(request) == APPLY:
                return yaml.safe_load(raw), []
            return parse_json(raw)
        except (ValueError, yaml.YAMLError) as error:
            raise bad_request(f"the body of the request was in an unknown format: {error}") from None

    def _list_body(
        self, rtype: ResourceType, version: str, items: builtins.list[JSON], rv: int | None = None
    ) -> JSON:
        for item in items:
            # The apiserver does not repeat kind/apiVersion inside list items of built-in types.
            item.pop("kind", None)
            item.pop("apiVersion", None)
        meta: JSON = {"resourceVersion": str(rv if rv is not None else self.store.revision)}
        return {
            "kind": f"{rtype.kind}List",
            "apiVersion": rtype.api_version(version),
            "metadata": meta,
            "items": items,
        }

    def _list(self, request: web.Request, rtype: ResourceType, version: str, namespace: str) -> web.Response:
        query = request.query
        rv = query.get("resourceVersion", "")
        match_mode = query.get("resourceVersionMatch", "")
        if match_mode and not rv:
            raise bad_request("resourceVersionMatch is forbidden unless resourceVersion is provided")
        if match_mode and match_mode not in ("Exact", "NotOlderThan"):
            raise bad_request(f'resourceVersionMatch: Unsupported value: "{match_mode}"')
        if rv:
            # NotOlderThan (the default for a non-zero RV) is satisfied by the current state, however old
            # rv is; only Exact needs history, and history here is only the current revision.
            try:
                wanted = int(rv)
            except ValueError:
                raise bad_request(f"invalid resource version {rv!r}") from None
            if wanted > self.store.revision:
                raise ApiError(
                    504,
                    f"Too large resource version: {wanted}, current: {self.store.revision}",
                    reason="Timeout",
                    details={
                        "causes": [
                            {"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}
                        ]
                    },
                )
            if match_mode == "Exact" and wanted != self.store.revision:
                raise gone(f"too old resource version: {wanted} ({self.store.compacted})")
        items, revision = self.registry.list(
            rtype, version, namespace, query.get("fieldSelector"), query.get("labelSelector")
        )
        start = self._continue_from(query.get("continue", ""))
        if start:
            items = [i for i in items if _item_key(i) > start]
        limit = int(query.get("limit", "0") or 0)
        token = ""
        if limit > 0 and len(items) > limit:
            items = items[:limit]
            token = base64.urlsafe_b64encode(
                json.dumps({"rv": revision, "start": list(_item_key(items[-1]))}).encode()
            ).decode()
        if _wants_table(request):
            return _json(self._table(rtype, items, revision, token))
        body = self._list_body(rtype, version, items, revision)
        if token:
            body["metadata"]["continue"] = token
            body["metadata"]["remainingItemCount"] = None
            body["metadata"].pop("remainingItemCount")
        return _json(body)

    def _continue_from(self, token: str) -> tuple[str, str] | None:
        if not token:
            return None
        try:
            decoded = json.loads(base64.urlsafe_b64decode(token.encode()))
            rv, start = int(decoded["rv"]), decoded["start"]
        except (ValueError, KeyError, TypeError, binascii.Error):
            raise bad_request("continue key is not valid: invalid continue token") from None
        if rv < self.store.compacted:
            raise gone(
                "The provided continue parameter is too old to display a consistent list result. "
                "You can start a new list without the continue parameter."
            )
        return (str(start[0]), str(start[1]))

    def _table(self, rtype: ResourceType, items: builtins.list[JSON], revision: int, token: str) -> JSON:
        extra = _TABLE_COLUMNS.get(rtype.plural, ())
        columns = [{"name": "Name", "type": "string", "format": "name", "description": "Name", "priority": 0}]
        columns += [
            {"name": n, "type": "string", "format": "", "description": n, "priority": 0} for n, _ in extra
        ]
        columns.append({"name": "Age", "type": "string", "format": "", "description": "Age", "priority": 0})
        rows = []
        for item in items:
            meta = item["metadata"]
            cells: builtins.list[Any] = [meta["name"]]
            for column, path in extra:
                if rtype.plural == "nodes" and column == "Status":
                    ready = [
                        c
                        for c in (item.get("status") or {}).get("conditions", [])
                        if c.get("type") == "Ready"
                    ]
                    cells.append("Ready" if ready and ready[0].get("status") == "True" else "NotReady")
                else:
                    cells.append(field_value(item, path) or "<none>")
            cells.append(_age(meta.get("creationTimestamp", ""), self._now()))
            rows.append(
                {
                    "cells": cells,
                    "object": {
                        "kind": "PartialObjectMetadata",
                        "apiVersion": "meta.k8s.io/v1",
                        "metadata": meta,
                    },
                }
            )
        meta_out: JSON = {"resourceVersion": str(revision)}
        if token:
            meta_out["continue"] = token
        return {
            "kind": "Table",
            "apiVersion": "meta.k8s.io/v1",
            "metadata": meta_out,
            "columnDefinitions": columns,
            "rows": rows,
        }

    async def _watch(
        self, request: web.Request, rtype: ResourceType, version: str, namespace: str
    ) -> web.StreamResponse:
        query = request.query
        match = matcher(rtype, query.get("fieldSelector"), query.get("labelSelector"), self.version)
        bookmarks = _flag(query.get("allowWatchBookmarks"))
        initial = _flag(query.get("sendInitialEvents"))
        timeout = float(query.get("timeoutSeconds", "0") or 0) or 1800.0
        rv = query.get("resourceVersion", "")
        if initial and not (bookmarks and query.get("resourceVersionMatch") == "NotOlderThan"):
            raise bad_request(
                "sendInitialEvents requires allowWatchBookmarks=true and resourceVersionMatch=NotOlderThan"
            )
        generation = self._drop_generation
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)

        def visible(obj: JSON) -> bool:
            ns = obj["metadata"].get("namespace", "")
            return (not namespace or ns == namespace) and match(obj)

        async def send(kind: str, obj: JSON) -> None:
            await response.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")

        async def bookmark(position: int, annotations: Mapping[str, str] | None = None) -> None:
            meta: JSON = {"resourceVersion": str(position)}
            if annotations:
                meta["annotations"] = dict(annotations)
            await send(
                "BOOKMARK", {"kind": rtype.kind, "apiVersion": rtype.api_version(version), "metadata": meta}
            )

        try:
            if rv in ("", "0") or initial:
                position = self.store.revision
                start = self.registry.check_resource_version(rv) if rv not in ("", "0") else 0
                position = max(position, start)
                # Snapshot before the first await: later changes arrive as events after `position`.
                current = [obj for _, obj in self.store.items(store_key(rtype)) if visible(obj)]
                for obj in current:
                    await send("ADDED", _converted(rtype, version, obj))
                if initial:
                    await bookmark(position, {"k8s.io/initial-events-end": "true"})
            else:
                try:
                    position = self.registry.check_resource_version(rv)
                except ApiError as error:
                    await send("ERROR", error.status())
                    return response
            deadline = anyio.current_time() + timeout
            next_bookmark = anyio.current_time() + self._bookmark_interval
            while not self._closing:
                waiter = self.store.waiter()
                if generation != self._drop_generation or self.faults.down:
                    break
                if position < self.store.compacted:
                    await send(
                        "ERROR",
                        gone(f"too old resource version: {position} ({self.store.compacted})").status(),
                    )
                    break
                snapshot = self.store.revision
                pending = [e for e in self.registry.events_for(rtype, position) if e.rv <= snapshot]
                for event in pending:
                    kind = _transition(event.type, event.old, event.obj, visible)
                    if kind:
                        await send(kind, _converted(rtype, version, event.obj))
                position = snapshot
                now = anyio.current_time()
                if now >= deadline:
                    break
                if bookmarks and now >= next_bookmark:
                    await bookmark(position)
                    next_bookmark = now + self._bookmark_interval
                if self.store.revision != snapshot:
                    continue
                wait = min(deadline, next_bookmark if bookmarks else deadline) - now
                with anyio.move_on_after(max(wait, 0)):
                    await waiter.wait()
        except OSError:
            return response  # the client went away
        if self.faults.down and request.transport is not None:
            request.transport.abort()
            return response
        with contextlib.suppress(OSError):  # the client may have gone while we were ending the stream
            await response.write_eof()
        return response


def _converted(rtype: ResourceType, version: str, obj: JSON) -> JSON:
    from agent.emulator.conversion import from_internal

    return from_internal(rtype, version, obj)


def _transition(kind: str, old: JSON | None, new: JSON, visible: Callable[[JSON], bool]) -> str:
    """The event a filtered watch sees: objects entering or leaving the selector become ADDED/DELETED."""
    if kind == "ADDED":
        return "ADDED" if visible(new) else ""
    if kind == "DELETED":
        return "DELETED" if old is not None and visible(old) else ""
    was, now = old is not None and visible(old), visible(new)
    if was and now:
        return "MODIFIED"
    if now:
        return "ADDED"
    if was:
        return "DELETED"
    return ""


@dataclass(frozen=True)
class _Call:
    """One resource request, parsed."""

    rtype: ResourceType
    version: str
    verb: str
    namespace: str
    name: str
    subresource: str
    dry_run: bool
    body: Any


class _ResetProtocol(asyncio.Protocol):
    """Accepts a connection and resets it at once (an apiserver that is down behind its address)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            # SO_LINGER 0 makes close() send a TCP RST instead of FIN.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        if isinstance(transport, asyncio.Transport):
            transport.abort()
        else:
            transport.close()


def _warning(text: str) -> str:
    """An RFC 7234 warning value as the apiserver writes it (code 299, quoted, quotes escaped)."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return f'299 - "{escaped}"'


_OPTIONS_KIND = {
    "create": "CreateOptions",
    "update": "UpdateOptions",
    "patch": "PatchOptions",
    "delete": "DeleteOptions",
    "deletecollection": "DeleteOptions",
}


def _dry_run(verb: str, values: builtins.list[str]) -> bool:
    """``dryRun`` of a write: only ``All`` is supported (metav1 ``ValidateDryRun``), else 422."""
    if verb not in _OPTIONS_KIND:
        return False
    if any(v != "All" for v in values):
        shown = json.dumps(values, separators=(",", ":"))
        raise invalid_options(
            _OPTIONS_KIND[verb], "dryRun", f'Unsupported value: {shown}: supported values: "All"'
        )
    return bool(values)


_CAUSE_REASONS = {
    "Unsupported value": "FieldValueNotSupported",
    "Required value": "FieldValueRequired",
    "Forbidden": "FieldValueForbidden",
    "Too long": "FieldValueTooLong",
    "Invalid value": "FieldValueInvalid",
}


def invalid_options(kind: str, field: str, detail: str, *more: tuple[str, str]) -> ApiError:
    """422 for bad request options, as the apiserver words it (``CreateOptions.meta.k8s.io "" ...``);
    ``more`` adds further (field, detail) errors, listed in brackets as ``errors.NewInvalid`` does."""
    errors = [(field, detail), *more]
    listed = ", ".join(f"{f}: {d}" for f, d in errors)
    causes = [
        {"reason": _CAUSE_REASONS.get(d.split(":", 1)[0], "FieldValueInvalid"), "message": d, "field": f}
        for f, d in errors
    ]
    return ApiError(
        422,
        f'{kind}.meta.k8s.io "" is invalid: {listed if len(errors) == 1 else f"[{listed}]"}',
        details={"group": "meta.k8s.io", "kind": kind, "causes": causes},
    )


#: ``FieldManagerMaxLength`` of upstream ``apimachinery/pkg/apis/meta/v1/validation``.
FIELD_MANAGER_MAX = 128


def _check_options(verb: str, query: Mapping[str, str], apply: bool) -> None:
    """``ValidateCreateOptions``/``ValidateUpdateOptions``/``ValidatePatchOptions`` (meta/v1 validation):
    ``force`` only with apply, ``fieldManager`` at most 128 bytes of printable characters."""
    if verb not in ("create", "update", "patch"):
        return
    errors: builtins.list[tuple[str, str]] = []
    if verb == "patch" and not apply and "force" in query:
        errors.append(("force", "Forbidden: may not be specified for non-apply patch"))
    manager = query.get("fieldManager", "")
    if verb == "patch" and apply and not manager:
        errors.append(("fieldManager", "Required value: is required for apply patch"))
    if len(manager.encode()) > FIELD_MANAGER_MAX:
        errors.append(("fieldManager", f"Too long: may not be more than {FIELD_MANAGER_MAX} bytes"))
    for i, char in enumerate(manager):
        if not char.isprintable():
            shown = json.dumps(manager)
            errors.append(
                (
                    "fieldManager",
                    f"Invalid value: {shown}: invalid character U+{ord(char):04X} (at position {i})",
                )
            )
    if errors:
        raise invalid_options(_OPTIONS_KIND[verb], errors[0][0], errors[0][1], *errors[1:])


def _manager(request: web.Request) -> str:
    """``managerOrUserAgent`` (handlers/rest.go): fieldManager, else the user agent up to its first
    ``/`` (printable characters, at most 128 bytes)."""
    manager = request.query.get("fieldManager", "")
    if manager:
        return manager
    out = ""
    for char in request.headers.get("User-Agent", "").split("/", 1)[0]:
        if char.isprintable() and len((out + char).encode()) <= FIELD_MANAGER_MAX:
            out += char
        elif char.isprintable():
            break
    return out


def _media(request: web.Request) -> str:
    return request.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()


def _flag(value: str | None) -> bool:
    """A boolean query parameter (clients send ``true``, ``True`` or ``1``)."""
    return (value or "").lower() in ("true", "1")


def _item_key(item: JSON) -> tuple[str, str]:
    meta = item["metadata"]
    return (meta.get("namespace", ""), meta["name"])


def _wants_table(request: web.Request) -> bool:
    accept = request.headers.get("Accept", "")
    return accept.split(",", 1)[0].strip().startswith("application/json;as=Table")


def _age(created: str, now: float) -> str:
    try:
        then = datetime.strptime(created, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()
    except ValueError:
        return "<unknown>"
    seconds = max(0, int(now - then))
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h"
