"""The oracle package's modules import each other in one direction (issue 56): no import circle,
no sibling module imported inside a function (where it would hide a circle), and no module using
another's underscore names. Read from the sources with `ast`; each rule has a planted package it
must catch."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tracegate_oracle"


def _sibling(node: ast.ImportFrom, modules: set[str]) -> list[tuple[str, list[str]]]:
    """(module, names taken) for a relative import of a sibling: `from .x import a` -> (x, [a]);
    `from . import x` -> (x, [])."""
    if node.level != 1:
        return []
    if node.module:
        return [(node.module, [a.name for a in node.names])] if node.module in modules else []
    return [(a.name, []) for a in node.names if a.name in modules]


def problems(package: Path) -> list[str]:
    """Every circle, in-function sibling import and underscore name taken from a sibling."""
    trees = {p.stem: ast.parse(p.read_text(), str(p)) for p in sorted(package.glob("*.py"))}
    modules = set(trees)
    out: list[str] = []
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for m, tree in trees.items():
        aliases: dict[str, str] = {}  # local name -> sibling module
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            for target, taken in _sibling(node, modules):
                edges[m].add(target)
                for name in taken:
                    if name.startswith("_"):
                        out.append(f"{m}.py takes {target}.{name}")
                if node.module is None:
                    for a in node.names:
                        aliases[a.asname or a.name] = a.name
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                for node in ast.walk(fn):
                    if isinstance(node, ast.ImportFrom) and _sibling(node, modules):
                        out.append(f"{m}.py imports {node.module or '.'} inside {fn.name}()")
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                out.append(f"{m}.py uses {aliases[node.value.id]}.{node.attr}")
    # circles: a depth-first search that meets a module still on its path
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                out.append("circle: " + " -> ".join(path[path.index(n) :] + [m, n]))
            elif n not in state:
                visit(n, path + [m])
        state[m] = 2

    for m in sorted(modules):
        if m not in state:
            visit(m, [])
    return out


def test_the_oracle_package_has_no_circle_and_takes_no_private_name():
    assert problems(PACKAGE) == []


def test_each_rule_catches_its_planted_defect(tmp_path):
    (tmp_path / "a.py").write_text("from .b import B\n_x = 1\n")
    (tmp_path / "b.py").write_text(
        "from . import c as cc\nfrom .a import _x\nB = cc._y\n"
        "def late():\n    from . import a\n    return a\n"
    )
    (tmp_path / "c.py").write_text("_y = 2\n")
    got = problems(tmp_path)
    assert sorted(got) == sorted(
        [
            "b.py takes a._x",
            "b.py uses c._y",
            "b.py imports . inside late()",
            "circle: a -> b -> a",
        ]
    ), got
    # an acyclic package with public names only is clean (the checker is not always failing)
    (tmp_path / "a.py").write_text("X = 1\n")
    (tmp_path / "b.py").write_text("from . import c\nfrom .a import X\nB = c.Y + X\n")
    (tmp_path / "c.py").write_text("Y = 2\n")
    assert problems(tmp_path) == []
