"""API errors shaped as the Kubernetes apiserver's ``Status`` objects."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

JSON = dict[str, Any]

_REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    406: "NotAcceptable",
    409: "Conflict",
    410: "Expired",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


def reason_for(code: int) -> str:
    """The apiserver's ``reason`` for an HTTP status code (``Unknown`` when it has none)."""
    return _REASONS.get(code, "Unknown")


@dataclass(frozen=True)
class Cause:
    """One field error of a 422 Invalid answer."""

    field: str
    reason: str
    message: str

    def to_dict(self) -> JSON:
        """The ``details.causes[]`` entry."""
        return {"reason": self.reason, "message": self.message, "field": self.field}

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


@dataclass
class ApiError(Exception):
    """A failed API call; `status()` is the body the apiserver would send."""

    code: int
    message: str
    reason: str = ""
    details: JSON = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.reason:
            self.reason = reason_for(self.code)
        super().__init__(self.message)

    def __str__(self) -> str:
        return f"{self.code} {self.reason}: {self.message}"

    def status(self) -> JSON:
        """A ``Status`` object exactly as the apiserver shapes it."""
        body: JSON = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if not self.reason:
            del body["reason"]  # metav1.StatusReasonUnknown ("") is omitted
        if self.details:
            body["details"] = self.details
        return body


def _qualified(kind: str, group: str) -> str:
    return f"{kind}.{group}" if group else kind


def _resource(plural: str, group: str) -> str:
    return f"{plural}.{group}" if group else plural


def not_found(plural: str, group: str, name: str) -> ApiError:
    """404 for a missing object."""
    return ApiError(
        404,
        f'{_resource(plural, group)} "{name}" not found',
        details={"name": name, "group": group, "kind": plural},
    )


def already_exists(plural: str, group: str, name: str) -> ApiError:
    """409 AlreadyExists on create."""
    return ApiError(
        409,
        f'{_resource(plural, group)} "{name}" already exists',
        reason="AlreadyExists",
        details={"name": name, "group": group, "kind": plural},
    )


def conflict(plural: str, group: str, name: str, why: str) -> ApiError:
    """409 Conflict (stale resourceVersion, failed precondition)."""
    return ApiError(
        409,
        f'Operation cannot be fulfilled on {_resource(plural, group)} "{name}": {why}',
        reason="Conflict",
        details={"name": name, "group": group, "kind": plural},
    )


def invalid(kind: str, group: str, name: str, causes: list[Cause]) -> ApiError:
    """422 Invalid with one cause per field error."""
    listed = ", ".join(str(c) for c in causes)
    text = listed if len(causes) == 1 else f"[{listed}]"
    return ApiError(
        422,
        f'{_qualified(kind, group)} "{name}" is invalid: {text}',
        details={
            "name": name,
            "group": group,
            "kind": kind,
            "causes": [c.to_dict() for c in causes],
        },
    )


def bad_request(message: str) -> ApiError:
    """400 BadRequest."""
    return ApiError(400, message)


def gone(message: str) -> ApiError:
    """410 Gone (reason Expired) for a compacted resourceVersion."""
    return ApiError(410, message, reason="Expired")
