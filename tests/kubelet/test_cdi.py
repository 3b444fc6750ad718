"""CDI spec naming, versions, content and atomic writes."""

from __future__ import annotations

import errno
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

import agent.core.atomicfile
from agent.claims.cdi import (
    EMPTY_EDITS_ENV,
    CdiDevice,
    CdiSpecWriter,
    build_claim_spec,
    cdi_device_name,
    cdi_kind,
    empty_edits_env,
    merged_env,
    minimum_version,
    qualified_device_id,
    render_spec,
    spec_file_name,
)
from agent.core.backend import ContainerEdits, DeviceNode, Mount

DRIVER = "gpu.example.com"
UID = "0b7c6a2e-1111-4222-8333-444455556666"


def test_names() -> None:
    assert cdi_kind(DRIVER) == "k8s.gpu.example.com/claim"
    assert spec_file_name(DRIVER, UID) == f"k8s.gpu.example.com-claim_{UID}.yaml"
    assert cdi_device_name(UID, "gpu-0") == f"{UID}-gpu-0"
    assert cdi_device_name(UID, "gpu-0", "s1") == f"{UID}-gpu-0-s1"
    assert qualified_device_id(DRIVER, "abc-gpu-0") == "k8s.gpu.example.com/claim=abc-gpu-0"


def spec_of(name: str, edits: ContainerEdits) -> dict[str, Any]:
    return build_claim_spec(DRIVER, [CdiDevice(name, edits)])


def test_version_is_lowest_needed() -> None:
    plain = ContainerEdits(device_nodes=(DeviceNode(path="/dev/x"),))
    assert spec_of("a-gpu-0", plain)["cdiVersion"] == "0.3.0"
    assert spec_of("0b-gpu-0", plain)["cdiVersion"] == "0.5.0"
    with_host = ContainerEdits(device_nodes=(DeviceNode(path="/dev/x", host_path="/dev/y"),))
    assert spec_of("a-gpu-0", with_host)["cdiVersion"] == "0.5.0"


@pytest.mark.parametrize(
    ("extra", "version"),
    [
        ({"devices": [{"name": "a", "containerEdits": {"mounts": [{"type": "bind"}]}}]}, "0.4.0"),
        ({"annotations": {"k": "v"}}, "0.6.0"),
        ({"devices": [{"name": "a", "annotations": {"k": "v"}}]}, "0.6.0"),
        ({"kind": "k8s.x/cl.aim"}, "0.6.0"),
        ({"containerEdits": {"additionalGids": [5]}}, "0.7.0"),
        ({"devices": [{"name": "a", "containerEdits": {"intelRdt": {"closID": "c"}}}]}, "0.7.0"),
    ],
)
def test_minimum_version_rules(extra: dict[str, Any], version: str) -> None:
    spec: dict[str, Any] = {"kind": "k8s.x/claim", "devices": [{"name": "a"}], **extra}
    assert minimum_version(spec) == version


def test_content_merges_env_and_keeps_nodes_and_mounts() -> None:
    a = ContainerEdits(
        device_nodes=(DeviceNode("/dev/nvidia0", "/dev/nvidia0", "c", 195, 0, "rw"),),
        env={"VISIBLE": "uuid-a", "MODE": "x"},
        mounts=(Mount("/usr/lib/x.so", "/usr/lib/x.so"),),
        list_env=frozenset({"VISIBLE"}),
    )
    b = ContainerEdits(env={"VISIBLE": "uuid-b", "MODE": "y"}, list_env=frozenset({"VISIBLE"}))
    spec = build_claim_spec(DRIVER, [CdiDevice(f"{UID}-gpu-0", a), CdiDevice(f"{UID}-gpu-1", b)])
    assert spec["kind"] == "k8s.gpu.example.com/claim"
    assert spec["cdiVersion"] == "0.5.0"
    first, second = spec["devices"]
    assert first["containerEdits"] == {
        "env": ["VISIBLE=uuid-a,uuid-b", "MODE=x"],
        "deviceNodes": [
            {
                "path": "/dev/nvidia0",
                "hostPath": "/dev/nvidia0",
                "type": "c",
                "major": 195,
                "minor": 0,
                "permissions": "rw",
            }
        ],
        "mounts": [
            {
                "hostPath": "/usr/lib/x.so",
                "containerPath": "/usr/lib/x.so",
                "options": ["ro", "nosuid", "nodev", "bind"],
            }
        ],
    }
    assert second["containerEdits"] == {"env": ["VISIBLE=uuid-a,uuid-b", "MODE=x"]}


