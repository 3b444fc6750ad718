"""The package layers of `agent/` and who may import whom, read from every module's AST.

Layers, lowest first: core -> observe -> health -> claims / kube -> kubelet -> the process modules
(app, runner, config, cli, demo). A layer imports only the layers below it; `kube`, `claims` and
`kubelet` never import each other's internals (the kubelet reaches claims through
`agent.claims.preparer` alone). Backends import only `agent.core`. The API emulator serves tests and
the demo: nothing else in `agent/` imports it, and the demo reaches backends only through the
backend protocol.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: Package -> the `agent.*` prefixes its modules may import (their own package included).
ALLOWED: dict[str, tuple[str, ...]] = {
    "agent.core": ("agent.core",),
    "agent.observe": ("agent.core", "agent.observe"),
    "agent.health": ("agent.core", "agent.observe", "agent.health"),
    "agent.claims": ("agent.core", "agent.observe", "agent.claims"),
    "agent.kube": ("agent.core", "agent.observe", "agent.health", "agent.kube"),
    "agent.kubelet": (
        "agent.core",
        "agent.observe",
        "agent.health",
        "agent.claims.preparer",
        "agent.kubelet",
    ),
    "agent.emulator": ("agent.core", "agent.emulator"),
    "backends": ("agent.core",),
}
PROCESS_MODULES = {
    "agent.app",
    "agent.runner",
    "agent.config",
    "agent.preflight",
    "agent.cli",
    "agent.demo",
    "agent.__init__",
}
LAYER_PACKAGES = ("core", "observe", "health", "claims", "kube", "kubelet")


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _modules() -> Iterator[Path]:
    for top in ("agent", "backends"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if "_protos" not in path.parts:
                yield path


def _imports(path: Path) -> Iterator[tuple[int, str]]:
    """Absolute names of every `agent.*`/`backends.*` import (relative imports resolved)."""
    package = _module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = parts[: len(parts) - node.level + 1]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            # `from agent.x import y` may import the sub-module `agent.x.y`.
            for alias in node.names:
                yield node.lineno, f"{name}.{alias.name}" if name in {"agent", "backends"} else name


def _owner(module: str) -> str | None:
    """The layer a module belongs to, or None for process modules."""
    if module.startswith("backends"):
        return "backends"
    parts = module.split(".")
    if len(parts) >= 2 and (parts[1] in LAYER_PACKAGES or parts[1] == "emulator"):
        return f"agent.{parts[1]}"
    return None


def _is_within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations() -> list[str]:
    found: list[str] = []
    for path in _modules():
        module = _module_name(path)
        owner = _owner(module)
        for lineno, name in _imports(path):
            where = f"{path.relative_to(ROOT)}:{lineno} imports {name}"
            if name == "agent.__version__":
                continue  # the package's version string, nothing else lives in agent/__init__.py
            if owner == "backends":
                if _is_within(name, "agent") and not _is_within(name, "agent.core"):
                    found.append(f"{where}: backends import only agent.core")
                continue
            if not _is_within(name, "agent"):
                if module == "agent.demo" and _is_within(name, "backends"):
                    found.append(f"{where}: the demo reaches backends through the backend protocol")
                continue
            if _is_within(name, "agent.emulator") and owner != "agent.emulator" and module != "agent.demo":
                found.append(f"{where}: only the demo and tests import the API emulator")
                continue
            if owner is None:
                continue
            if not any(_is_within(name, prefix) for prefix in ALLOWED[owner]):
                found.append(f"{where}: {owner} may import only {', '.join(ALLOWED[owner])}")
    return found


def test_layers_import_only_downwards() -> None:
    assert violations() == []


def test_every_module_belongs_to_a_layer_or_the_process() -> None:
    stray = [
        _module_name(path)
        for path in _modules()
        if path.parent == ROOT / "agent" and _module_name(path) not in PROCESS_MODULES
    ]
    assert stray == [], "agent/ top level keeps only the process modules"


def test_every_layer_package_says_what_it_may_import() -> None:
    for name in (*LAYER_PACKAGES, "emulator"):
        doc = ast.get_docstring(ast.parse((ROOT / "agent" / name / "__init__.py").read_text()))
        assert doc, f"agent/{name}/__init__.py needs a docstring"
        if name != "emulator":
            assert "Imports" in doc, f"agent/{name}/__init__.py must say what it may import"


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        ("agent/core/x.py", "from agent.kube.client import KubeClient\n", "agent.core may import only"),
        (
            "agent/kube/x.py",
            "from agent.claims.state.machine import DeviceState\n",
            "agent.kube may import only",
        ),
        (
            "agent/kubelet/x.py",
            "from agent.claims.state.machine import DeviceState\n",
            "agent.kubelet may import",
        ),
        ("agent/claims/x.py", "from ..kube import client\n", "agent.claims may import only"),
        ("agent/observe/x.py", "import agent.config\n", "agent.observe may import only"),
        ("agent/kube/x.py", "from agent.emulator import KubeApiEmulator\n", "only the demo and tests"),
        ("agent/demo.py", "from backends.fake import profile\n", "through the backend protocol"),
        ("backends/fake/x.py", "from agent.observe.metrics import Metrics\n", "backends import only"),
    ],
)
def test_the_checker_catches_upward_and_sideways_imports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: str, source: str, expected: str
) -> None:
    """The rule fires on each kind of violation (a checker that finds nothing proves nothing)."""
    fake_root = tmp_path
    target = fake_root / module
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(source)
    (fake_root / "backends").mkdir(exist_ok=True)
    (fake_root / "agent").mkdir(exist_ok=True)
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", fake_root)
    found = violations()
    assert len(found) == 1 and expected in found[0], found
