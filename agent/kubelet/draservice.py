"""The kubelet's DRA node service (``DRAPlugin``), v1 and v1beta1 over one implementation.

Both versions validate the request, hand the claims to the `ClaimPreparer` and answer with an
entry for every requested claim UID. Only v1 carries ``share_id``. A `ClaimRequestError` fails
the whole RPC with its gRPC code, as the kubelet's Go helper does; any other exception becomes
INTERNAL with a message pointing at the agent log, never a crashed server. Requests and answers
are betterproto's generated messages (`agent.kubelet._protos`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import ModuleType
from typing import Any, ClassVar, Protocol, TypeVar

import anyio
import grpclib.const
from grpclib import GRPCError
from grpclib.const import Status
from grpclib.exceptions import StreamTerminatedError
from grpclib.server import Stream

from agent.claims.preparer import ClaimPreparer, PrepareResult
from agent.core.backend import ClaimRef
from agent.core.errors import ClaimRequestError
from agent.core.logs import log_fields
from agent.core.model import is_dns_label, is_dns_subdomain
from agent.kubelet._protos.k8s.io.kubelet.pkg.apis.dra import v1 as pb_v1
from agent.kubelet._protos.k8s.io.kubelet.pkg.apis.dra import v1beta1 as pb_v1beta1
from agent.observe.metrics import Children, Metrics

log = logging.getLogger("agent.kubelet.draservice")

MAX_CLAIMS_PER_REQUEST = 256
"""More claims than this in one call is refused: the kubelet sends one pod's claims of one driver."""
MAX_UID_LENGTH = 128
MAX_NAME_LENGTH = 253

PREPARE = "NodePrepareResources"
UNPREPARE = "NodeUnprepareResources"
NO_RESULT = "the agent's claim preparer returned no result for this claim; see the agent log"

T = TypeVar("T")


class ClaimMessage(Protocol):
    """The ``Claim`` message of either API version."""

    @property
    def namespace(self) -> str: ...
    @property
    def uid(self) -> str: ...
    @property
    def name(self) -> str: ...


def validate_claims(claims: Sequence[ClaimMessage]) -> list[ClaimRef]:
    """Turn the request's claims into `ClaimRef`s, one per UID, in request order.

    Raises `GRPCError(INVALID_ARGUMENT)` naming the offending field. A UID repeated with the same
    namespace and name is served once; with a different one it is refused.
    """
    if len(claims) > MAX_CLAIMS_PER_REQUEST:
        raise GRPCError(
            Status.INVALID_ARGUMENT,
            f"claims: {len(claims)} claims in one request, at most {MAX_CLAIMS_PER_REQUEST}",
        )
    refs: dict[str, ClaimRef] = {}
    for i, claim in enumerate(claims):
        namespace, name, uid = claim.namespace, claim.name, claim.uid
        where = f"claims[{i}]"
        for field, value in (("namespace", namespace), ("uid", uid), ("name", name)):
            if not value:
                raise GRPCError(Status.INVALID_ARGUMENT, f"{where}.{field}: must not be empty")
        if not is_dns_label(namespace):
            raise GRPCError(
                Status.INVALID_ARGUMENT,
                f"{where}.namespace: {namespace[:80]!r} is not a valid namespace name",
            )
        if len(name) > MAX_NAME_LENGTH or not is_dns_subdomain(name):
            raise GRPCError(
                Status.INVALID_ARGUMENT,
                f"{where}.name: {name[:80]!r} is not a valid ResourceClaim name",
            )
        if len(uid) > MAX_UID_LENGTH or not uid.isprintable() or uid.strip() != uid:
            raise GRPCError(
                Status.INVALID_ARGUMENT,
                f"{where}.uid: {uid[:80]!r} is not a valid UID (printable, at most {MAX_UID_LENGTH})",
            )
        ref = ClaimRef(namespace=namespace, name=name, uid=uid)
        seen = refs.get(uid)
        if seen is None:
            refs[uid] = ref
        elif seen != ref:
            raise GRPCError(
                Status.INVALID_ARGUMENT,
                f"{where}.uid: {uid!r} is also used by {seen.namespace}/{seen.name}",
            )
    return list(refs.values())


