"""CDI modes: ``auto`` picks the toolkit's spec when it names the GPU by UUID, ``toolkit`` fails the claim
when it cannot, and every start logs the mode it chose.

The toolkit's spec is read through the agent's view of the host (``host-root``) in ``/etc/cdi`` and
``/var/run/cdi``, as the CDI library reads it; ``nvidia-ctk cdi generate`` names devices by index
(``0``, ``1:0``) and, from the toolkit's ``--device-name-strategy=index,uuid`` default on, by UUID.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from agent.claims.cdi import CdiDevice, build_claim_spec
from agent.core.backend import ClaimRef, PlansPrepare, nothing_to_undo
from agent.core.errors import BackendError, DeviceNotFoundError
from backends.nvidia.driverfiles import HostView
from backends.nvidia.toolkitspec import ToolkitSpecReader
from tests.fakes.libnvml import LibNvml
from tests.nvidia.conftest import BackendFactory
from tests.nvidia.hostfs import logged, make_driver_root, write_toolkit_spec
from tests.support.cdi_check import cdi_problems

CLAIM = ClaimRef("default", "claim", "uid-1")
H100 = "GPU-h1000002-0000-0000-0000-000000000000"
MIG = "gpu-0-mig-3g40gb-9-4"
MIG_UUID = "MIG-a1000000-0001-0000-0000-000000000000"
ALL_UUIDS = [
    H100,
    MIG_UUID,
    "GPU-a1000000-0000-0000-0000-000000000000",
    "GPU-l4000003-0000-0000-0000-000000000000",
]


@pytest.fixture
def host(tmp_path: Path) -> Path:
    """The host's filesystem: a driver installed at /, device nodes for gpu-2."""
    make_driver_root(tmp_path / "host")
    for node in ("nvidia2", "nvidiactl"):
        (tmp_path / "dev").mkdir(exist_ok=True)
        (tmp_path / "dev" / node).touch()
    return tmp_path / "host"


