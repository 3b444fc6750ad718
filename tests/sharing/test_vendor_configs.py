"""Vendor opaque configs as the vendors publish them: accepted with their settings, or refused by name.

AMD: ``api/amd.com/resource/gpu/v1alpha1/api.go`` of ROCm/k8s-gpu-dra-driver (group
``gpu.resource.amd.com/v1alpha1``; ``GpuConfig`` without fields, ``VfioDeviceConfig`` with
``iommu.backendPolicy``). NVIDIA: ``api/nvidia.com/resource/v1beta1/*.go`` of
kubernetes-sigs/dra-driver-nvidia-gpu, its ``demo/specs/quickstart/v1/*.yaml``,
``tests/bats/specs/*.yaml`` and ``site/content/docs/reference/api.md``.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

from agent.claims.state.machine import DeviceState
from agent.core.backend import BackendOptions
from agent.core.quantity import Quantity
from agent.core.sharing import DeviceConfigError, OpaqueConfig
from backends.amd import sharingconfig as amd_config
from backends.amd.backend import AmdBackend
from backends.nvidia.sharingconfig import (
    MPS,
    TIME_SLICING,
    MpsSettings,
    NvSharing,
    parse_nvidia_config,
)
from tests.fakes.amd_standin import load, mi300x
from tests.kubelet.fakes import FakeClaimSource
from tests.sharing.helpers import (
    AMD,
    NODE,
    NVIDIA,
    claim,
    daemon_state,
    device_state,
    fake_backend,
    intervals,
    ref,
    share,
    uid,
)
from tests.support.clock import FakeClock

CLAIM = "default/claim-1"
WHERE = "status.allocation.devices.config[0] (from the claim)"
FIX = "fix the claim's (or its DeviceClass's) config and create the claim again"
AMD_V1ALPHA1 = "gpu.resource.amd.com/v1alpha1"
NV_V1BETA1 = "resource.nvidia.com/v1beta1"


def message(field: str, value: object, accepted: str) -> str:
    """The whole per-claim error of a config of claim-1 (`DeviceConfigError`'s wording)."""
    return f"claim {CLAIM}: {WHERE}: invalid {field} {value!r}: expected {accepted}; {FIX}"


def amd(params: dict[str, Any]) -> str:
    return amd_config.parse_amd_config(OpaqueConfig(AMD, params), CLAIM)


def nvidia(params: dict[str, Any]) -> NvSharing:
    return parse_nvidia_config(OpaqueConfig(NVIDIA, params), CLAIM)


# AMD ------------------------------------------------------------------------------------------

AMD_VFIO_REFUSED = message(
    "kind",
    "VfioDeviceConfig",
    "GpuConfig: VfioDeviceConfig (VFIO passthrough to virtual machines) is not supported by this driver",
)
AMD_FIELDS = f"only the fields apiVersion, kind ({AMD_V1ALPHA1} GpuConfig has no other fields)"

AMD_PUBLISHED: list[tuple[str, dict[str, Any], str]] = [
    # api.go DefaultGpuConfig(): the only GpuConfig there is.
    ("GpuConfig", {"apiVersion": AMD_V1ALPHA1, "kind": "GpuConfig"}, ""),
    # api.go DefaultVfioDeviceConfig(), and the PreferIommuFD policy its api_test.go validates.
    (
        "VfioDeviceConfig LegacyOnly",
        {"apiVersion": AMD_V1ALPHA1, "kind": "VfioDeviceConfig", "iommu": {"backendPolicy": "LegacyOnly"}},
        AMD_VFIO_REFUSED,
    ),
    (
        "VfioDeviceConfig PreferIommuFD",
        {"apiVersion": AMD_V1ALPHA1, "kind": "VfioDeviceConfig", "iommu": {"backendPolicy": "PreferIommuFD"}},
        AMD_VFIO_REFUSED,
    ),
    ("VfioDeviceConfig bare", {"apiVersion": AMD_V1ALPHA1, "kind": "VfioDeviceConfig"}, AMD_VFIO_REFUSED),
]

AMD_BAD: list[tuple[str, dict[str, Any], str]] = [
    (
        "our unreleased group",
        {"apiVersion": "gpu.amd.com/v1alpha1", "kind": "GpuConfig"},
        message("apiVersion", "gpu.amd.com/v1alpha1", AMD_V1ALPHA1),
    ),
    (
        "another version",
        {"apiVersion": "gpu.resource.amd.com/v1beta1", "kind": "GpuConfig"},
        message("apiVersion", "gpu.resource.amd.com/v1beta1", AMD_V1ALPHA1),
    ),
    ("no apiVersion", {"kind": "GpuConfig"}, message("apiVersion", None, AMD_V1ALPHA1)),
    (
        "NVIDIA's group",
        {"apiVersion": NV_V1BETA1, "kind": "GpuConfig"},
        message("apiVersion", NV_V1BETA1, AMD_V1ALPHA1),
    ),
    (
        "unknown kind",
        {"apiVersion": AMD_V1ALPHA1, "kind": "MigDeviceConfig"},
        message("kind", "MigDeviceConfig", "GpuConfig"),
    ),
    ("no kind", {"apiVersion": AMD_V1ALPHA1}, message("kind", None, "GpuConfig")),
    (
        "sharing is not AMD's",
        {"apiVersion": AMD_V1ALPHA1, "kind": "GpuConfig", "sharing": {"enabled": False}},
        message("field sharing", {"enabled": False}, AMD_FIELDS),
    ),
    (
        "a VFIO field on GpuConfig",
        {"apiVersion": AMD_V1ALPHA1, "kind": "GpuConfig", "iommu": {"backendPolicy": "LegacyOnly"}},
        message("field iommu", {"backendPolicy": "LegacyOnly"}, AMD_FIELDS),
    ),
    (
        "metadata",
        {"apiVersion": AMD_V1ALPHA1, "kind": "GpuConfig", "metadata": {"name": "x"}},
        message("field metadata", {"name": "x"}, AMD_FIELDS),
    ),
]


@pytest.mark.parametrize(
    ("params", "expected"),
    [(p, e) for _, p, e in AMD_PUBLISHED + AMD_BAD],
    ids=[n for n, _, _ in AMD_PUBLISHED + AMD_BAD],
)
def test_amd_configs(params: dict[str, Any], expected: str) -> None:
    """AMD's ``api.go``/``api_test.go`` (ROCm/k8s-gpu-dra-driver): accepted, or the exact error."""
    if not expected:
        assert amd(params) == "GpuConfig"
        return
    with pytest.raises(DeviceConfigError) as caught:
        amd(params)
    assert str(caught.value) == expected
    assert caught.value.claim == CLAIM


# NVIDIA ---------------------------------------------------------------------------------------

GI = 1024**3


def not_supported(kind: str, what: str) -> str:
    return message(
        "kind", kind, f"GpuConfig or MigDeviceConfig: {kind} ({what}) is not supported by this driver"
    )


NV_PUBLISHED: list[tuple[str, dict[str, Any], NvSharing | str]] = [
    # api.go/gpuconfig.go DefaultGpuConfig(), migconfig.go DefaultMigDeviceConfig().
    ("default GpuConfig", {"apiVersion": NV_V1BETA1, "kind": "GpuConfig"}, NvSharing()),
    (
        "default MigDeviceConfig",
        {"apiVersion": NV_V1BETA1, "kind": "MigDeviceConfig"},
        NvSharing(kind="MigDeviceConfig"),
    ),
    # demo/specs/quickstart/v1/gpu-test5.yaml and gpu-test6.yaml; docs guides/time-slicing.md.
    (
        "quickstart time-slicing Long",
        {
            "apiVersion": NV_V1BETA1,
            "kind": "GpuConfig",
            "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}},
        },
        NvSharing(strategy=TIME_SLICING, interval="Long"),
    ),
    # tests/bats/specs/gpu-timeslicing.yaml
    (
        "bats time-slicing Short",
        {
            "apiVersion": NV_V1BETA1,
            "kind": "GpuConfig",
            "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Short"}},
        },
        NvSharing(strategy=TIME_SLICING, interval="Short"),
    ),
    # demo/specs/quickstart/v1/gpu-test-mps.yaml, gpu-test5.yaml, tests/bats/specs/gpu-mps.yaml,
    # docs guides/mps.md.
    (
        "quickstart MPS",
        {
            "apiVersion": NV_V1BETA1,
            "kind": "GpuConfig",
            "sharing": {
                "strategy": "MPS",
                "mpsConfig": {"defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "10Gi"},
            },
        },
        NvSharing(
            strategy=MPS,
            mps=MpsSettings(active_thread_percentage=50, pinned_memory_limit=Quantity.parse("10Gi")),
        ),
    ),
    # site/content/docs/reference/api.md, GpuConfig with MPS.
    (
        "reference MPS with per-device limit",
        {
            "apiVersion": NV_V1BETA1,
            "kind": "GpuConfig",
            "sharing": {
                "strategy": "MPS",
                "mpsConfig": {
                    "defaultActiveThreadPercentage": 50,
                    "defaultPinnedDeviceMemoryLimit": "4Gi",
                    "defaultPerDevicePinnedMemoryLimit": {"0": "2Gi"},
                },
            },
        },
        NvSharing(
            strategy=MPS,
            mps=MpsSettings(
                active_thread_percentage=50,
                pinned_memory_limit=Quantity.parse("4Gi"),
                per_device_pinned={"0": Quantity.parse("2Gi")},
            ),
        ),
    ),
    # tests/bats/specs/gpu-simple-mig-ts.yaml; docs reference/api.md MigDeviceConfig.
    (
        "bats MIG time-slicing",
        {"apiVersion": NV_V1BETA1, "kind": "MigDeviceConfig", "sharing": {"strategy": "TimeSlicing"}},
        NvSharing(strategy=TIME_SLICING, kind="MigDeviceConfig"),
    ),
    (
        "reference MIG MPS",
        {
            "apiVersion": NV_V1BETA1,
            "kind": "MigDeviceConfig",
            "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}},
        },
        NvSharing(strategy=MPS, kind="MigDeviceConfig", mps=MpsSettings(active_thread_percentage=50)),
    ),
    # sharing.go MpsConfig.MultiUser; docs guides/mps.md: "Defaults to disabled".
    (
        "multiUser false",
        {
            "apiVersion": NV_V1BETA1,
            "kind": "GpuConfig",
            "sharing": {"strategy": "MPS", "mpsConfig": {"multiUser": False}},
        },
        NvSharing(strategy=MPS),
    ),
    # demo/specs/quickstart/v1/gpu-test-vfio-config.yaml
    (
        "quickstart VfioDeviceConfig",
        {
            "apiVersion": NV_V1BETA1,
            "kind": "VfioDeviceConfig",
            "iommu": {"backendPolicy": "LegacyOnly", "enableAPIDevice": True},
        },
        not_supported("VfioDeviceConfig", "VFIO passthrough to virtual machines"),
    ),
    # tests/bats/specs/rc-opaque-cfg-unknown-field.yaml.tmpl: refused by its kind before its fields.
    (
        "bats ComputeDomainChannelConfig",
        {
            "apiVersion": NV_V1BETA1,
            "domainID": "not-needed-for-test",
            "kind": "ComputeDomainChannelConfig",
            "unexpectedField": "foo",
        },
        not_supported(
            "ComputeDomainChannelConfig", "an IMEX channel of NVIDIA's compute-domain.nvidia.com driver"
        ),
    ),
    # computedomainconfig.go ComputeDomainDaemonConfig{DomainID}.
    (
        "ComputeDomainDaemonConfig",
        {"apiVersion": NV_V1BETA1, "kind": "ComputeDomainDaemonConfig", "domainID": "uid"},
        not_supported(
            "ComputeDomainDaemonConfig", "an IMEX daemon of NVIDIA's compute-domain.nvidia.com driver"
        ),
    ),
    # docs reference/api.md: ComputeDomain is a custom resource of the same group.
    (
        "ComputeDomain",
        {"apiVersion": NV_V1BETA1, "kind": "ComputeDomain", "spec": {"numNodes": 0}},
        not_supported(
            "ComputeDomain",
            "a custom resource of NVIDIA's compute-domain.nvidia.com driver, not a device config",
        ),
    ),
]

