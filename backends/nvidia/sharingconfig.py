"""NVIDIA's opaque claim configuration, accepted unchanged: ``resource.nvidia.com/v1beta1``.

The format of NVIDIA's DRA driver (``kubernetes-sigs/dra-driver-nvidia-gpu``,
``api/nvidia.com/resource/v1beta1``: ``gpuconfig.go``, ``migconfig.go``, ``sharing.go``,
``validate.go``), so users' existing claims work:

.. code-block:: yaml

    apiVersion: resource.nvidia.com/v1beta1
    kind: GpuConfig                  # or MigDeviceConfig for a MIG device
    sharing:
      strategy: TimeSlicing          # or MPS
      timeSlicingConfig:
        interval: Default            # Default | Short | Medium | Long (not for MigDeviceConfig)
      mpsConfig:                     # with strategy MPS only
        defaultActiveThreadPercentage: 50
        defaultPinnedDeviceMemoryLimit: 10Gi
        defaultPerDevicePinnedMemoryLimit: {"0": 5Gi}   # by index in the claim or by UUID
        multiUser: false             # true (a multi-user daemon) is not supported here

NVIDIA's other kinds of this group are refused by name, as not supported by this driver:
``VfioDeviceConfig`` (VFIO passthrough to virtual machines), ``ComputeDomainChannelConfig`` and
``ComputeDomainDaemonConfig`` (IMEX channels and daemons of NVIDIA's ``compute-domain.nvidia.com``
driver), and the custom resources ``ComputeDomain`` and ``ComputeDomainClique`` (not device
configs at all). Decoding is strict, as NVIDIA's: unknown fields, another apiVersion or kind, a
strategy with the other strategy's settings, a percentage outside 1-100 (NVIDIA also takes 0) or
a limit under 1Mi are refused with the claim, the field and what is accepted. No ``sharing``
means the device is used exclusively.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from agent.core.errors import QuantityError
from agent.core.quantity import Quantity
from agent.core.sharing import DeviceConfigError, OpaqueConfig

API_VERSION = "resource.nvidia.com/v1beta1"
GPU_CONFIG = "GpuConfig"
MIG_CONFIG = "MigDeviceConfig"
_CUSTOM_RESOURCE = "a custom resource of NVIDIA's compute-domain.nvidia.com driver, not a device config"
UNSUPPORTED_KINDS = {
    "VfioDeviceConfig": "VFIO passthrough to virtual machines",
    "ComputeDomainChannelConfig": "an IMEX channel of NVIDIA's compute-domain.nvidia.com driver",
    "ComputeDomainDaemonConfig": "an IMEX daemon of NVIDIA's compute-domain.nvidia.com driver",
    "ComputeDomain": _CUSTOM_RESOURCE,
    "ComputeDomainClique": _CUSTOM_RESOURCE,
}
"""NVIDIA's kinds of ``resource.nvidia.com/v1beta1`` that this driver refuses by name, with what they are."""
LEGACY_API_VERSION = "gpu.resource.nvidia.com/v1alpha1"
"""Classic DRA's claim parameters (``GpuClaimParameters``), replaced by the opaque configs above."""
TIME_SLICING = "TimeSlicing"
MPS = "MPS"
EXCLUSIVE = "Exclusive"
INTERVALS = {"Default": 0, "Short": 1, "Medium": 2, "Long": 3}
"""Interval name -> the value of ``nvidia-smi compute-policy --set-timeslice``."""
MIN_PINNED = 1024 * 1024
"""MPS takes its limits in whole megabytes."""

_TOP = frozenset({"apiVersion", "kind", "sharing"})
_SHARING = frozenset({"strategy", "timeSlicingConfig", "mpsConfig"})
_TIME_SLICING = frozenset({"interval"})
_MPS = frozenset(
    {
        "defaultActiveThreadPercentage",
        "defaultPinnedDeviceMemoryLimit",
        "defaultPerDevicePinnedMemoryLimit",
        "multiUser",
    }
)


@dataclass(frozen=True)
class MpsSettings:
    """The MPS control daemon's defaults for one device."""

    active_thread_percentage: int | None = None
    pinned_memory_limit: Quantity | None = None
    per_device_pinned: Mapping[str, Quantity] = field(default_factory=dict)
    """Overrides of `pinned_memory_limit` by device index (``"0"``) or UUID."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "per_device_pinned", MappingProxyType(dict(self.per_device_pinned)))

    def pinned_for(self, uuid: str) -> Quantity | None:
        """The daemon's default pinned-memory limit for the device with `uuid` (index 0 of its share)."""
        return self.per_device_pinned.get(uuid) or self.per_device_pinned.get("0") or self.pinned_memory_limit


@dataclass(frozen=True)
class NvSharing:
    """A device's sharing as configured: exclusive, time-sliced (with an interval) or MPS."""

    strategy: str = EXCLUSIVE
    interval: str = "Default"
    mps: MpsSettings = field(default_factory=MpsSettings)
    kind: str = GPU_CONFIG

    def describe(self) -> str:
        """For conflict messages: ``TimeSlicing (interval Long)``, ``MPS (...)``, ``exclusive use``."""
        if self.strategy == TIME_SLICING:
            return f"TimeSlicing (interval {self.interval})"
        if self.strategy == MPS:
            parts = []
            if self.mps.active_thread_percentage is not None:
                parts.append(f"defaultActiveThreadPercentage {self.mps.active_thread_percentage}")
            if self.mps.pinned_memory_limit is not None:
                parts.append(f"defaultPinnedDeviceMemoryLimit {self.mps.pinned_memory_limit.canonical()}")
            return "MPS" + (f" ({', '.join(parts)})" if parts else "")
        return "no sharing configuration"


EXCLUSIVE_USE = NvSharing()


