from __future__ import annotations

import yaml

from tests.deploy.chart import MANIFESTS, manifest_files


def test_plain_manifests_match_the_chart() -> None:
    expected = manifest_files()
    stale = [path.name for path, text in expected.items() if not path.exists() or path.read_text() != text]
    assert not stale, f"deploy/manifests is out of date ({stale}): run `python -m tests.deploy.chart`"
    extra = sorted(p.name for p in MANIFESTS.glob("*.yaml") if p not in expected)
    assert not extra, f"unexpected files in deploy/manifests: {extra}"


def test_plain_manifests_start_with_the_namespace_and_end_with_the_daemonset() -> None:
    for path in manifest_files():
        kinds = [doc["kind"] for doc in yaml.safe_load_all(path.read_text()) if doc]
        assert kinds[0] == "Namespace"
        assert kinds[-1] == "DaemonSet"
        assert "ServiceMonitor" not in kinds and "PodMonitor" not in kinds
        text = path.read_text()
        assert "helm.sh/chart" not in text and "managed-by" not in text
