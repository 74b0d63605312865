"""The import graph of `kvq` (issue 31 item 4): no new import circle.

Every `import` counts, at module level, inside functions and under `TYPE_CHECKING` alike: a
circle hidden in a function is still two modules that each need the other. The circles that
remain are listed here, each to be broken by the coordinator's and the backbone's redesign; the
test fails on any other, and on a listed one that is gone (so the list only shrinks).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import kvq

ROOT = Path(kvq.__file__).parent
KNOWN: set[frozenset[str]] = set()  # import circles allowed: none


def modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def graph() -> dict[str, set[str]]:
    """module -> the kvq modules it imports (a name imported from a package counts as its
    submodule when there is one)."""
    mods = modules()

    def owner(name: str) -> str | None:
        while name not in mods:
            if "." not in name:
                return None
            name = name.rsplit(".", 1)[0]
        return name

    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        package = m if path.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, *([base] if base else [])])
                names = [f"{base}.{a.name}" for a in node.names]
            for name in names:
                target = owner(name) if name.startswith("kvq") else None
                if target and target != m:
                    edges[m].add(target)
    return edges


def circles(edges: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: set[frozenset[str]] = set()
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.add(frozenset(comp))
    return found


def test_circles_finds_a_circle() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(edges) == {frozenset({"a", "b", "c"})}
    assert circles({"a": {"b"}, "b": set()}) == set()


def test_no_new_import_circle() -> None:
    got = circles(graph())
    assert got - KNOWN == set(), "new import circles"
    assert KNOWN - got == set(), "a known circle is gone: take it off the list"


def test_the_bus_imports_no_role_no_router_and_no_model() -> None:
    """`kvq.bus` sits under the roles and under the model code: it imports neither a role's
    package, the swarm router, nor `kvq.model` (a registered model travels as `kvq.catalog`'s
    records, which know nothing of how a file is read or run)."""
    above = ("kvq.swarm", "kvq.coordinator", "kvq.worker", "kvq.monitor", "kvq.api", "kvq.model")
    g = graph()
    bad = {
        (m, dep)
        for m, deps in g.items()
        if m.startswith("kvq.bus") or m in ("kvq.catalog", "kvq.slices")
        for dep in deps
        if dep.startswith(above)
    }
    assert bad == set()


def test_the_records_import_no_numeric_library() -> None:
    """`kvq.catalog` and `kvq.slices` are what a process that only routes needs of a model:
    they import no numpy, gguf or torch, at any depth; the bus (whose wire rows are numpy
    arrays) imports no gguf or torch."""

    def loaded(modules: str) -> str:
        code = (
            f"import sys, {modules}; print(sorted({{'numpy', 'gguf', 'torch'}} & set(sys.modules)))"
        )
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        return run.stdout.strip()

    assert loaded("kvq.catalog, kvq.slices") == "[]"
    assert loaded("kvq.bus.redis_board, kvq.bus.memory_board") == "['numpy']"