def test_merged_env_dedupes_list_values() -> None:
    edits = [
        ContainerEdits(env={"L": "a,b"}, list_env=frozenset({"L"})),
        ContainerEdits(env={"L": "b,c"}, list_env=frozenset({"L"})),
    ]
    assert merged_env(edits) == {"L": "a,b,c"}
    assert merged_env([]) == {}


def test_device_without_edits_gets_a_marker_env() -> None:
    spec = spec_of("a-gpu-0", ContainerEdits())
    [env] = spec["devices"][0]["containerEdits"]["env"]
    assert env == empty_edits_env(DRIVER, "a-gpu-0")
    name, _, value = env.partition("=")
    assert value == f"k8s.{DRIVER}/claim=a-gpu-0"
    assert re.fullmatch(f"{EMPTY_EDITS_ENV}_[0-9A-F]{{12}}", name)


def test_markers_of_devices_without_edits_never_share_a_variable() -> None:
    """Two such devices in one container (one claim or two, one driver or two) keep both markers."""
    names = {
        empty_edits_env(driver, device).partition("=")[0]
        for driver in (DRIVER, "gpu.other.com")
        for device in ("a-gpu-0", "a-gpu-1", "b-gpu-0")
    }
    assert len(names) == 6
    spec = build_claim_spec(
        DRIVER, [CdiDevice("a-gpu-0", ContainerEdits()), CdiDevice("a-gpu-1", ContainerEdits())]
    )
    envs = [d["containerEdits"]["env"] for d in spec["devices"]]
    assert envs == [[empty_edits_env(DRIVER, "a-gpu-0")], [empty_edits_env(DRIVER, "a-gpu-1")]]


def test_render_starts_with_document_marker_and_parses() -> None:
    spec = spec_of(f"{UID}-gpu-0", ContainerEdits(device_nodes=(DeviceNode("/dev/x"),)))
    text = render_spec(spec).decode()
    assert text.startswith("---\n")
    assert yaml.safe_load(text) == spec
    assert text.index("cdiVersion") < text.index("kind") < text.index("devices")


def test_rendered_json_body_reads_back_as_yaml_with_awkward_values() -> None:
    """The body is JSON, which a YAML 1.1 parser (the CDI library's) must read back unchanged.

    container-device-interface ``pkg/cdi/spec.go`` ``ParseSpec`` unmarshals every spec file as YAML.
    """
    env = {"A": "yes", "B": "0x10", "C": "a: b # c", "D": "é ü 日本", "E": "", "F": "null", "G": '"q"\\'}
    spec = spec_of(f"{UID}-gpu-0", ContainerEdits(env=env, mounts=(Mount("/h:x", "/c #1", ("ro",)),)))
    text = render_spec(spec, {"uid": UID, "note": "ü"}).decode()
    assert yaml.safe_load(text) == spec
    assert yaml.load(text, Loader=yaml.BaseLoader) == spec  # no implicit typing either