async def test_auto_refers_to_the_toolkits_devices_when_its_spec_names_the_gpus_by_uuid(
    make_backend: BackendFactory, fake: LibNvml, host: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spec = write_toolkit_spec(host / "var/run/cdi", ["0", "1", "all", *ALL_UUIDS])
    backend = make_backend(fake)
    assert backend.cdi_mode == "auto"
    with caplog.at_level(logging.INFO):
        await backend.start()
    fields = logged(caplog.records, "NVIDIA CDI mode chosen")
    assert fields["setting"] == "auto" and fields["mode"] == "toolkit"
    assert str(fields["reason"]).endswith("/var/run/cdi/nvidia.yaml")
    gpu = await backend.prepare("gpu-2", CLAIM)
    mig = await backend.prepare(MIG, CLAIM)
    await backend.stop()
    assert backend.active_cdi_mode == "toolkit"
    assert gpu.cdi_device_ids == (f"nvidia.com/gpu={H100}",)
    assert gpu.device_nodes == () and gpu.mounts == () and gpu.hooks == ()
    assert dict(gpu.env) == {"NVIDIA_VISIBLE_DEVICES": "void"}  # the toolkit runtime adds nothing
    assert mig.cdi_device_ids == (f"nvidia.com/gpu={MIG_UUID}",)
    claim_spec = build_claim_spec("gpu.nvidia.com", [CdiDevice("uid-1-gpu-2", gpu)])
    assert cdi_problems(claim_spec) == []
    assert spec.exists()


@pytest.mark.parametrize(
    ("names", "reasons"),
    [
        (None, ["no NVIDIA Container Toolkit CDI spec (kind nvidia.com/gpu)"]),
        # An older nvidia-ctk: ``nvidia.com/gpu=<uuid>`` would be unresolvable at container start.
        (["0", "1", "2", "3", "0:0", "all"], ["names devices by index only", "--device-name-strategy=uuid"]),
    ],
)
async def test_auto_generates_its_own_without_a_spec_naming_gpus_by_uuid(
    make_backend: BackendFactory,
    fake: LibNvml,
    host: Path,
    caplog: pytest.LogCaptureFixture,
    *,
    names: list[str] | None,
    reasons: list[str],
) -> None:
    if names is not None:
        write_toolkit_spec(host / "etc/cdi", names)
    backend = make_backend(fake)
    with caplog.at_level(logging.INFO):
        await backend.start()
    fields = logged(caplog.records, "NVIDIA CDI mode chosen")
    assert fields["mode"] == "own"
    assert all(reason in str(fields["reason"]) for reason in reasons)
    edits = await backend.prepare("gpu-2", CLAIM)
    await backend.stop()
    assert edits.cdi_device_ids == () and edits.hooks and edits.mounts


async def test_auto_checks_again_at_prepare_and_falls_back_when_the_spec_lost_the_gpu(
    make_backend: BackendFactory, fake: LibNvml, host: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spec = write_toolkit_spec(host / "var/run/cdi", ALL_UUIDS)
    backend = make_backend(fake)
    await backend.start()
    assert backend.active_cdi_mode == "toolkit"
    write_toolkit_spec(host / "var/run/cdi", [u for u in ALL_UUIDS if u != H100])
    with caplog.at_level(logging.WARNING):
        edits = await backend.prepare("gpu-2", CLAIM)
    assert edits.cdi_device_ids == () and edits.device_nodes
    fields = logged(caplog.records, "NVIDIA CDI mode changed")
    assert fields["previous"] == "toolkit" and fields["mode"] == "own" and fields["device"] == "gpu-2"
    assert f"has no device {H100}" in str(fields["reason"])
    # The toolkit's spec comes back (the GPU Operator regenerated it): claims refer to it again.
    spec.unlink()
    write_toolkit_spec(host / "var/run/cdi", ALL_UUIDS, name="nvidia-container-toolkit.json")
    again = await backend.prepare("gpu-2", ClaimRef("default", "other", "uid-2"))
    await backend.stop()
    assert again.cdi_device_ids == (f"nvidia.com/gpu={H100}",)
    assert backend.active_cdi_mode == "toolkit"


async def test_own_mode_never_reads_the_toolkits_spec(
    make_backend: BackendFactory, fake: LibNvml, host: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_toolkit_spec(host / "var/run/cdi", ALL_UUIDS)
    backend = make_backend(fake, cdi_mode="own")
    with caplog.at_level(logging.INFO):
        await backend.start()
    fields = logged(caplog.records, "NVIDIA CDI mode chosen")
    assert fields == {"driver": "gpu.nvidia.com", "setting": "own", "mode": "own", "reason": "cdi-mode=own"}
    edits = await backend.prepare("gpu-2", CLAIM)
    await backend.stop()
    assert edits.cdi_device_ids == ()


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (None, r"no NVIDIA Container Toolkit CDI spec .*'nvidia-ctk cdi generate --output=/var/run/cdi"),
        (["0", "1", "2", "all"], r"names devices by index only .*--device-name-strategy=uuid"),
        (ALL_UUIDS[1:], f"has no device {H100}: .*regenerate it"),
    ],
)
async def test_toolkit_mode_fails_the_claim_when_the_spec_cannot_resolve(
    make_backend: BackendFactory,
    fake: LibNvml,
    host: Path,
    caplog: pytest.LogCaptureFixture,
    *,
    names: list[str] | None,
    message: str,
) -> None:
    if names is not None:
        write_toolkit_spec(host / "var/run/cdi", names)
    backend = make_backend(fake, cdi_mode="toolkit")
    with caplog.at_level(logging.INFO):
        await backend.start()
    if names is None or names[0] == "0":
        # The start already says so; the claims fail until the spec is fixed.
        fields = logged(caplog.records, "NVIDIA CDI mode toolkit: claims fail")
        assert fields["mode"] == "toolkit"
    with pytest.raises(
        BackendError, match=r"cdi-mode=toolkit cannot give gpu-2 \(GPU-h1000002-[^)]*\) .*" + message
    ):
        await backend.prepare("gpu-2", CLAIM)
    await backend.stop()


async def test_toolkit_mode_serves_once_the_spec_appears(
    make_backend: BackendFactory, fake: LibNvml, host: Path
) -> None:
    """The GPU Operator's toolkit may write its spec after the agent started."""
    backend = make_backend(fake, cdi_mode="toolkit")
    await backend.start()
    with pytest.raises(BackendError):
        await backend.prepare("gpu-2", CLAIM)
    write_toolkit_spec(host / "etc/cdi", ALL_UUIDS)
    edits = await backend.prepare("gpu-2", CLAIM)
    await backend.stop()
    assert edits.cdi_device_ids == (f"nvidia.com/gpu={H100}",)


def test_reader_skips_other_kinds_transient_specs_and_reports_broken_files(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "var/run/cdi"
    write_toolkit_spec(run, ["GPU-1"], name="nvidia.yaml")
    write_toolkit_spec(run, ["GPU-2"], name="other.json", kind="vendor.example.com/device")
    write_toolkit_spec(run, ["GPU-3"], name="management.yaml", kind="management.nvidia.com/gpu")
    # A DRA driver's transient claim spec, even one that names the kind, is never the toolkit's.
    write_toolkit_spec(run, ["GPU-4"], name="k8s.gpu.nvidia.com-claim_uid.yaml")
    (run / "broken.yaml").write_text("kind: [unclosed\n")
    (run / "notes.txt").write_text("not a spec")
    (run / "deep.json").write_text("[" * 20000 + "]" * 20000)
    reader = ToolkitSpecReader(HostView(tmp_path))
    monkeypatch.setattr("backends.nvidia.toolkitspec.MAX_SPEC_BYTES", 100)
    with caplog.at_level(logging.WARNING):
        found = reader.read()
    assert found.files == ()  # nvidia.yaml is over the (patched) bound too
    assert any("larger than 100 bytes" in p for p in found.problems)
    monkeypatch.setattr("backends.nvidia.toolkitspec.MAX_SPEC_BYTES", 1 << 20)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        found = reader.read()
    assert found.files == ("/var/run/cdi/nvidia.yaml",)
    assert found.names == {"GPU-1"} and found.by_uuid
    assert [p.split(":")[0] for p in found.problems] == ["/var/run/cdi/broken.yaml", "/var/run/cdi/deep.json"]
    assert "cannot read a CDI spec file" in caplog.text


def test_reader_reparses_only_changed_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_toolkit_spec(tmp_path / "etc/cdi", ["GPU-1"])
    reader = ToolkitSpecReader(HostView(tmp_path))
    assert reader.read().names == {"GPU-1"}
    parses: list[Path] = []
    original = ToolkitSpecReader._parse

    def counting(path: Path, info: os.stat_result) -> frozenset[str] | None:
        parses.append(path)
        return original(path, info)

    monkeypatch.setattr(ToolkitSpecReader, "_parse", staticmethod(counting))
    assert reader.read().names == {"GPU-1"}
    assert parses == []
    write_toolkit_spec(tmp_path / "etc/cdi", ["GPU-1", "GPU-22"])
    assert reader.read().names == {"GPU-1", "GPU-22"}
    assert parses == [path]


async def test_the_hosts_var_run_symlink_is_followed_inside_the_host_root(
    make_backend: BackendFactory, fake: LibNvml, host: Path
) -> None:
    """Ubuntu's ``/var/run -> /run`` is absolute: read through /host it must stay in the host's tree."""
    write_toolkit_spec(host / "run/cdi", ALL_UUIDS)
    (host / "var").mkdir(exist_ok=True)
    (host / "var/run").symlink_to("/run")
    backend = make_backend(fake)
    await backend.start()
    edits = await backend.prepare("gpu-2", CLAIM)
    await backend.stop()
    assert edits.cdi_device_ids == (f"nvidia.com/gpu={H100}",)


@pytest.mark.parametrize("toolkit", [True, False], ids=["toolkit-spec", "own-edits"])
async def test_a_planned_prepare_gives_the_edits_of_prepare(
    make_backend: BackendFactory, fake: LibNvml, host: Path, *, toolkit: bool
) -> None:
    """The core runs the plan in its checkpoint's worker thread (`agent.core.backend.PlansPrepare`)."""
    if toolkit:
        write_toolkit_spec(host / "var/run/cdi", ALL_UUIDS)
    backend = make_backend(fake)
    assert isinstance(backend, PlansPrepare)
    await backend.start()
    assert backend.plan_prepare("gpu-2", CLAIM) is None  # not discovered yet: the async prepare
    await backend.discover()
    for device in ("gpu-2", MIG) if toolkit else ("gpu-2",):  # the host has gpu-2's device nodes only
        plan = backend.plan_prepare(device, CLAIM)
        assert plan is not None
        planned = plan()
        assert planned == await backend.prepare(device, ClaimRef("default", "other", "uid-2"))
        assert backend.plan_prepare(device, CLAIM) is not None  # prepared: the same edits again
        assert backend.plan_unprepare(device, CLAIM) is nothing_to_undo
    with pytest.raises(DeviceNotFoundError):
        backend.plan_prepare("gpu-9", CLAIM)
    await backend.stop()


async def test_a_planned_prepare_in_toolkit_mode_fails_like_prepare_when_the_spec_lacks_the_gpu(
    make_backend: BackendFactory, fake: LibNvml, host: Path
) -> None:
    write_toolkit_spec(host / "var/run/cdi", ALL_UUIDS)
    backend = make_backend(fake, cdi_mode="toolkit")
    await backend.start()
    await backend.discover()
    write_toolkit_spec(host / "var/run/cdi", [u for u in ALL_UUIDS if u != H100])
    plan = backend.plan_prepare("gpu-2", CLAIM)
    assert plan is not None
    with pytest.raises(BackendError, match="cdi-mode=toolkit cannot give gpu-2"):
        plan()
    await backend.stop()
