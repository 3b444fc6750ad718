"""The committed generated code matches a fresh generation from our protos."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from agent.kubelet import protogen
from agent.kubelet._protos import v1 as short_v1
from agent.kubelet._protos.k8s.io.kubelet.pkg.apis.dra import v1, v1beta1


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One fresh generation shared by the tests (protoc + betterproto takes about a second)."""
    out = tmp_path_factory.mktemp("fresh")
    protogen.generate(out)
    return out


@pytest.fixture
def reuse_fresh(fresh: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make `protogen.generate` copy the shared fresh tree instead of running protoc again."""

    def generate(out_dir: Path, proto_root: Path = protogen.PROTO_ROOT, files: object = None) -> None:
        shutil.copytree(fresh, out_dir, dirs_exist_ok=True)

    monkeypatch.setattr(protogen, "generate", generate)


def test_committed_code_is_up_to_date(fresh: Path) -> None:
    diff = protogen.compare(protogen.OUTPUT_DIR, fresh)
    assert not diff, f"run 'make protos' and commit agent/kubelet/_protos: {diff.describe()}"


@pytest.mark.usefixtures("reuse_fresh")
def test_main_check(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert protogen.main(["--check"]) == 0
    assert "up to date" in capsys.readouterr().out
    monkeypatch.setattr(protogen, "OUTPUT_DIR", tmp_path / "nothing")
    assert protogen.main(["--check"]) == 1
    assert "out of date" in capsys.readouterr().err


def test_check_reports_missing_extra_and_changed_files(tmp_path: Path, fresh: Path) -> None:
    copy = tmp_path / "_protos"
    shutil.copytree(protogen.OUTPUT_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "v1alpha1" / "__init__.py").write_text("# edited by hand\n")
    (copy / "pluginregistration" / "__init__.py").unlink()
    (copy / "stray.py").write_text("")
    diff = protogen.compare(copy, fresh)
    assert diff.changed == ("v1alpha1/__init__.py",)
    assert diff.missing == ("pluginregistration/__init__.py",)
    assert diff.extra == ("stray.py",)
    assert "changed: v1alpha1/__init__.py" in diff.describe()


@pytest.mark.usefixtures("reuse_fresh")
def test_regenerate_replaces_the_tree(tmp_path: Path, fresh: Path) -> None:
    target = tmp_path / "out"
    target.mkdir()
    (target / "stale.py").write_text("")
    diff = protogen.regenerate(target)
    assert diff.extra == ("stale.py",) and diff.missing
    assert not protogen.compare(target, fresh)


def test_broken_proto_fails_clearly(tmp_path: Path) -> None:
    protos = tmp_path / "protos"
    shutil.copytree(protogen.PROTO_ROOT, protos)
    (protos / "dra" / "v1" / "api.proto").write_text('syntax = "proto3";\nmessage {')
    with pytest.raises(protogen.ProtoGenError, match="protoc failed"):
        protogen.generate(tmp_path / "out", protos)


def test_missing_plugin_fails_clearly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(protogen, "PLUGIN", "protoc-gen-does-not-exist")
    with pytest.raises(protogen.ProtoGenError, match="not found"):
        protogen.generate(tmp_path / "out")


def test_generated_code_has_explicit_presence_and_maps() -> None:
    # proto3 `optional string share_id = 5`: unset is not sent, "" is sent.
    assert v1.Device().share_id is None
    assert bytes(v1.Device()) == b""
    assert bytes(v1.Device(share_id="")) == b"\x2a\x00"
    assert not hasattr(v1beta1.Device(), "share_id")
    answer = v1.NodePrepareResourcesResponse(claims={"u": v1.NodePrepareResourceResponse(error="e")})
    assert v1.NodePrepareResourcesResponse().parse(bytes(answer)).claims["u"].error == "e"


def test_health_v1_shares_the_short_v1_package_with_podresources() -> None:
    # dra_health/v1 and podresources/v1 are both `package v1;` (as upstream), so betterproto
    # writes one module for the two; the health service's path must still be /v1.DRAResourceHealth.
    assert "dra_health/v1/api.proto" in protogen.PROTO_FILES
    header = (protogen.OUTPUT_DIR / "v1" / "__init__.py").read_text().splitlines()[1]
    assert header == "# sources: dra_health/v1/api.proto, podresources/v1/api.proto"
    assert hasattr(short_v1, "PodResourcesListerStub") and hasattr(short_v1, "DraResourceHealthStub")
    paths = set(short_v1.DraResourceHealthBase().__mapping__())
    assert paths == {"/v1.DRAResourceHealth/NodeWatchResources"}
