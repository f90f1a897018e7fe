"""The packages' layout: production modules import no test framework and no test harness, and
no import cycle exists.

Test harnesses live in tests/harness/, studies in tools/ beside the packages, the CPU-only
trainer, demo and stand-ins in `megatron_patches.local` (CONTRIBUTING.md, "Where code goes");
everything else is production code, read from the source with ast (nothing is imported).
"""

from __future__ import annotations

import ast
import os

import pytest

from helpers import REPO

pytestmark = pytest.mark.unit

PACKAGES = ("hybrid_ep", "megatron_patches")
# Subpackages that may hold local-run code (pytest included).
NOT_PRODUCTION = {"local"}


def _modules() -> dict[str, str]:
    """Dotted module name -> source path, for every .py file of the packages."""
    out = {}
    for package in PACKAGES:
        for folder, dirs, files in os.walk(os.path.join(REPO, package)):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                if not name.endswith(".py"):
                    continue
                parts = os.path.relpath(os.path.join(folder, name), REPO)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                out[".".join(parts)] = os.path.join(folder, name)
    return out


MODULES = _modules()


def _is_package(module: str) -> bool:
    return MODULES[module].endswith("__init__.py")


def _imports(module: str) -> set[str]:
    """The package modules `module` imports anywhere in its source, inside functions too (a
    lazy import is still a dependency). `from p import n` names the module p.n when that is
    one, else p; the parent packages Python runs before a submodule are not counted."""
    with open(MODULES[module], encoding="utf-8") as f:
        tree = ast.parse(f.read(), MODULES[module])
    package = module if _is_package(module) else module.rpartition(".")[0]
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module
            for alias in node.names:
                targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    found = set()
    for name in targets:
        while name and name not in MODULES:  # `import a.b.c` of a name that is no module: its module
            name = name.rpartition(".")[0]
        if name and name != module:
            found.add(name)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def _path(graph: dict[str, set[str]], component: list[str]) -> str:
    """One cycle through the component's first module, as `a -> b -> a` (shortest, breadth first)."""
    start, members = component[0], set(component)
    parent, todo = {start: None}, [start]
    while todo:
        v = todo.pop(0)
        for w in sorted(graph[v] & members):
            if w == start:
                path = [v]
                while parent[path[-1]] is not None:
                    path.append(parent[path[-1]])
                return " -> ".join(path[::-1] + [start])
            if w not in parent:
                parent[w] = v
                todo.append(w)
    return ", ".join(component)


def test_production_modules_do_not_import_pytest():
    offenders = []
    for module in MODULES:
        if NOT_PRODUCTION & set(module.split(".")[1:]):
            continue
        with open(MODULES[module], encoding="utf-8") as f:
            tree = ast.parse(f.read(), MODULES[module])
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            if any(n == "pytest" or n.startswith("pytest.") or n == "_pytest" or n.startswith("_pytest.")
                   for n in names):
                offenders.append(f"{os.path.relpath(MODULES[module], REPO)}:{node.lineno}")
    assert not offenders, ("production modules import pytest (test code goes to tests/harness/, "
                           f"studies to tools/): {offenders}")


def test_no_package_module_imports_a_test_harness():
    """An installed package has no tests/ beside it: local/ included, none imports `harness`."""
    offenders = []
    for module, path in MODULES.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            offenders += [f"{module}: {n}" for n in names if n.split(".")[0] in ("harness", "tests")]
    assert "hybrid_ep.verify.cases" in MODULES and not offenders, offenders


def test_no_import_cycles():
    graph = {module: _imports(module) for module in MODULES}
    assert "hybrid_ep.balancer.planner" in graph and "megatron_patches.manager" in graph  # the walk found them
    cycles = [_path(graph, c) for c in _cycles(graph)]
    assert not cycles, "import cycles (imports inside functions count): " + "; ".join(cycles)


def test_cycle_finder_counts_imports_inside_functions():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _path(graph, ["a", "b", "c"]) == "a -> b -> c -> a"
    # megatron_patches.patches imports the balancer hooks inside its install()
    assert "megatron_patches.balancer" in _imports("megatron_patches.patches")
