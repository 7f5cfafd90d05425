"""scripts/house.py: the counts the restructuring tracks come out of the source tree."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "house.py"


def test_house_counts_the_tree(capsys):
    assert runpy.run_path(str(SCRIPT))["main"](["--json"]) == 0
    counts = json.loads(capsys.readouterr().out)
    assert set(counts) == {"top-level modules", "import cycles (modules)",
                           "import cycles (top-level units)", "import levels",
                           "Batch attributes", "Batch.step lines", "functions over 50 lines",
                           "lines naming a machine, date or figure", "docs lines"}
    assert all(isinstance(value, int) and value >= 0 for value in counts.values())
    assert counts["top-level modules"] > 0 and counts["Batch.step lines"] > 0


def test_cycles_and_levels_of_a_small_graph():
    house = runpy.run_path(str(SCRIPT))
    graph = {"a": {"b"}, "b": {"c"}, "c": {"b", "d"}, "d": set()}
    groups = house["strongly_connected"](graph)
    assert sorted(map(sorted, groups)) == [["a"], ["b", "c"], ["d"]]
    assert house["levels"](graph, groups) == 3  # a -> {b, c} -> d


# the one-way order of the top-level units: a unit imports only units of a lower rank (policy
# beside sample; models below both engine and proposers, reached through models/base.py)
RANKS = {"__main__": 9, "server.__main__": 9, "cli": 8, "server": 7, "bench": 7, "text": 6,
         "engine": 5, "proposers": 4, "policy": 3, "sample": 3, "models": 2, "config": 1,
         "errors": 0}
TOP_LEVEL = {"__init__.py", "__main__.py", "errors.py", "config.py"}
PACKAGES = {"sample", "engine", "policy", "proposers", "models", "text", "cli", "bench", "server",
            "assets", "spec"}  # spec: the deprecated name of sample, nothing but aliases


def _graphs():
    house = runpy.run_path(str(SCRIPT))
    trees = {path: house["ast"].parse(path.read_text())
             for path in sorted(house["PACKAGE"].rglob("*.py"))}
    return house, house["unit_graph"](trees), house["module_graph"](trees)


def test_the_tree_has_no_import_cycle_and_at_most_ten_levels():
    house, units, modules = _graphs()
    groups = house["strongly_connected"](units)
    assert [g for g in groups if len(g) > 1] == []
    assert [g for g in house["strongly_connected"](modules) if len(g) > 1] == []
    assert house["levels"](units, groups) <= 10


def test_imports_run_one_way():
    _, units, modules = _graphs()
    against = sorted((unit, target) for unit, targets in units.items() if unit != "__init__"
                     for target in targets if RANKS[target] >= RANKS[unit])
    assert against == []
    # the engine and the proposers see a model only through the session protocol
    reaching = sorted((module, target) for module, targets in modules.items()
                      if module.split(".")[1:2] in (["engine"], ["proposers"])
                      for target in targets
                      if target.startswith("verispec.models") and target != "verispec.models.base")
    assert reaching == []


def test_the_server_reaches_the_engine_only_through_text():
    # the server keeps threads, queues and events; rows, batches, depth policies and drafts
    # are the text layer's to hand it (text/batch.py, text/named.py), so server/ imports
    # nothing from engine/, policy/ or proposers/
    _, _, modules = _graphs()
    reaching = sorted((module, target) for module, targets in modules.items()
                      if module.split(".")[1:2] == ["server"]
                      for target in targets
                      if target.split(".")[1:2] in (["engine"], ["policy"], ["proposers"]))
    assert reaching == []
    assert any(target.startswith("verispec.text.") for target in modules["verispec.server.worker"])


def test_the_package_top_holds_only_the_allowed_modules_and_packages():
    package = runpy.run_path(str(SCRIPT))["PACKAGE"]
    files = {path.name for path in package.iterdir() if path.is_file() and path.suffix == ".py"}
    folders = {path.name for path in package.iterdir()
               if path.is_dir() and not path.name.startswith((".", "__pycache__"))}
    assert files == TOP_LEVEL
    assert folders == PACKAGES
    assert set(RANKS) - {"__main__", "server.__main__", "config", "errors"} <= PACKAGES


def test_ruff_sorts_every_shared_test_module_into_the_helpers_block():
    # imports of tests/helpers (on the path by pytest's pythonpath) sort below verispec's only if
    # pyproject.toml names each module in the isort section "helpers"
    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).resolve().parent.parent
    config = tomllib.loads((root / "pyproject.toml").read_text())
    sections = config["tool"]["ruff"]["lint"]["isort"]["sections"]
    helpers = {path.stem for path in (root / "tests" / "helpers").glob("*.py")}
    assert helpers <= set(sections["helpers"])
    assert config["tool"]["pytest"]["ini_options"]["pythonpath"] == ["tests/helpers"]