def _unknown(
    claim: str, config: OpaqueConfig, obj: Mapping[str, Any], known: frozenset[str], path: str
) -> None:
    for key in obj:
        if key not in known:
            raise DeviceConfigError(
                claim,
                config.where,
                f"field {path}{key}",
                obj[key],
                f"only the fields {', '.join(sorted(known))}",
            )


def _object(claim: str, config: OpaqueConfig, value: object, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise DeviceConfigError(claim, config.where, path, value, "an object")
    return value


def _limit(claim: str, config: OpaqueConfig, value: object, path: str) -> Quantity:
    text = repr(value) if isinstance(value, float) else value  # a JSON number such as 1e9
    try:
        quantity = Quantity.parse(text if isinstance(text, str | int) and not isinstance(text, bool) else "?")
    except QuantityError:
        raise DeviceConfigError(claim, config.where, path, value, "a quantity such as 4Gi") from None
    if quantity.value < MIN_PINNED:
        raise DeviceConfigError(claim, config.where, path, value, "a quantity of at least 1Mi")
    return quantity


def parse_nvidia_config(config: OpaqueConfig, claim: str) -> NvSharing:
    """Decode one config strictly; raises `DeviceConfigError` naming `claim` and the field."""
    params = config.parameters
    api_version = params.get("apiVersion")
    if api_version != API_VERSION:
        legacy = (
            f" ({LEGACY_API_VERSION} is classic DRA's claim parameters: put its sharing in a "
            f"{API_VERSION} {GPU_CONFIG} or {MIG_CONFIG})"
            if api_version == LEGACY_API_VERSION
            else ""
        )
        raise DeviceConfigError(claim, config.where, "apiVersion", api_version, API_VERSION + legacy)
    kind = params.get("kind")
    if isinstance(kind, str) and kind in UNSUPPORTED_KINDS:
        raise DeviceConfigError(
            claim,
            config.where,
            "kind",
            kind,
            f"{GPU_CONFIG} or {MIG_CONFIG}: {kind} ({UNSUPPORTED_KINDS[kind]}) "
            "is not supported by this driver",
        )
    if kind not in (GPU_CONFIG, MIG_CONFIG):
        raise DeviceConfigError(claim, config.where, "kind", kind, f"{GPU_CONFIG} or {MIG_CONFIG}")
    _unknown(claim, config, params, _TOP, "")
    if params.get("sharing") is None:
        return NvSharing(kind=str(kind))
    sharing = _object(claim, config, params["sharing"], "sharing")
    _unknown(claim, config, sharing, _SHARING, "sharing.")
    strategy = sharing.get("strategy")
    if strategy not in (TIME_SLICING, MPS):
        raise DeviceConfigError(claim, config.where, "sharing.strategy", strategy, f"{TIME_SLICING} or {MPS}")
    if strategy == TIME_SLICING:
        if sharing.get("mpsConfig") is not None:
            raise DeviceConfigError(
                claim,
                config.where,
                "sharing.mpsConfig",
                sharing["mpsConfig"],
                "no mpsConfig with TimeSlicing",
            )
        interval = "Default"
        if sharing.get("timeSlicingConfig") is not None:
            if kind == MIG_CONFIG:
                raise DeviceConfigError(
                    claim,
                    config.where,
                    "sharing.timeSlicingConfig",
                    sharing["timeSlicingConfig"],
                    "no timeSlicingConfig for MigDeviceConfig (MIG devices take the default interval)",
                )
            ts = _object(claim, config, sharing["timeSlicingConfig"], "sharing.timeSlicingConfig")
            _unknown(claim, config, ts, _TIME_SLICING, "sharing.timeSlicingConfig.")
            interval = ts.get("interval", "Default")
            if interval not in INTERVALS:
                raise DeviceConfigError(
                    claim, config.where, "sharing.timeSlicingConfig.interval", interval, " | ".join(INTERVALS)
                )
        return NvSharing(strategy=TIME_SLICING, interval=str(interval), kind=str(kind))
    if sharing.get("timeSlicingConfig") is not None:
        raise DeviceConfigError(
            claim,
            config.where,
            "sharing.timeSlicingConfig",
            sharing["timeSlicingConfig"],
            "no timeSlicingConfig with MPS",
        )
    raw = _object(claim, config, sharing.get("mpsConfig") or {}, "sharing.mpsConfig")
    _unknown(claim, config, raw, _MPS, "sharing.mpsConfig.")
    percentage = raw.get("defaultActiveThreadPercentage")
    if percentage is not None and (
        isinstance(percentage, bool) or not isinstance(percentage, int) or not 1 <= percentage <= 100
    ):
        raise DeviceConfigError(
            claim,
            config.where,
            "sharing.mpsConfig.defaultActiveThreadPercentage",
            percentage,
            "an integer from 1 to 100",
        )
    multi_user = raw.get("multiUser")
    if multi_user is not None and multi_user is not False:
        raise DeviceConfigError(
            claim,
            config.where,
            "sharing.mpsConfig.multiUser",
            multi_user,
            "false or no multiUser: a multi-user MPS control daemon (nvidia-cuda-mps-control -M) "
            "is not supported by this driver",
        )
    pinned = raw.get("defaultPinnedDeviceMemoryLimit")
    per_device = _object(
        claim,
        config,
        raw.get("defaultPerDevicePinnedMemoryLimit") or {},
        "sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit",
    )
    return NvSharing(
        strategy=MPS,
        kind=str(kind),
        mps=MpsSettings(
            active_thread_percentage=percentage,
            pinned_memory_limit=None
            if pinned is None
            else _limit(claim, config, pinned, "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit"),
            per_device_pinned={
                str(key): _limit(
                    claim, config, value, f"sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[{key}]"
                )
                for key, value in per_device.items()
            },
        ),
    )
