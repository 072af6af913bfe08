"""The import graph of casckpt has no cycle.

Every import counts: at module level, under ``TYPE_CHECKING`` and inside functions, as
grimp (the graph import-linter checks its contracts on) reads them. A cycle is broken by
moving code where it belongs (a leaf module of shared values, a value passed in), not by
hiding an import in a function: this test sees those too. The layer contracts in
pyproject.toml (``lint-imports``) say which way each import may go.
"""

from __future__ import annotations

import grimp
import pytest

import casckpt


def _cycles(graph: grimp.ImportGraph, modules: set[str]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative), each
    sorted, in order of their first module."""
    edges = {m: sorted(graph.find_modules_directly_imported_by(m) & modules) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(modules):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            if i < len(edges[node]):
                work.append((node, i + 1))
                nxt = edges[node][i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def _describe(graph: grimp.ImportGraph, component: list[str]) -> str:
    lines = [f"{len(component)} modules: {', '.join(component)}"]
    members = set(component)
    for importer in component:
        for imported in sorted(graph.find_modules_directly_imported_by(importer) & members):
            details = graph.get_import_details(importer=importer, imported=imported)
            where = ", ".join(f"line {d['line_number']}" for d in details) or "?"
            lines.append(f"    {importer} -> {imported} ({where})")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("casckpt", cache_dir=None)


def test_casckpt_has_no_import_cycle(graph: grimp.ImportGraph) -> None:
    modules = {m for m in graph.modules if m == "casckpt" or m.startswith("casckpt.")}
    cycles = _cycles(graph, modules)
    assert not cycles, "import cycles in casckpt (move the shared code into a leaf module, " \
        "or pass the value in):\n" + "\n".join(_describe(graph, c) for c in cycles)


def test_the_cycle_finder_finds_a_cycle() -> None:
    """The check above could fail: a graph with cycles added reports each, naming its modules
    and the imports that close it."""
    changed = grimp.build_graph("casckpt", cache_dir=None)
    changed.add_import(importer="casckpt.errors", imported="casckpt.types")
    changed.add_import(importer="casckpt.types", imported="casckpt.errors")
    changed.add_import(importer="casckpt.format.chunks", imported="casckpt.engine.context")
    cycles = _cycles(changed, {m for m in changed.modules if m.startswith("casckpt.")})
    assert any("casckpt.errors" in c and "casckpt.types" in c for c in cycles)
    assert any("casckpt.format.chunks" in c and "casckpt.engine.context" in c for c in cycles)
    assert "casckpt.types -> casckpt.errors" in _describe(changed, ["casckpt.errors", "casckpt.types"])


def test_the_graph_is_casckpt(graph: grimp.ImportGraph) -> None:
    """The graph was built from the package under test, and holds its modules."""
    assert casckpt.__file__ is not None
    assert {"casckpt.store", "casckpt.engine.context", "casckpt.catalog.catalog"} <= graph.modules


def test_every_engine_room_states_its_contract() -> None:
    """Each subpackage of casckpt.engine (a room) says in its docstring what it owns, what it
    may import and its call order, and holds no code of its own (importing a room costs
    nothing)."""
    import ast
    import pkgutil
    from pathlib import Path

    import casckpt.engine

    rooms = [m.name for m in pkgutil.iter_modules(casckpt.engine.__path__) if m.ispkg]
    for room in rooms:
        init = Path(casckpt.engine.__path__[0]) / room / "__init__.py"
        tree = ast.parse(init.read_text())
        doc = ast.get_docstring(tree) or ""
        assert "Owns" in doc and "May import" in doc and "Call order" in doc, room
        assert all(isinstance(node, ast.Expr) or (isinstance(node, ast.ImportFrom)
                                                  and node.module == "__future__")
                   for node in tree.body), room
