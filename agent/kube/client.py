"""The agent's Kubernetes API client: discovery, ResourceSlices, claims, events.

Requests and answers are plain JSON dicts: the resource.k8s.io shapes differ between v1, v1beta2
and v1beta1 and typed models would only add churn (and ~700 classes of memory). kubernetes-asyncio
provides the ``Configuration`` (server, TLS files, token and its refresh, see
`agent.kube.credentials`); the requests go through one aiohttp session (`agent.kube.transport`):
one keep-alive connection pool for every call, at most `REQUEST_CONCURRENCY` requests in flight
(so at most that many connections besides one per open watch). Every request has a timeout;
every failure becomes `agent.core.errors.KubeApiError` with the HTTP status (0 when the API
server did not answer).
"""

from __future__ import annotations

import inspect
import json
import logging
import ssl
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from agent import __version__
from agent.core.errors import KubeApiError
from agent.core.logs import log_fields
from agent.health.taints import ClusterTaintSupport
from agent.kube.credentials import load_credentials
from agent.kube.transport import HttpClient, HttpError

log = logging.getLogger("agent.kube.client")

RESOURCE_GROUP = "resource.k8s.io"
SLICE_VERSIONS = ("v1", "v1beta2", "v1beta1")
REQUEST_CONCURRENCY = 3
"""Requests in flight at once (claim reads included); more wait. With HTTP/1.1 each needs its own
connection, so with the one watch per driver a one-driver agent uses at most 4 connections."""
CONNECTION_LIMIT = 32
"""Safety cap on the pool (requests plus watches); the agent opens one watch per driver."""
KEEPALIVE_SECONDS = 60.0
"""How long an idle connection stays open for the next request."""
EVENT_NAMESPACE = "default"
"""Events about cluster-scoped objects (our Node) go to ``default``, as the kubelet's do."""

# Fields of a v1beta1 request that v1beta2/v1 nest under ``exactly``.
_EXACT_REQUEST_FIELDS = (
    "deviceClassName",
    "selectors",
    "allocationMode",
    "count",
    "adminAccess",
    "tolerations",
)
_NO_DRA_HELP = (
    "the API server does not serve resource.k8s.io ResourceSlices (Dynamic Resource Allocation is off). "
    "Kubernetes 1.34+ enables it by default; on 1.32/1.33 start kube-apiserver, kube-controller-manager, "
    "kube-scheduler and kubelet with --feature-gates=DynamicResourceAllocation=true and the API server "
    "with --runtime-config=resource.k8s.io/v1beta1=true (1.33: also resource.k8s.io/v1beta2=true)"
)


@dataclass(frozen=True)
class ServerInfo:
    """What discovery found: the Kubernetes version and the resource.k8s.io versions to use."""

    major: int
    minor: int
    git_version: str
    slice_version: str

    @property
    def taint_support(self) -> ClusterTaintSupport:
        """1.35+: 16 taints per device and the ``None`` effect; before: 4 and no ``None``."""
        if (self.major, self.minor) >= (1, 35):
            return ClusterTaintSupport(max_taints_per_device=16, none_effect=True)
        return ClusterTaintSupport(max_taints_per_device=4, none_effect=False)

    @property
    def slice_taints_possible(self) -> bool:
        """Device taints in slices exist from 1.33 (DRADeviceTaints, alpha)."""
        return (self.major, self.minor) >= (1, 33)

    @property
    def max_devices_with_taints(self) -> int:
        """1.35 limits a slice with a tainted device to 64 devices; before, 128 applies to all."""
        return 64 if (self.major, self.minor) >= (1, 35) else 128


@dataclass(frozen=True)
class WatchEvent:
    """One watch event: ADDED, MODIFIED, DELETED or BOOKMARK with its object."""

    type: str
    object: dict[str, Any]

    @property
    def resource_version(self) -> str:
        return str(self.object.get("metadata", {}).get("resourceVersion", ""))


def _parse_minor(text: str) -> int:
    digits = "".join(ch for ch in text if ch.isdigit())
    return int(digits) if digits else 0


def claim_to_v1(claim: Mapping[str, Any]) -> dict[str, Any]:
    """Convert a v1beta1 ResourceClaim dict to the v1 shape (v1beta2 and v1 already match)."""
    out = json.loads(json.dumps(claim))
    out["apiVersion"] = f"{RESOURCE_GROUP}/v1"
    requests = out.get("spec", {}).get("devices", {}).get("requests")
    if isinstance(requests, list):
        for request in requests:
            if not isinstance(request, dict) or "exactly" in request or "firstAvailable" in request:
                continue
            exactly = {k: request.pop(k) for k in _EXACT_REQUEST_FIELDS if k in request}
            request["exactly"] = exactly
    return dict(out)


