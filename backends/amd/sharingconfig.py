"""AMD's opaque claim configuration, as AMD's DRA driver defines it: ``gpu.resource.amd.com/v1alpha1``.

The API of AMD's driver (``ROCm/k8s-gpu-dra-driver``, ``api/amd.com/resource/gpu/v1alpha1/api.go``)
has two kinds, decoded strictly (unknown fields refused):

- ``GpuConfig``: no field besides ``apiVersion`` and ``kind`` ("No configs are supported yet").
  Accepted; it changes nothing (a GPU or partition is prepared as without a config).
- ``VfioDeviceConfig`` (``iommu: {backendPolicy: LegacyOnly | PreferIommuFD}``): binds the GPU to
  ``vfio-pci`` for passthrough to a virtual machine. Not supported by this driver: refused by name.

.. code-block:: yaml

    apiVersion: gpu.resource.amd.com/v1alpha1
    kind: GpuConfig

AMD GPUs have no MPS and no per-claim time-slice setting, and AMD's API has no sharing field:
with ``consumable-shares`` the scheduler hands a device to several claims (the hardware does not
enforce their ``memory`` or ``shares``); a claim that must have a device alone requests its whole
capacity. Another apiVersion or kind, or any other field, fails the claim with the field, the
value and what is accepted. (``gpu.amd.com/v1alpha1`` with a ``sharing`` field was never released
and is not accepted.)
"""

from __future__ import annotations

from collections.abc import Sequence

from agent.core.sharing import DeviceConfigError, DeviceShare, OpaqueConfig

API_VERSION = "gpu.resource.amd.com/v1alpha1"
GPU_CONFIG = "GpuConfig"
VFIO_DEVICE_CONFIG = "VfioDeviceConfig"
_FIELDS = ("apiVersion", "kind")


def parse_amd_config(config: OpaqueConfig, claim: str) -> str:
    """The config's kind (always ``GpuConfig``) after a strict check; raises `DeviceConfigError`."""
    params, where = config.parameters, config.where
    api_version = params.get("apiVersion")
    if api_version != API_VERSION:
        raise DeviceConfigError(claim, where, "apiVersion", api_version, API_VERSION)
    kind = params.get("kind")
    if kind == VFIO_DEVICE_CONFIG:
        raise DeviceConfigError(
            claim,
            where,
            "kind",
            kind,
            f"{GPU_CONFIG}: {VFIO_DEVICE_CONFIG} (VFIO passthrough to virtual machines) is not "
            "supported by this driver",
        )
    if kind != GPU_CONFIG:
        raise DeviceConfigError(claim, where, "kind", kind, GPU_CONFIG)
    for key in params:
        if key not in _FIELDS:
            raise DeviceConfigError(
                claim,
                where,
                f"field {key}",
                params[key],
                f"only the fields {', '.join(_FIELDS)} ({API_VERSION} {GPU_CONFIG} has no other fields)",
            )
    return GPU_CONFIG


def check_shares(share: DeviceShare, peers: Sequence[DeviceShare]) -> None:
    """Raise `DeviceConfigError` for a bad config of `share`; shares of a device never conflict.

    The peers' configs were checked when they were prepared; AMD's GpuConfig sets nothing up, so
    any number of claims with or without it can share a device.
    """
    if share.config is not None:
        parse_amd_config(share.config, share.claim_key)
