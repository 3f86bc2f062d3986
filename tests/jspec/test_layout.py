"""The shape of the code base, read from the source (ast, nothing imported): no import cycle between
the modules of jspec, pallas_kernels and checkpoints; no cycle between jspec's subpackages (and its
top-level modules); no jspec module over 400 lines. The checker is a set of functions over a root
folder, so it is also run on a scratch tree that breaks every rule, to show it can fail.

Import edges: every `import` / `from ... import` statement, at module level or inside a function
or class, except under `if TYPE_CHECKING:` (never executed). `from a.b import c` is an edge to the
module a.b.c if there is one, else to a.b; `import a.b.c` to the longest of a.b.c, a.b, a that is
a module here; relative imports are resolved against the importing module's package. Imports of
anything outside the scanned packages are ignored."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("jspec", "pallas_kernels", "checkpoints")
MAX_LINES = 400


# ----------------------------------------------------------------------------- the checker
def find_modules(root: Path, packages) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under root/<package>."""
    mods = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)  # the body only runs under a type checker
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph(root: Path, packages=PACKAGES) -> tuple[dict[str, Path], dict[str, dict[str, int]]]:
    """(modules, edges): edges[a][b] is the line of a's first import of module b (a != b)."""
    mods = find_modules(root, packages)
    edges: dict[str, dict[str, int]] = {m: {} for m in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _import_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    edges[name].setdefault(t, node.lineno)
    return mods, edges


def _components(edges: dict) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def cycles(edges: dict) -> list[tuple[list[str], list[str]]]:
    """(cycle [a, b, ..., a], component) for each strongly connected component: the shortest cycle
    through its first node in sorted order."""
    found = []
    for comp in _components(edges):
        inside, first = set(comp), comp[0]
        prev, frontier = {first: None}, [first]
        while frontier and first not in [w for v in frontier for w in edges[v]]:
            nxt = []
            for v in frontier:
                for w in sorted(edges[v]):
                    if w in inside and w not in prev:
                        prev[w] = v
                        nxt.append(w)
            frontier = nxt
        last = next(v for v in frontier if first in edges[v])
        path = [last]
        while prev[path[-1]] is not None:
            path.append(prev[path[-1]])
        found.append((path[::-1] + [first], comp))
    return found


def describe(cycle: list[str], component: list[str], where) -> str:
    text = " -> ".join([cycle[0]] + [f"{b} ({where(a, b)})" for a, b in zip(cycle, cycle[1:])])
    if len(component) > len(cycle) - 1:
        text += f"; {len(component)} reach each other: {', '.join(component)}"
    return text


def module_cycles(root: Path, packages=PACKAGES) -> list[str]:
    mods, edges = import_graph(root, packages)
    return [describe(c, comp, lambda a, b: f"{mods[a].relative_to(root)}:{edges[a][b]}") for c, comp in cycles(edges)]


def group_of(module: str, package: str) -> str | None:
    """package.<first part> for a module of package (a subpackage or a top-level module); the
    package itself for its __init__; None outside it."""
    parts = module.split(".")
    if parts[0] != package:
        return None
    return ".".join(parts[:2])


def package_cycles(root: Path, package: str = "jspec") -> list[str]:
    mods, edges = import_graph(root, (package,))
    groups: dict[str, dict[str, tuple[str, str]]] = {}
    for a, targets in edges.items():
        ga = group_of(a, package)
        groups.setdefault(ga, {})
        for b in sorted(targets):
            gb = group_of(b, package)
            if gb is not None and gb != ga:
                groups[ga].setdefault(gb, (a, b))

    def where(ga, gb):
        a, b = groups[ga][gb]
        return f"{a} imports {b} at {mods[a].relative_to(root)}:{edges[a][b]}"

    return [describe(c, comp, where) for c, comp in cycles(groups)]


def long_modules(root: Path, package: str = "jspec", limit: int = MAX_LINES) -> list[str]:
    out = []
    for path in find_modules(root, (package,)).values():
        n = len(path.read_text().splitlines())
        if n > limit:
            out.append(f"{path.relative_to(root)} ({n} lines)")
    return out


# ----------------------------------------------------------------------------- the real tree
def test_the_checker_reads_the_tree():
    mods, edges = import_graph(ROOT)
    assert len(mods) > 80 and sum(map(len, edges.values())) > 200, (len(mods), sum(map(len, edges.values())))
    assert "jspec.models" in edges["jspec.api"] or any(e.startswith("jspec.models.") for e in edges["jspec.api"])


def test_no_import_cycle_between_modules():
    found = module_cycles(ROOT)
    assert not found, "import cycles (module-level and in-function imports):\n  " + "\n  ".join(found)


def test_no_cycle_between_jspec_subpackages():
    found = package_cycles(ROOT, "jspec")
    assert not found, "cycles between jspec's subpackages / top-level modules:\n  " + "\n  ".join(found)


def test_no_jspec_module_over_the_line_limit():
    found = long_modules(ROOT, "jspec", MAX_LINES)
    assert not found, f"jspec modules over {MAX_LINES} lines: " + ", ".join(found)


# ----------------------------------------------------------------------------- the checker can fail
def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checker_finds_cycles_and_long_modules(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "",
        # A module cycle closed by a relative import inside a function.
        "pkg/a.py": "from pkg import b\n",
        "pkg/b.py": "import os\n\n\ndef f():\n    from . import a\n    return a, os\n",
        # Typing-only imports make no cycle.
        "pkg/c.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from pkg import d\n",
        "pkg/d.py": "import pkg.c\n",
        # Subpackages one and two import each other through different modules: a package cycle
        # without a module cycle.
        "pkg/one/__init__.py": "",
        "pkg/one/m.py": "from pkg.two.n import g\n",
        "pkg/one/p.py": "X = 1\n",
        "pkg/two/__init__.py": "",
        "pkg/two/n.py": "def g():\n    pass\n",
        "pkg/two/k.py": "class K:\n    def f(self):\n        from ..one.p import X\n        return X\n",
        "pkg/long.py": "x = 1\n" * (MAX_LINES + 1),
        "pkg/limit.py": "x = 1\n" * MAX_LINES,
    })
    found = module_cycles(tmp_path, ("pkg",))
    assert found == ["pkg.a -> pkg.b (pkg/a.py:1) -> pkg.a (pkg/b.py:5)"], found

    # Top-level modules are nodes of the package graph too: the module cycle shows there as well.
    found = sorted(package_cycles(tmp_path, "pkg"))
    assert found == ["pkg.a -> pkg.b (pkg.a imports pkg.b at pkg/a.py:1) -> pkg.a (pkg.b imports pkg.a at pkg/b.py:5)",
                     "pkg.one -> pkg.two (pkg.one.m imports pkg.two.n at pkg/one/m.py:1) -> "
                     "pkg.one (pkg.two.k imports pkg.one.p at pkg/two/k.py:3)"], found

    assert long_modules(tmp_path, "pkg", MAX_LINES) == [f"pkg/long.py ({MAX_LINES + 1} lines)"]

    # Sanity of the graph: `import a.b.c` reaches its longest known prefix, `from a import b`
    # the module a.b, and the failing test messages would name the cycle.
    _, edges = import_graph(tmp_path, ("pkg",))
    assert edges["pkg.d"] == {"pkg.c": 1} and edges["pkg.c"] == {}
    assert edges["pkg.one.m"] == {"pkg.two.n": 1} and edges["pkg.two.k"] == {"pkg.one.p": 3}