APPLY_PATCH = "application/apply-patch+yaml"


class KubeClient:
    """Raw-JSON access to the parts of the Kubernetes API the agent uses.

    Create it inside the running event loop (`connect` or `from_configuration`), call `discover`
    (done by `connect`) before using resource.k8s.io, and `close` it at the end.
    """

    def __init__(
        self,
        cfg: Any,
        *,
        request_timeout: float = 10.0,
        request_concurrency: int = REQUEST_CONCURRENCY,
    ) -> None:
        self._cfg = cfg
        self._timeout = request_timeout
        self._info: ServerInfo | None = None
        base = str(cfg.host).rstrip("/")
        try:
            self._http = HttpClient(
                base,
                ssl_context=_ssl_context(cfg) if base.startswith("https:") else None,
                server_name=cfg.tls_server_name or None,
                # The kubeconfig's proxy-url; without, aiohttp's from the environment.
                proxy=cfg.proxy or None,
                proxy_headers=cfg.proxy_headers or None,
                limit=CONNECTION_LIMIT,
                keepalive=KEEPALIVE_SECONDS,
                user_agent=f"dra-agent/{__version__}",
            )
        except ValueError as error:
            raise KubeApiError(f"cannot use the API server {base}: {error}") from error
        self._requests = anyio.Semaphore(request_concurrency, fast_acquire=True)

    # ----- construction -------------------------------------------------------------------

    @classmethod
    async def connect(
        cls, mode: str = "auto", kubeconfig: Path | str | None = None, *, request_timeout: float = 10.0
    ) -> KubeClient:
        """Load credentials (in-cluster, kubeconfig or auto), then run API discovery."""
        cfg = await load_credentials(mode, kubeconfig)
        kube = cls.from_configuration(cfg, request_timeout=request_timeout)
        try:
            await kube.discover()
        except BaseException:
            await kube.close()
            raise
        return kube

    @classmethod
    def from_configuration(cls, cfg: Any, *, request_timeout: float = 10.0) -> KubeClient:
        """Wrap a kubernetes-asyncio `Configuration` (must run inside the event loop)."""
        return cls(cfg, request_timeout=request_timeout)

    async def close(self) -> None:
        """Close the HTTP connections."""
        await self._http.aclose()

    # ----- low level ----------------------------------------------------------------------

    async def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json", "Content-Type": "application/json"}
        # Runs the configuration's token refresh hook (exec plugins, rotated service-account tokens).
        settings = self._cfg.auth_settings()
        if inspect.isawaitable(settings):
            settings = await settings
        for setting in settings.values():
            if setting.get("in") == "header" and setting.get("value"):
                headers[str(setting["key"])] = str(setting["value"])
        return headers

    async def request(
        self,
        method: str,
        path: str,
        *,
        query: Sequence[tuple[str, str]] = (),
        body: Any = None,
        content_type: str = "",
    ) -> dict[str, Any]:
        """Send one request and return the decoded JSON answer; raise `KubeApiError` if it failed.

        `content_type` overrides the JSON body's type (``application/apply-patch+yaml`` for a
        server-side apply: JSON is YAML)."""
        async with self._requests:
            return await self._request(method, path, query=query, body=body, content_type=content_type)

    async def _request(
        self, method: str, path: str, *, query: Sequence[tuple[str, str]], body: Any, content_type: str = ""
    ) -> dict[str, Any]:
        headers = await self._headers()
        if content_type:
            headers["Content-Type"] = content_type
        try:
            answer = await self._http.request(
                method,
                path,
                query=query,
                headers=headers,
                body=json.dumps(body).encode() if body is not None else None,
                timeout=self._timeout,
            )
        except HttpError as error:
            raise KubeApiError(f"{method} {path}: API server {error}") from error
        data: Any
        try:
            data = json.loads(answer.body) if answer.body else {}
        except ValueError:
            data = {"message": answer.body[:200].decode("utf-8", "replace")}
        if not 200 <= answer.status <= 299:
            raise _api_error(method, path, answer.status, data)
        return data if isinstance(data, dict) else {"items": data}

    # ----- discovery ----------------------------------------------------------------------

    @property
    def info(self) -> ServerInfo:
        """Discovery results; raises if `discover` has not run."""
        if self._info is None:
            raise KubeApiError("KubeClient.discover() must run before resource.k8s.io is used")
        return self._info

    @property
    def has_info(self) -> bool:
        """Whether discovery has run."""
        return self._info is not None

    async def ensure_discovered(self) -> ServerInfo:
        """Discovery results, running discovery first when it has not run yet."""
        return self._info if self._info is not None else await self.discover()

    @property
    def slice_version(self) -> str:
        return self.info.slice_version

    async def discover(self) -> ServerInfo:
        """Find the server version and the resource.k8s.io versions that serve what we need."""
        version = await self.request("GET", "/version")
        major = _parse_minor(str(version.get("major", "1"))) or 1
        minor = _parse_minor(str(version.get("minor", "0")))
        try:
            group = await self.request("GET", f"/apis/{RESOURCE_GROUP}")
        except KubeApiError as error:
            if error.status == 404:
                raise KubeApiError(_NO_DRA_HELP, 404, "NotFound") from error
            raise
        versions = [str(v.get("version")) for v in group.get("versions", []) if isinstance(v, dict)]
        served = [v for v in versions if v in SLICE_VERSIONS]  # only the ResourceSlice versions matter
        resources: dict[str, set[str]] = {}
        errors: list[KubeApiError] = []

        async def list_version(v: str) -> None:
            try:
                listing = await self.request("GET", f"/apis/{RESOURCE_GROUP}/{v}")
            except KubeApiError as error:
                if error.status != 404:
                    errors.append(error)
                return
            resources[v] = {str(r.get("name")) for r in listing.get("resources", []) if isinstance(r, dict)}

        async with anyio.create_task_group() as tg:  # one round trip instead of one per version
            for v in served:
                tg.start_soon(list_version, v)
        if errors:
            raise errors[0]
        slice_version = next((v for v in SLICE_VERSIONS if "resourceslices" in resources.get(v, ())), None)
        if slice_version is None:
            raise KubeApiError(_NO_DRA_HELP, 404, "NotFound")
        self._info = ServerInfo(
            major, minor, str(version.get("gitVersion", f"v{major}.{minor}")), slice_version
        )
        log.info(
            "connected to the API server",
            extra=log_fields(
                server=self._info.git_version,
                resource_api=f"{RESOURCE_GROUP}/{slice_version}",
            ),
        )
        return self._info

    # ----- nodes and events ---------------------------------------------------------------

    async def get_node(self, name: str) -> dict[str, Any]:
        """The Node object; `KubeApiError` with status 404 when it does not exist (yet)."""
        return await self.request("GET", f"/api/v1/nodes/{name}")

    async def create_event(self, body: Mapping[str, Any], namespace: str = EVENT_NAMESPACE) -> dict[str, Any]:
        """Create a core/v1 Event."""
        return await self.request("POST", f"/api/v1/namespaces/{namespace}/events", body=dict(body))

    # ----- ResourceSlices -----------------------------------------------------------------

    def _slices_path(self, name: str = "") -> str:
        path = f"/apis/{RESOURCE_GROUP}/{self.slice_version}/resourceslices"
        return f"{path}/{name}" if name else path

    @staticmethod
    def _slice_selector(node_name: str, driver: str | None) -> list[tuple[str, str]]:
        if not driver:
            return [("fieldSelector", f"spec.nodeName={node_name}")]
        return [("fieldSelector", f"spec.nodeName={node_name},spec.driver={driver}")]

    async def list_resource_slices(
        self, *, node_name: str, driver: str | None
    ) -> tuple[list[dict[str, Any]], str]:
        """Our node's slices of `driver` (of every driver: None), and the list's resourceVersion (to
        start a watch)."""
        data = await self.request("GET", self._slices_path(), query=self._slice_selector(node_name, driver))
        items = [i for i in data.get("items", []) if isinstance(i, dict)]
        return items, str(data.get("metadata", {}).get("resourceVersion", ""))

    async def watch_resource_slices(
        self, *, node_name: str, driver: str | None, resource_version: str, timeout_seconds: int = 300
    ) -> AsyncIterator[WatchEvent]:
        """Stream watch events from `resource_version`; ends when the server closes the watch.

        An ERROR event raises `KubeApiError` with its code (410 when the version is too old).
        """
        query = [
            *self._slice_selector(node_name, driver),
            ("watch", "true"),
            ("allowWatchBookmarks", "true"),
            ("resourceVersion", resource_version),
            ("timeoutSeconds", str(timeout_seconds)),
        ]
        path = self._slices_path()
        try:
            async with self._http.stream(
                "GET",
                path,
                query=query,
                headers=await self._headers(),
                connect_timeout=self._timeout,
                read_timeout=timeout_seconds + 30,
            ) as response:
                if not 200 <= response.status <= 299:
                    try:
                        data = json.loads(await response.read() or b"{}")
                    except (ValueError, HttpError):
                        data = {}
                    raise _api_error("WATCH", path, response.status, data)
                try:
                    async for line in response.lines():
                        yield _watch_event(path, line)
                except HttpError as error:
                    raise KubeApiError(f"WATCH {path}: {error}") from error
        except HttpError as error:
            raise KubeApiError(f"GET {path}: API server {error}") from error

    async def create_resource_slice(self, body: Mapping[str, Any]) -> dict[str, Any]:
        return await self.request("POST", self._slices_path(), body=dict(body))

    async def dry_run_create_resource_slice(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Validate and default a slice as a create would, storing nothing (``dryRun=All``)."""
        return await self.request("POST", self._slices_path(), query=[("dryRun", "All")], body=dict(body))

    async def update_resource_slice(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Replace a slice; its ``metadata.resourceVersion`` makes a stale update fail with 409."""
        name = str(body["metadata"]["name"])
        return await self.request("PUT", self._slices_path(name), body=dict(body))

    async def delete_resource_slice(self, name: str, *, uid: str = "", resource_version: str = "") -> bool:
        """Delete a slice with preconditions; False when it was already gone."""
        return await self._delete(self._slices_path(name), uid=uid, resource_version=resource_version)

    async def _delete(self, path: str, *, uid: str = "", resource_version: str = "") -> bool:
        body: dict[str, Any] = {"kind": "DeleteOptions", "apiVersion": "v1"}
        preconditions = {k: v for k, v in (("uid", uid), ("resourceVersion", resource_version)) if v}
        if preconditions:
            body["preconditions"] = preconditions
        try:
            await self.request("DELETE", path, body=body)
        except KubeApiError as error:
            if error.status == 404:
                return False
            raise
        return True

    # ----- ResourceClaims -----------------------------------------------------------------

    async def apply_claim_status(
        self, namespace: str, name: str, body: Mapping[str, Any], *, field_manager: str
    ) -> dict[str, Any]:
        """Server-side apply of a claim's status (``body`` holds what `field_manager` owns there)."""
        path = (
            f"/apis/{RESOURCE_GROUP}/{self.slice_version}/namespaces/{namespace}/resourceclaims/{name}/status"
        )
        return await self.request(
            "PATCH",
            path,
            query=[("fieldManager", field_manager), ("force", "true")],
            body=body,
            content_type=APPLY_PATCH,
        )

    async def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any]:
        """The claim in v1 shape (implements `agent.claims.preparer.ClaimSource`); 404 when absent."""
        path = f"/apis/{RESOURCE_GROUP}/{self.slice_version}/namespaces/{namespace}/resourceclaims/{name}"
        claim = await self.request("GET", path)
        return claim_to_v1(claim) if self.slice_version == "v1beta1" else claim