MPS_FIELDS = (
    "only the fields defaultActiveThreadPercentage, defaultPerDevicePinnedMemoryLimit, "
    "defaultPinnedDeviceMemoryLimit, multiUser"
)


def mps(**fields: object) -> dict[str, Any]:
    return {
        "apiVersion": NV_V1BETA1,
        "kind": "GpuConfig",
        "sharing": {"strategy": "MPS", "mpsConfig": fields},
    }


NV_BAD: list[tuple[str, dict[str, Any], str]] = [
    (
        "classic DRA parameters",
        {"apiVersion": "gpu.resource.nvidia.com/v1alpha1", "kind": "GpuClaimParameters"},
        message(
            "apiVersion",
            "gpu.resource.nvidia.com/v1alpha1",
            f"{NV_V1BETA1} (gpu.resource.nvidia.com/v1alpha1 is classic DRA's claim parameters: "
            f"put its sharing in a {NV_V1BETA1} GpuConfig or MigDeviceConfig)",
        ),
    ),
    (
        "v1alpha1",
        {"apiVersion": "resource.nvidia.com/v1alpha1", "kind": "GpuConfig"},
        message("apiVersion", "resource.nvidia.com/v1alpha1", NV_V1BETA1),
    ),
    (
        "unknown kind",
        {"apiVersion": NV_V1BETA1, "kind": "GpuClaimParameters"},
        message("kind", "GpuClaimParameters", "GpuConfig or MigDeviceConfig"),
    ),
    (
        "unknown top-level field",
        {"apiVersion": NV_V1BETA1, "kind": "GpuConfig", "iommu": {}},
        message("field iommu", {}, "only the fields apiVersion, kind, sharing"),
    ),
    (
        "unknown mpsConfig field",
        mps(defaultActiveThreads=50),
        message("field sharing.mpsConfig.defaultActiveThreads", 50, MPS_FIELDS),
    ),
    (
        "multiUser true",
        mps(multiUser=True),
        message(
            "sharing.mpsConfig.multiUser",
            True,
            "false or no multiUser: a multi-user MPS control daemon (nvidia-cuda-mps-control -M) "
            "is not supported by this driver",
        ),
    ),
    (
        "percentage 101",
        mps(defaultActiveThreadPercentage=101),
        message("sharing.mpsConfig.defaultActiveThreadPercentage", 101, "an integer from 1 to 100"),
    ),
    (
        "percentage -1",
        mps(defaultActiveThreadPercentage=-1),
        message("sharing.mpsConfig.defaultActiveThreadPercentage", -1, "an integer from 1 to 100"),
    ),
    (
        "limit under 1Mi",
        mps(defaultPinnedDeviceMemoryLimit="1023Ki"),
        message("sharing.mpsConfig.defaultPinnedDeviceMemoryLimit", "1023Ki", "a quantity of at least 1Mi"),
    ),
    (
        "per-device limit not a quantity",
        mps(defaultPerDevicePinnedMemoryLimit={"0": "lots"}),
        message("sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit[0]", "lots", "a quantity such as 4Gi"),
    ),
    (
        "interval",
        {
            "apiVersion": NV_V1BETA1,
            "kind": "GpuConfig",
            "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "VeryLong"}},
        },
        message("sharing.timeSlicingConfig.interval", "VeryLong", "Default | Short | Medium | Long"),
    ),
    (
        "MIG with an interval",
        {
            "apiVersion": NV_V1BETA1,
            "kind": "MigDeviceConfig",
            "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}},
        },
        message(
            "sharing.timeSlicingConfig",
            {"interval": "Long"},
            "no timeSlicingConfig for MigDeviceConfig (MIG devices take the default interval)",
        ),
    ),
    (
        "no strategy",
        {"apiVersion": NV_V1BETA1, "kind": "GpuConfig", "sharing": {}},
        message("sharing.strategy", None, "TimeSlicing or MPS"),
    ),
    (
        "ComputeDomainClique",
        {"apiVersion": NV_V1BETA1, "kind": "ComputeDomainClique"},
        not_supported(
            "ComputeDomainClique",
            "a custom resource of NVIDIA's compute-domain.nvidia.com driver, not a device config",
        ),
    ),
]


