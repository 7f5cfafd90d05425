"""The house counts the restructuring issue tracks, printed so that a change can see them.

    python scripts/house.py            # a table
    python scripts/house.py --json     # the same as JSON

Counted from the source tree, no imports of verispec itself:
  top-level modules       .py files directly in src/verispec/ (packages not counted)
  import cycles           strongly connected groups of more than one module in the graph of
                          verispec's own imports, TYPE_CHECKING and function-local imports
                          included (and the same over top-level units: a module at the top,
                          or a package taken whole; a package's __main__ is a unit of its own,
                          an entry point that nothing imports)
  import levels           the longest chain of top-level units in that graph, cycles collapsed
  Batch attributes        distinct ``self.x`` assigned in Batch.__init__
  Batch.step lines        the method's lines, docstring and comments included
  functions over 50 lines in src/
  lines naming a machine, a date or a measured figure in src/ (comments, docstrings, code)
  docs lines              lines of docs/*.md
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "verispec"
# a machine, a date, or a figure with a unit of time or speed
NOTEBOOK = re.compile(r"\b(EPYC|Xeon|Zen ?\d|H100|H200|A100|20\d\d-\d\d-\d\d|\d+(\.\d+)? ?"
                      r"(ms|us|tok/s)\b)")


def unit_of(module: str) -> str:
    """verispec.a.b -> 'a' (the top-level unit a module belongs to); verispec.a.__main__ ->
    'a.__main__': ``python -m verispec.a`` is an entry point above every package, as
    verispec.__main__ is, not a part of package a that others import."""
    parts = module.split(".")
    if len(parts) > 2 and parts[-1] == "__main__":
        return ".".join(parts[1:])
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imported_modules(path: Path, tree: ast.AST) -> set[str]:
    """verispec modules this file imports, relative imports resolved."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "verispec":
                found.add(target)
                found.update(f"{target}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names
                         if alias.name.split(".")[0] == "verispec")
    return found


def unit_graph(trees: dict[Path, ast.AST]) -> dict[str, set[str]]:
    known = {unit_of(module_name(path)) for path in trees}
    graph: dict[str, set[str]] = {unit: set() for unit in known}
    for path, tree in trees.items():
        source = unit_of(module_name(path))
        for target in imported_modules(path, tree):
            unit = unit_of(target)
            if unit in known and unit != source and unit != "__init__":
                graph[source].add(unit)
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm, iterative enough for a small graph."""
    index, low, on_stack, stack, groups = {}, {}, set(), [], []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def levels(graph: dict[str, set[str]], groups: list[set[str]]) -> int:
    """The longest chain of groups (cycles collapsed), counted in units of the chain."""
    group_of = {node: i for i, group in enumerate(groups) for node in group}
    edges = {i: {group_of[n] for node in group for n in graph[node]} - {i}
             for i, group in enumerate(groups)}
    depth: dict[int, int] = {}

    def longest(i: int) -> int:
        if i not in depth:
            depth[i] = 1 + max((longest(j) for j in edges[i]), default=0)
        return depth[i]

    return max((longest(i) for i in edges), default=0)


def module_graph(trees: dict[Path, ast.AST]) -> dict[str, set[str]]:
    known = {module_name(path) for path in trees}
    return {module_name(path): {target for target in imported_modules(path, tree)
                                if target in known and target != module_name(path)
                                and target != "verispec"}
            for path, tree in trees.items()}


def batch_counts(trees: dict[Path, ast.AST]) -> tuple[int, int]:
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == "Batch":
                methods = {f.name: f for f in node.body if isinstance(f, ast.FunctionDef)}
                init = methods["__init__"]
                attributes = {target.attr for stmt in ast.walk(init)
                              if isinstance(stmt, (ast.Assign, ast.AnnAssign))
                              for target in (stmt.targets if isinstance(stmt, ast.Assign)
                                             else [stmt.target])
                              if isinstance(target, ast.Attribute)
                              and isinstance(target.value, ast.Name) and target.value.id == "self"}
                step = methods["step"]
                return len(attributes), step.end_lineno - step.lineno + 1
    return 0, 0


def counts() -> dict[str, int]:
    files = sorted(PACKAGE.rglob("*.py"))
    trees = {path: ast.parse(path.read_text(), str(path)) for path in files}
    graph = unit_graph(trees)
    groups = strongly_connected(graph)
    attributes, step_lines = batch_counts(trees)
    long_functions = sum(1 for tree in trees.values() for node in ast.walk(tree)
                         if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                         and node.end_lineno - node.lineno + 1 > 50)
    notebook = sum(1 for path in files for line in path.read_text().splitlines()
                   if NOTEBOOK.search(line))
    docs = sum(len(path.read_text().splitlines()) for path in (ROOT / "docs").glob("*.md"))
    return {"top-level modules": len(list(PACKAGE.glob("*.py"))),
            "import cycles (modules)": sum(
                1 for group in strongly_connected(module_graph(trees)) if len(group) > 1),
            "import cycles (top-level units)": sum(1 for group in groups if len(group) > 1),
            "import levels": levels(graph, groups),
            "Batch attributes": attributes,
            "Batch.step lines": step_lines,
            "functions over 50 lines": long_functions,
            "lines naming a machine, date or figure": notebook,
            "docs lines": docs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    result = counts()
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        width = max(map(len, result))
        for name, value in result.items():
            print(f"{name:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
