"""scripts/house.py: the counts the restructuring tracks come out of the source tree."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

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