@pytest.mark.parametrize(
    ("params", "expected"),
    [(p, e) for _, p, e in NV_PUBLISHED + NV_BAD],
    ids=[n for n, _, _ in NV_PUBLISHED + NV_BAD],
)
def test_nvidia_configs(params: dict[str, Any], expected: NvSharing | str) -> None:
    """NVIDIA's ``api/nvidia.com/resource/v1beta1`` types, quickstart and bats specs: settings or error."""
    if isinstance(expected, NvSharing):
        assert nvidia(params) == expected
        return
    with pytest.raises(DeviceConfigError) as caught:
        nvidia(params)
    assert str(caught.value) == expected


def test_nvidia_limits_as_json_numbers() -> None:
    """``sharing.go``: the limits are ``resource.Quantity``, which also reads a JSON number."""
    parsed = nvidia(mps(defaultPinnedDeviceMemoryLimit=1e9, defaultPerDevicePinnedMemoryLimit={"0": 2 * GI}))
    assert parsed.mps.pinned_memory_limit is not None
    assert parsed.mps.pinned_memory_limit.value == 10**9
    assert parsed.mps.per_device_pinned["0"].value == 2 * GI
    assert parsed.strategy == MPS


# Whole prepares -------------------------------------------------------------------------------

AMD_GPU_CONFIG = {"apiVersion": AMD_V1ALPHA1, "kind": "GpuConfig"}
AMD_VFIO = {"apiVersion": AMD_V1ALPHA1, "kind": "VfioDeviceConfig", "iommu": {"backendPolicy": "LegacyOnly"}}


