"""AMD's opaque claim configuration: the smallest one that means something, sharing on or off.

AMD GPUs have no MPS and no time-slice setting a driver could apply per claim; the only choice
left to a claim is whether it accepts other claims on its device. With
``consumable-shares`` on, the scheduler hands a device to several claims (it does the
bookkeeping of the ``memory`` or ``shares`` capacity; the hardware does not enforce it). A claim
that must run alone says so:

.. code-block:: yaml

    apiVersion: gpu.amd.com/v1alpha1
    kind: GpuConfig
    sharing:
      enabled: false      # default true

It then fails to prepare while another claim holds a share of the device (and a later share
fails while it is there), naming the other claim. Decoding is strict: unknown fields, another
apiVersion or kind, or a non-boolean are refused with the claim, the field and what is accepted.
"""

from __future__ import annotations

from collections.abc import Sequence

from agent.core.sharing import DeviceConfigError, DeviceShare, share_conflict

API_VERSION = "gpu.amd.com/v1alpha1"
KIND = "GpuConfig"
_TOP = frozenset({"apiVersion", "kind", "sharing"})


def shares_allowed(share: DeviceShare) -> bool:
    """The share's ``sharing.enabled`` (True without a config); raises `DeviceConfigError`."""
    if share.config is None:
        return True
    params, where, claim = share.config.parameters, share.config.where, share.claim_key
    for key in params:
        if key not in _TOP:
            raise DeviceConfigError(
                claim, where, f"field {key}", params[key], "only apiVersion, kind and sharing"
            )
    if params.get("apiVersion") != API_VERSION:
        raise DeviceConfigError(claim, where, "apiVersion", params.get("apiVersion"), API_VERSION)
    if params.get("kind") != KIND:
        raise DeviceConfigError(claim, where, "kind", params.get("kind"), KIND)
    sharing = params.get("sharing", {})
    if not isinstance(sharing, dict) or set(sharing) - {"enabled"}:
        raise DeviceConfigError(claim, where, "sharing", sharing, "an object with the one field enabled")
    enabled = sharing.get("enabled", True)
    if not isinstance(enabled, bool):
        raise DeviceConfigError(claim, where, "sharing.enabled", enabled, "true or false")
    return enabled


def check_shares(share: DeviceShare, peers: Sequence[DeviceShare]) -> None:
    """Raise for a bad config, or `ShareConflictError` when this share or a peer must run alone."""
    mine = shares_allowed(share)
    for peer in peers:
        theirs = shares_allowed(peer)
        if not (mine and theirs):
            raise share_conflict(
                share,
                peer,
                "the device to itself" if not mine else "a shared device",
                "the device to itself" if not theirs else "a shared device",
            )