def _ssl_context(cfg: Any) -> ssl.SSLContext:
    """TLS as the kubeconfig or service account says: CA, client certificate, verification."""
    context = ssl.create_default_context(cafile=cfg.ssl_ca_cert)
    if cfg.cert_file:
        context.load_cert_chain(cfg.cert_file, keyfile=cfg.key_file)
    if not cfg.verify_ssl:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if getattr(cfg, "disable_strict_ssl_verification", False):
        context.verify_flags &= ~ssl.VERIFY_X509_STRICT
    return context


def _api_error(method: str, path: str, status: int, data: Any) -> KubeApiError:
    message = str(data.get("message", "")) if isinstance(data, dict) else ""
    reason = str(data.get("reason", "")) if isinstance(data, dict) else ""
    hint = {
        401: " (the credentials were refused: check the token or kubeconfig)",
        403: " (RBAC: grant the agent's service account this verb; see deploy/)",
    }.get(status, "")
    return KubeApiError(f"{method} {path}: {status} {reason or 'error'}: {message}{hint}", status, reason)


def _watch_event(path: str, line: bytes) -> WatchEvent:
    try:
        data = json.loads(line)
    except ValueError as error:
        raise KubeApiError(f"WATCH {path}: undecodable event: {line[:100]!r}") from error
    kind = str(data.get("type", ""))
    obj = data.get("object") if isinstance(data.get("object"), dict) else {}
    if kind == "ERROR":
        status = int(obj.get("code", 0) or 0)
        raise KubeApiError(
            f"WATCH {path}: {status} {obj.get('reason', '')}: {obj.get('message', '')}",
            status,
            str(obj.get("reason", "")),
        )
    return WatchEvent(kind, obj)