def test_writer_writes_lists_and_removes(tmp_path: Path) -> None:
    writer = CdiSpecWriter(tmp_path / "cdi", DRIVER)
    assert writer.claim_spec_uids() == set()
    path = writer.write_claim_spec(UID, [CdiDevice(f"{UID}-gpu-0", ContainerEdits(env={"A": "1"}))])
    assert path == tmp_path / "cdi" / f"k8s.gpu.example.com-claim_{UID}.yaml"
    assert yaml.safe_load(path.read_text())["devices"][0]["name"] == f"{UID}-gpu-0"
    (tmp_path / "cdi" / "k8s.other.com-claim_x.yaml").write_text("---\n")
    assert writer.claim_spec_uids() == {UID}
    assert writer.has_claim_spec(UID)
    assert writer.remove_claim_spec(UID)
    assert not writer.remove_claim_spec(UID)
    assert writer.claim_spec_uids() == set()


def test_failed_write_keeps_old_spec_and_leaves_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writer = CdiSpecWriter(tmp_path, DRIVER)
    writer.write_claim_spec(UID, [CdiDevice("a", ContainerEdits(env={"A": "old"}))])
    before = writer.spec_path(UID).read_bytes()

    def full(fd: int, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(agent.core.atomicfile, "write_all", full)
    with pytest.raises(OSError, match="No space"):
        writer.write_claim_spec(UID, [CdiDevice("a", ContainerEdits(env={"A": "new"}))])
    assert writer.spec_path(UID).read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [writer.spec_path(UID).name]


def test_temp_files_of_a_crash_are_removed(tmp_path: Path) -> None:
    writer = CdiSpecWriter(tmp_path, DRIVER)
    (tmp_path / f".k8s.gpu.example.com-claim_{UID}.yaml.abcd.tmp").write_text("partial")
    (tmp_path / ".other.tmp").write_text("not ours")
    assert writer.remove_temp_files() == 1
    assert [p.name for p in tmp_path.iterdir()] == [".other.tmp"]
    assert CdiSpecWriter(tmp_path / "missing", DRIVER).remove_temp_files() == 0


def test_spec_records_its_claim_in_a_comment_runtimes_ignore(tmp_path: Path) -> None:
    writer = CdiSpecWriter(tmp_path, DRIVER)
    devices = [CdiDevice(f"{UID}-gpu-0", ContainerEdits(device_nodes=(DeviceNode(path="/dev/x"),)))]
    record = {"uid": UID, "namespace": "ns", "name": "c", "devices": [{"device": "gpu-0"}]}
    writer.write_claim_spec(UID, devices, record)
    text = writer.spec_path(UID).read_text()
    assert text.startswith("---\n# dra-agent claim: {")
    # The same document as without the record: same cdiVersion, nothing a runtime would read.
    assert yaml.safe_load(text) == build_claim_spec(DRIVER, devices)
    assert writer.read_claim_record(UID) == record
    writer.write_claim_spec(UID, devices)
    assert writer.read_claim_record(UID) is None


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"---\n# dra-agent claim: {not json\n", "not valid JSON"),
        (b"---\n# dra-agent claim: " + b"[" * 100 + b"]" * 100 + b"\n", "nested more than 64 levels"),
        (b"---\n\xb8\xff garbage\n", "not UTF-8"),
    ],
)
def test_unusable_record_is_a_bounded_file_error(tmp_path: Path, content: bytes, problem: str) -> None:
    from agent.core.boundedfile import BoundedFileError

    writer = CdiSpecWriter(tmp_path, DRIVER)
    writer.spec_path(UID).write_bytes(content)
    with pytest.raises(BoundedFileError, match=problem):
        writer.read_claim_record(UID)


def test_oversized_spec_is_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import agent.claims.cdi
    from agent.core.boundedfile import BoundedFileError

    monkeypatch.setattr(agent.claims.cdi, "MAX_SPEC_BYTES", 64)
    writer = CdiSpecWriter(tmp_path, DRIVER)
    writer.spec_path(UID).write_bytes(b"---\n" + b"#" * 100)
    with pytest.raises(BoundedFileError, match="larger than 64 bytes"):
        writer.read_claim_record(UID)