def _status_for(exc: ClaimRequestError) -> Status:
    try:
        return Status[exc.code.upper()]
    except KeyError:
        return Status.FAILED_PRECONDITION


class DRAService:
    """The version-independent logic of NodePrepareResources / NodeUnprepareResources."""

    def __init__(
        self,
        driver: str,
        preparer: ClaimPreparer,
        *,
        metrics: Metrics | None = None,
        preparer_ready: anyio.Event | None = None,
    ) -> None:
        self.driver = driver
        self.preparer = preparer
        self._metrics = metrics
        self._child = Children()
        self._ready = preparer_ready

    def preparer_ready(self) -> bool:
        """False while prepare and unprepare calls wait for the preparer (its checkpoint loading)."""
        return self._ready is None or self._ready.is_set()

    async def prepare(self, version: str, claims: Sequence[ClaimMessage]) -> dict[str, PrepareResult]:
        """A result per requested claim UID."""

        async def call(refs: list[ClaimRef]) -> dict[str, PrepareResult]:
            results = await self.preparer.prepare(refs)
            return {ref.uid: _missing(results, ref.uid, PrepareResult(error=NO_RESULT)) for ref in refs}

        return await self._serve(version, PREPARE, claims, call)

    async def unprepare(self, version: str, claims: Sequence[ClaimMessage]) -> dict[str, str]:
        """An error message (``""`` for success) per requested claim UID."""

        async def call(refs: list[ClaimRef]) -> dict[str, str]:
            results = await self.preparer.unprepare(refs)
            return {ref.uid: _missing(results, ref.uid, NO_RESULT) for ref in refs}

        return await self._serve(version, UNPREPARE, claims, call)

    async def _serve(
        self,
        version: str,
        method: str,
        claims: Sequence[ClaimMessage],
        call: Callable[[list[ClaimRef]], Awaitable[dict[str, T]]],
    ) -> dict[str, T]:
        label = f"{version}.{method}"
        started = time.monotonic()
        result = "ok"
        if self._metrics is not None:
            self._child(self._metrics.grpc_in_flight, self.driver, label).inc()
        try:
            refs = validate_claims(claims)
            if not refs:
                return {}  # liveness probes send an empty request
            if self._ready is not None and not self._ready.is_set():  # anyio's wait() yields even when set
                await self._ready.wait()  # the sockets serve before the checkpoint is loaded
            try:
                answer = await call(refs)
            except ClaimRequestError as exc:
                status = _status_for(exc)
                log.warning(
                    "claim request refused",
                    extra=log_fields(driver=self.driver, method=label, code=status.name, error=str(exc)),
                )
                raise GRPCError(status, str(exc)) from exc
            except Exception as exc:
                log.exception("claim preparer failed", extra=log_fields(driver=self.driver, method=label))
                raise GRPCError(
                    Status.INTERNAL,
                    f"{method} failed inside the agent ({type(exc).__name__}: {exc}); see the agent log",
                ) from exc
            # Per call at debug only: dra_agent_grpc_requests_total and the claim metrics count them.
            if log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "claims served",
                    extra=log_fields(
                        driver=self.driver,
                        method=label,
                        claims=len(refs),
                        failed=sum(1 for v in answer.values() if _is_error(v)),
                        duration_ms=round((time.monotonic() - started) * 1000, 2),
                    ),
                )
            return answer
        except GRPCError as exc:
            result = exc.status.name.lower()
            raise
        except BaseException:
            result = "cancelled"
            raise
        finally:
            if self._metrics is not None:
                self._child(self._metrics.grpc_in_flight, self.driver, label).dec()
                self._child(self._metrics.grpc_requests, self.driver, label, result).inc()


def _missing(results: Mapping[str, T], uid: str, default: T) -> T:
    if uid in results:
        return results[uid]
    log.error("claim preparer left a claim unanswered", extra=log_fields(claim_uid=uid))
    return default


