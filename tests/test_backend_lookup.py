"""Finding a backend by name: ours by module name, a third party's by its entry point.

`dra-agent run` loads its configured backend at every start; scanning every installed
distribution's metadata for the ``dra_agent.backends`` entry points is not needed for ours.
"""

from __future__ import annotations

import importlib.metadata
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from agent import cli
from agent.core.backend import (
    BUILTIN_BACKENDS,
    ENTRY_POINT_GROUP,
    Backend,
    BackendOptions,
    available_backends,
    load_backend_factory,
)
from agent.core.errors import BackendNotFoundError

ROOT = Path(__file__).resolve().parents[1]


def acme_backends(options: BackendOptions) -> Sequence[Backend]:
    """A third-party backend factory, found through its entry point."""
    return []


def no_scan(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("scanned the installed distributions' entry points")


def with_entry_points(monkeypatch: pytest.MonkeyPatch, *extra: importlib.metadata.EntryPoint) -> None:
    real = importlib.metadata.entry_points

    def entry_points(**selection: Any) -> importlib.metadata.EntryPoints:
        found: list[importlib.metadata.EntryPoint] = [*real(**selection)]
        found += [ep for ep in extra if all(getattr(ep, k) == v for k, v in selection.items())]
        return importlib.metadata.EntryPoints(found)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)


def test_the_builtin_map_is_the_packages_entry_points() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["entry-points"][ENTRY_POINT_GROUP] == BUILTIN_BACKENDS


@pytest.mark.parametrize("name", sorted(BUILTIN_BACKENDS))
def test_our_backends_load_without_the_entry_point_scan(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setattr(importlib.metadata, "entry_points", no_scan)
    module, _, attribute = BUILTIN_BACKENDS[name].partition(":")
    assert load_backend_factory(name) is getattr(importlib.import_module(module), attribute)


def test_a_third_party_backend_loads_by_its_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    acme = importlib.metadata.EntryPoint("acme", f"{__name__}:acme_backends", ENTRY_POINT_GROUP)
    with_entry_points(monkeypatch, acme)
    assert load_backend_factory("acme") is acme_backends
    assert "acme" in available_backends()


def test_an_unknown_backend_names_the_installed_ones() -> None:
    with pytest.raises(
        BackendNotFoundError, match=r"unknown backend 'nope': installed backends are amd, fake"
    ):
        load_backend_factory("nope")


def test_our_commands_parse_without_the_entry_point_scan(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(importlib.metadata, "entry_points", no_scan)
    assert cli.main(["version"]) == 0
    assert capsys.readouterr().out.startswith("dra-agent ")


def test_contributed_commands_still_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    registered: list[str] = []

    def register(sub: Any) -> None:
        registered.append("acme")
        sub.add_parser("acme").set_defaults(handler=lambda args: 7)

    monkeypatch.setitem(globals(), "acme_register", register)
    acme = importlib.metadata.EntryPoint("acme", f"{__name__}:acme_register", cli.COMMAND_GROUP)
    with_entry_points(monkeypatch, acme)
    assert cli.main(["acme"]) == 7
    assert registered == ["acme"]
