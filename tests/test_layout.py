"""The package layers of `agent/` and who may import whom, read from every module's AST.

Layers, lowest first: core -> observe -> health -> claims / kube -> kubelet -> the process modules
(app, runner, config, cli, demo). A layer imports only the layers below it; `kube`, `claims` and
`kubelet` never import each other's internals (the kubelet reaches claims through
`agent.claims.preparer` alone). Backends import only `agent.core`. The API emulator serves tests and
the demo: nothing else in `agent/` imports it, and the demo reaches backends only through the
backend protocol.

And the house rules of agent/ and backends/: no import circle (`import_graph` says which imports
count), no runtime module over 600 lines (the emulator and the generated protos aside), and no
class with more than two of our own classes above it (`deep_classes` says how they are counted).
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


def _import_nodes(tree: ast.AST, *, import_time_only: bool = False) -> Iterator[ast.Import | ast.ImportFrom]:
    """The import statements of `tree`; `import_time_only`: not those inside a function body."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif not (import_time_only and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)):
            yield from _import_nodes(node, import_time_only=import_time_only)


def _from_module(path: Path, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` takes its names from (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    parts = _module_name(path).rpartition(".")[0].split(".")
    base = parts[: len(parts) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def _imports(path: Path) -> Iterator[tuple[int, str]]:
    """Absolute names of every `agent.*`/`backends.*` import (relative imports resolved)."""
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        else:
            name = _from_module(path, node)
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


# -- the house: no import circle, no long module, no deep inheritance ---------------------------------

MAX_MODULE_LINES = 600
"""Runtime modules (agent/ and backends/, without the API emulator and the generated protos)."""

MAX_INHERITANCE_DEPTH = 2
"""How many of our own classes may stand above a class (see `deep_classes`)."""


def _project_modules() -> dict[str, Path]:
    """Module name -> file of every module of agent/ and backends/ (a package by its own name)."""
    return {_module_name(path).removesuffix(".__init__"): path for path in _modules()}


def _target(modules: dict[str, Path], name: str) -> str | None:
    """The module of ours that an imported name is, or lives in (its longest prefix that is one)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports when it is imported.

    Counted: every import that runs when the module is imported (at module level, in class bodies,
    under ``if`` and ``try``), ``if TYPE_CHECKING:`` included (a circle for the type checker is one
    for the reader). An import names the module it takes a name from: ``from a.b import c`` is an
    edge to ``a.b.c`` when that is a module, else to ``a.b``; the parent packages Python loads
    first are not edges. Not counted: imports inside a function body. They run when the function
    is called, after both modules are loaded, so they cannot make an import-time circle, and they
    are how the agent defers costly imports past its start-up (`agent.kube.credentials`).
    """
    modules = _project_modules()
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        edges = graph[module] = set()
        for node in _import_nodes(ast.parse(path.read_text(), str(path)), import_time_only=True):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                source = _from_module(path, node)
                names = [
                    f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                    for alias in node.names
                ]
            targets = {_target(modules, name) for name in names}
            edges.update(target for target in targets if target is not None and target != module)
    return graph


def import_circles() -> list[list[str]]:
    """The groups of modules that import each other, directly or around a circle (Tarjan's SCCs)."""
    graph = import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(graph[module]):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return circles


def long_modules() -> list[str]:
    found = []
    for path in _modules():
        where = path.relative_to(ROOT).as_posix()
        if where.startswith("agent/emulator/"):
            continue
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            found.append(f"{where}: {lines} lines, split it by concern (at most {MAX_MODULE_LINES})")
    return found


def deep_classes() -> list[str]:
    """Classes with more than `MAX_INHERITANCE_DEPTH` of our own classes above them.

    A class's depth is the longest chain of classes defined in agent/ or backends/ above it:
    ``class A:``, ``class A(Exception)`` and ``class A(Protocol)`` are 0, ``class B(A)`` 1,
    ``class C(B)`` 2. Bases from elsewhere (the standard library, typing's Protocol and Generic,
    abc.ABC, object, other packages) end a chain and are not counted; ``Base[T]`` counts as
    ``Base``. A base is found by its name: a class of the same module, a name imported with
    ``from module import Name`` (aliases and re-exports followed), or ``module.Name`` through an
    imported module. The rule holds for every class, error classes included.
    """
    modules = _project_modules()
    bases: dict[tuple[str, str], list[tuple[str, str]]] = {}
    imported: dict[tuple[str, str], tuple[str, str]] = {}
    """(module, local name) -> (module, name) it was imported from: `from m import N as local`."""
    aliases: dict[tuple[str, str], str] = {}
    """(module, local name) -> the module of ours it names: `import a.b as local`, `from a import b`."""
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in _import_nodes(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    local = alias.asname or alias.name.partition(".")[0]
                    aliases[module, local] = alias.name if alias.asname else local
            else:
                source = _from_module(path, node)
                for alias in node.names:
                    full = f"{source}.{alias.name}"
                    if full in modules:
                        aliases[module, alias.asname or alias.name] = full
                    else:
                        imported[module, alias.asname or alias.name] = (source, alias.name)
        for cls in ast.walk(tree):
            if isinstance(cls, ast.ClassDef):
                bases[module, cls.name] = [_base(module, base, aliases) for base in cls.bases]

    def resolve(name: tuple[str, str]) -> tuple[str, str] | None:
        for _ in range(10):  # follows re-exports
            if name in bases:
                return name
            if name not in imported:
                return None
            name = imported[name]
        return None

    def depth(name: tuple[str, str], seen: frozenset[tuple[str, str]]) -> int:
        above = [resolve(base) for base in bases[name]]
        return max((1 + depth(b, seen | {b}) for b in above if b is not None and b not in seen), default=0)

    return [
        f"{module}.{name}: {found} of our classes above it (at most {MAX_INHERITANCE_DEPTH}); "
        "give it collaborators instead of base classes"
        for module, name in sorted(bases)
        if (found := depth((module, name), frozenset({(module, name)}))) > MAX_INHERITANCE_DEPTH
    ]


def _base(module: str, base: ast.expr, aliases: dict[tuple[str, str], str]) -> tuple[str, str]:
    """(module, name) a base class expression names, as written (`Base`, `Base[T]`, `mod.Base`)."""
    if isinstance(base, ast.Subscript):
        base = base.value
    if isinstance(base, ast.Attribute):
        owner, _, name = ast.unparse(base).rpartition(".")
        head, _, rest = owner.partition(".")
        target = aliases.get((module, head))
        if target is not None:
            return (f"{target}.{rest}" if rest else target), name
        return owner, name
    return module, ast.unparse(base)


def test_no_import_circle() -> None:
    assert import_circles() == []


def test_no_runtime_module_is_longer_than_600_lines() -> None:
    assert long_modules() == []


def test_no_class_inherits_more_than_two_levels_deep() -> None:
    assert deep_classes() == []


def _tree(root: Path, files: dict[str, str]) -> None:
    for name, source in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(source)


def test_the_house_checks_catch_what_they_forbid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each check fires on what it forbids and lets pass what it allows (a checker that finds
    nothing proves nothing)."""
    _tree(
        tmp_path,
        {
            "agent/core/a.py": "from agent.core.b import B\n\nclass A(B):\n    pass\n",
            "agent/core/b.py": (
                "from typing import TYPE_CHECKING, Protocol\n\nif TYPE_CHECKING:\n"
                "    from agent.core import a\n\nclass Base(Protocol):\n    pass\n\n"
                "class B(Base):\n    pass\n"
            ),
            "agent/core/c.py": (
                "from agent.core import a as first\nfrom agent.core.a import A as Renamed\n\n"
                "class C(first.A):\n    pass\n\nclass D(Renamed):\n    pass\n\n"
                "def late():\n    from agent.core import d\n"
            ),
            "agent/core/d.py": "import agent.core.c\n\nclass E(Exception):\n    pass\n",
            "agent/core/long.py": "x = 1\n" * 601,
            "agent/emulator/long.py": "x = 1\n" * 601,
        },
    )
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", tmp_path)
    # a <-> b through `if TYPE_CHECKING:`; d -> c at import time, c -> d only inside a function.
    assert import_circles() == [["agent.core.a", "agent.core.b"]]
    assert [line.partition(":")[0] for line in long_modules()] == ["agent/core/long.py"]
    # A(B) 2 (B and Base above it), C(a.A) and D(A as Renamed) 3; Protocol and Exception not counted.
    assert [line.partition(":")[0] for line in deep_classes()] == ["agent.core.c.C", "agent.core.c.D"]