def cdi_spec(root: Path, driver: str, n: int) -> Path:
    return root / "cdi" / f"k8s.{driver}-claim_{uid(n)}.yaml"


async def test_amd_gpu_config_prepares_through_the_fake_backend(tmp_path: Path) -> None:
    """AMD's ``GpuConfig`` (``api.go`` DefaultGpuConfig) on a shared MI300X share: prepared, then undone.

    Fails on the code before issue 24, which wanted ``gpu.amd.com/v1alpha1``.
    """
    good = claim(1, driver=AMD, device="gpu-1-128", share_id=share(1), memory="16Gi", config=AMD_GPU_CONFIG)
    other = claim(2, driver=AMD, device="gpu-1-128", share_id=share(2), memory="16Gi")
    state = device_state(
        tmp_path, FakeClaimSource([good, other]), fake_backend(tmp_path, profile="amd-mi300x-8x")
    )
    await state.start()
    results = await state.prepare([ref(good), ref(other)])
    assert [r.error for r in results.values()] == ["", ""]
    assert cdi_spec(tmp_path, AMD, 1).exists()
    assert set(state.store.entries()) == {uid(1), uid(2)}
    await state.unprepare([ref(good), ref(other)])
    assert state.store.entries() == {}


async def test_amd_vfio_config_fails_naming_the_kind_and_changes_nothing(tmp_path: Path) -> None:
    """AMD's ``VfioDeviceConfig`` (``api.go`` DefaultVfioDeviceConfig): refused, nothing prepared."""
    bad = claim(1, driver=AMD, device="gpu-1-128", config=AMD_VFIO)
    state = device_state(tmp_path, FakeClaimSource([bad]), fake_backend(tmp_path, profile="amd-mi300x-8x"))
    await state.start()
    error = (await state.prepare([ref(bad)]))[uid(1)].error
    assert AMD_VFIO_REFUSED in error
    assert state.store.entries() == {}
    assert not cdi_spec(tmp_path, AMD, 1).exists()


