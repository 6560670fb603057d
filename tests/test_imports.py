"""The project's modules import each other without a cycle, lazy imports (inside functions) included,
so each runs once: `python speculate.py` never executes speculate.py a second time as a module."""

from __future__ import annotations

import ast
import os

from conftest import REPO_ROOT


def project_modules() -> dict[str, str]:
    """Module name -> file: the top level's and the support package's."""
    found = {}
    for name in os.listdir(REPO_ROOT):
        if name.endswith(".py"):
            found[name[:-3]] = os.path.join(REPO_ROOT, name)
    support = os.path.join(REPO_ROOT, "support")
    for name in os.listdir(support):
        if name.endswith(".py") and name != "__init__.py":
            found["support." + name[:-3]] = os.path.join(support, name)
    return found


def imported(path: str, modules: dict) -> set[str]:
    """The project modules a file imports anywhere in it."""
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module in modules:
                out.add(node.module)
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in modules:
                    out.add(full)
    return out


def find_cycle(graph: dict[str, set[str]]):
    """One cycle as a list of modules, or None (depth-first search, three colours)."""
    state = {}

    def visit(module, stack):
        state[module] = "open"
        for nxt in sorted(graph[module]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt, stack + [nxt])
                if cycle:
                    return cycle
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module, [module])
            if cycle:
                return cycle
    return None


def test_the_project_imports_without_a_cycle():
    modules = project_modules()
    graph = {name: imported(path, modules) for name, path in modules.items()}
    assert {"speculate", "model", "drafter", "support.cli", "support.flags"} <= set(graph)
    assert "model" in graph["speculate"] and "support.flags" in graph["speculate"]  # the parse sees imports
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"b"}}) is None
