"""Exception classes of the agent core.

Every error message says what was wrong and what to do about it.
"""

from __future__ import annotations


class AgentError(Exception):
    """Base class of every error the agent raises on purpose."""


class ConfigError(AgentError):
    """A configuration value (flag, environment variable or file) is invalid."""

    def __init__(self, option: str, value: object, accepted: str) -> None:
        self.option = option
        self.value = value
        self.accepted = accepted
        super().__init__(f"invalid value {value!r} for {option}: expected {accepted}")


class DeviceModelError(AgentError):
    """A device breaks one of the API server's rules for ResourceSlices."""

    def __init__(self, device: str, field: str, problem: str) -> None:
        self.device = device
        self.field = field
        self.problem = problem
        super().__init__(f"device {device!r}: {field}: {problem}")


class VersionError(AgentError):
    """A version string cannot be turned into a valid semantic version."""

    def __init__(self, value: str, problem: str) -> None:
        self.value = value
        super().__init__(f"version {value!r} cannot be normalized to semver: {problem}")


class QuantityError(AgentError):
    """A string is not a valid Kubernetes resource quantity."""

    def __init__(self, value: str) -> None:
        self.value = value
        super().__init__(
            f"invalid quantity {value!r}: expected a number with an optional suffix "
            "(Ki, Mi, Gi, Ti, Pi, Ei, n, u, m, k, M, G, T, P, E or an exponent such as 1e3)"
        )


class BackendError(AgentError):
    """A backend failed; the message names the backend and what to check."""


class BackendNotFoundError(AgentError):
    """No backend is installed under the requested name."""


class DeviceNotFoundError(BackendError):
    """A request names a device the backend does not have."""

    def __init__(self, driver: str, device: str) -> None:
        self.driver = driver
        self.device = device
        super().__init__(
            f"driver {driver!r} has no device {device!r}; run 'dra-agent devices' to list the devices it has"
        )


class KubeApiError(AgentError):
    """The API server refused a request or could not be reached; `status` is the HTTP code (0: no answer)."""

    def __init__(self, message: str, status: int = 0, reason: str = "") -> None:
        self.status = status
        self.reason = reason
        super().__init__(message)


class ClaimRequestError(AgentError):
    """A kubelet request cannot be served as a whole (the RPC fails with a gRPC error).

    `code` is the name of the gRPC status to answer with (``INVALID_ARGUMENT``, ``NOT_FOUND``,
    ``FAILED_PRECONDITION``, ``UNAVAILABLE``...).
    """

    def __init__(self, message: str, code: str = "FAILED_PRECONDITION") -> None:
        self.code = code
        super().__init__(message)