class HostDev:
    """A host /dev with the nodes of one MI300X (card 1, renderD128) for the AMD backend's stat."""

    NODES = {"/dev/kfd": (235, 0), "/dev/dri/card1": (226, 1), "/dev/dri/renderD128": (226, 128)}

    def __call__(self, path: str) -> os.stat_result:
        if path not in self.NODES:
            raise FileNotFoundError(path)
        major, minor = self.NODES[path]
        mode = stat.S_IFCHR | 0o666
        return os.stat_result((mode, 0, 0, 0, 0, 0, 0, 0, 0, 0), {"st_rdev": os.makedev(major, minor)})


@pytest.mark.parametrize(("config", "refused"), [(AMD_GPU_CONFIG, ""), (AMD_VFIO, AMD_VFIO_REFUSED)])
async def test_amd_backend_prepare_with_amd_configs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config: dict[str, Any], refused: str
) -> None:
    """The real AMD backend over the real amdsmi and the stand-in library: AMD's GpuConfig prepares,
    its VfioDeviceConfig does not.

    Kinds from ``api/amd.com/resource/gpu/v1alpha1/api.go`` of ROCm/k8s-gpu-dra-driver.
    """
    load().configure(mi300x(count=1))
    backend = AmdBackend(
        BackendOptions(NODE, None, {"sysfs-root": os.devnull}), clock=FakeClock(), stat_fn=HostDev()
    )
    await backend.start()
    try:
        assert [d.name for d in await backend.discover()] == ["gpu-1-128"]
        c = claim(1, driver=AMD, device="gpu-1-128", config=config)
        state = DeviceState(
            AMD,
            backend,
            FakeClaimSource([c]),
            node_name=NODE,
            cdi_root=tmp_path / "cdi",
            state_dir=tmp_path / "state",
            boot_id="boot-1",
        )
        await state.start()
        error = (await state.prepare([ref(c)]))[uid(1)].error
        if refused:
            assert refused in error
            assert state.store.entries() == {}
            assert not cdi_spec(tmp_path, AMD, 1).exists()
        else:
            assert error == ""
            assert "/dev/dri/renderD128" in cdi_spec(tmp_path, AMD, 1).read_text()
            await state.unprepare([ref(c)])
            assert state.store.entries() == {}
    finally:
        await backend.stop()