def _is_error(value: object) -> bool:
    if isinstance(value, PrepareResult):
        return bool(value.error)
    return bool(value)


def base_request_names(requests: Sequence[str]) -> list[str]:
    """``gpu/sub`` -> ``gpu``, duplicates dropped: the kubelet matches containers on base names."""
    return list(dict.fromkeys(r.partition("/")[0] for r in requests))


def _prepare_response(pb: ModuleType, results: Mapping[str, PrepareResult], *, share_id: bool) -> Any:
    """The ``NodePrepareResourcesResponse`` of one API version (`pb`: its generated module)."""

    def device(d: Any) -> Any:
        fields: dict[str, Any] = {
            "request_names": base_request_names(d.requests),
            "pool_name": d.pool,
            "device_name": d.device,
            "cdi_device_ids": list(d.cdi_device_ids),
        }
        if share_id:  # v1 only
            fields["share_id"] = d.share_id
        return pb.Device(**fields)

    return pb.NodePrepareResourcesResponse(
        claims={
            uid: pb.NodePrepareResourceResponse(
                devices=[] if r.error else [device(d) for d in r.devices], error=r.error
            )
            for uid, r in results.items()
        }
    )


async def _receive(stream: Stream[Any, Any]) -> Any:
    """The request; bytes that do not decode (or none) are INVALID_ARGUMENT.

    betterproto raises plain exceptions (EOFError, UnicodeDecodeError...) on bad bytes, which
    grpclib would answer as UNKNOWN "Internal Server Error" with a traceback in the log.
    """
    try:
        request = await stream.recv_message()
    except (GRPCError, StreamTerminatedError):
        raise
    except Exception as exc:
        raise GRPCError(
            Status.INVALID_ARGUMENT, f"cannot decode the request: {type(exc).__name__}: {exc}"
        ) from exc
    if request is None:
        raise GRPCError(Status.INVALID_ARGUMENT, "cannot decode the request: no request message")
    return request


class _DRAPlugin:
    """``DRAPlugin`` of one API version (`PB`: its generated messages)."""

    VERSION: ClassVar[str]
    PB: ClassVar[ModuleType]
    SHARE_ID: ClassVar[bool]
    """Whether this version's ``Device`` has ``share_id``."""

    def __init__(self, service: DRAService) -> None:
        self.service = service

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        prefix, pb = f"/k8s.io.kubelet.pkg.apis.dra.{self.VERSION}.DRAPlugin/", self.PB
        unary = grpclib.const.Cardinality.UNARY_UNARY
        return {
            prefix + PREPARE: grpclib.const.Handler(
                self._prepare, unary, pb.NodePrepareResourcesRequest, pb.NodePrepareResourcesResponse
            ),
            prefix + UNPREPARE: grpclib.const.Handler(
                self._unprepare, unary, pb.NodeUnprepareResourcesRequest, pb.NodeUnprepareResourcesResponse
            ),
        }

    async def _prepare(self, stream: Stream[Any, Any]) -> None:
        request = await _receive(stream)
        results = await self.service.prepare(self.VERSION, request.claims)
        await stream.send_message(_prepare_response(self.PB, results, share_id=self.SHARE_ID))

    async def _unprepare(self, stream: Stream[Any, Any]) -> None:
        request = await _receive(stream)
        errors = await self.service.unprepare(self.VERSION, request.claims)
        pb = self.PB
        claims = {uid: pb.NodeUnprepareResourceResponse(error=e) for uid, e in errors.items()}
        await stream.send_message(pb.NodeUnprepareResourcesResponse(claims=claims))


class DRAPluginV1(_DRAPlugin):
    """``k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`` (Kubernetes 1.34+), with ``share_id``."""

    VERSION = "v1"
    PB: ClassVar[ModuleType] = pb_v1
    SHARE_ID = True


class DRAPluginV1Beta1(_DRAPlugin):
    """``k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin`` (Kubernetes 1.32+), without ``share_id``."""

    VERSION = "v1beta1"
    PB: ClassVar[ModuleType] = pb_v1beta1
    SHARE_ID = False