def case(table: list[tuple[str, dict[str, Any], Any]], name: str) -> tuple[dict[str, Any], Any]:
    (found,) = [(params, expected) for n, params, expected in table if n == name]
    return found


@pytest.mark.parametrize(
    ("config", "refused"),
    [case(NV_PUBLISHED, "quickstart VfioDeviceConfig"), case(NV_BAD, "multiUser true")],
    ids=["VfioDeviceConfig", "multiUser"],
)
async def test_nvidia_refused_configs_apply_nothing(
    tmp_path: Path, config: dict[str, Any], refused: str
) -> None:
    """NVIDIA's ``VfioDeviceConfig`` (quickstart ``gpu-test-vfio-config.yaml``) and ``multiUser: true``
    (``api/nvidia.com/resource/v1beta1/sharing.go``): the claim fails with the exact error; no
    daemon, no time slice, no checkpoint entry, no CDI spec."""
    bad = claim(1, config=config)
    state = device_state(tmp_path, FakeClaimSource([bad]), fake_backend(tmp_path))
    await state.start()
    error = (await state.prepare([ref(bad)]))[uid(1)].error
    assert refused in error
    assert state.store.entries() == {}
    assert not cdi_spec(tmp_path, NVIDIA, 1).exists()
    assert daemon_state(tmp_path) is None and intervals(tmp_path) == {}
