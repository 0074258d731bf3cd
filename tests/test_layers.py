"""The layering rules of docs/DESIGN.md, checked on the source: which package may import which,
transformers only where models are wrapped (and in the benchmarks and studies under tools/), and no private name
(leading underscore) imported from another package; command-line parsing (argparse) only in tools/."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kamera_core", "agentwin", "agents", "tools")
# Which top-level packages each may import (besides itself and third-party libraries).
MAY_IMPORT = {
    "kamera_core": set(),
    "agentwin": {"kamera_core"},
    "agents": {"agentwin", "kamera_core"},
    "tools": {"agentwin", "agents", "kamera_core"},
}
# transformers is wrapped in agentwin/models; the benchmarks and studies under tools/ compare
# against the model's own forward and may import it too.
TRANSFORMERS_ALLOWED = ("agentwin/models/", "tools/")


def _sources() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(module, imported names, line) of every import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join([*base, module] if module else base)
            out.append((module, [alias.name for alias in node.names], node.lineno))
    return out


def _subpackage(module: str) -> str:
    """The unit the private-name rule is about: `agentwin.models`, `agentwin.store`, `agents`, `tools`, ..."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "agentwin" and len(parts) > 2 else parts[0]


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_import_rules(path):
    rel = path.relative_to(ROOT).as_posix()
    own = rel.split("/")[0]
    own_unit = _subpackage(".".join(Path(rel).with_suffix("").parts))
    problems = []
    for module, names, line in _imports(path):
        top = module.split(".")[0]
        if top in PACKAGES and top != own and top not in MAY_IMPORT[own]:
            problems.append(f"line {line}: {own} may not import {module}")
        if top == "transformers" and not rel.startswith(TRANSFORMERS_ALLOWED):
            problems.append(f"line {line}: transformers imported outside agentwin/models and tools/")
        if top == "argparse" and own != "tools":
            problems.append(f"line {line}: command-line parsing belongs to tools/, not {own}")
        if top in PACKAGES and _subpackage(module + ".x") != own_unit:
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            private += [p for p in module.split(".") if p.startswith("_") and not p.startswith("__")]
            if private:
                problems.append(f"line {line}: private {private} imported from {module}")
    assert not problems, f"{rel}:\n" + "\n".join(problems)


def test_the_rules_see_the_imports():
    """The checker finds imports at all (an empty scan would pass every file)."""
    found = _imports(ROOT / "agentwin" / "window.py")
    assert any(m == "agentwin.models.adapter" and "KameraModel" in n for m, n, _ in found)
    assert len(_sources()) > 50
    assert any(m == "argparse" for m, _, _ in _imports(ROOT / "tools" / "batch_cli.py"))


PRODUCT = ("kamera_core", "agentwin", "agents")


def _module_graph(packages: tuple[str, ...]) -> dict[str, set[str]]:
    """File-level imports among the modules of `packages`: module -> the modules it imports
    (`from pkg import mod` names the module, `from pkg.mod import name` the module; lazy imports
    inside functions and TYPE_CHECKING blocks count too)."""
    modules = {}
    for pkg in packages:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for name, path in modules.items():
        targets = set()
        for module, names, _ in _imports(path):
            if not names:  # `import a.b.c`: the longest prefix that is one of ours
                while module and module not in modules:
                    module = module.rpartition(".")[0]
                targets.add(module)
            for n in names:
                targets.add(f"{module}.{n}" if f"{module}.{n}" in modules else module)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
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
    return found


def test_no_import_circle_in_the_product():
    """No module of kamera_core, agentwin or agents imports, directly or through others, a module
    that imports it back (lazy and type-checking imports included)."""
    assert _cycles(_module_graph(PRODUCT)) == []


def test_the_circle_check_finds_a_circle():
    graph = _module_graph(PRODUCT)
    assert "agentwin.window_config" in graph and "agentwin.patches.policies" in graph["agentwin.window_config"]
    looped = {**graph, "agentwin.patches.policies": graph["agentwin.patches.policies"] | {"agentwin.window_config"}}
    assert any({"agentwin.patches.policies", "agentwin.window_config"} <= set(c) for c in _cycles(looped))


def test_nothing_imports_the_window_back():
    """The window is built on its parts and imported only by the package's front (`agentwin`): no part of it (engine, store access, patches, eviction, models, store)
    imports `agentwin.window`; the placement policies and fits see the window only through the
    `Host` they are lent, never its modules."""
    graph = _module_graph(PRODUCT)
    importers = {m for m, targets in graph.items() if "agentwin.window" in targets and m.startswith("agentwin")}
    assert importers == {"agentwin"}, importers
    window_modules = {"agentwin.window", "agentwin.window_engine", "agentwin.window_config"}
    patches = {m: t & window_modules for m, t in graph.items() if m.startswith("agentwin.patches")}
    assert len(patches) >= 5 and not any(patches.values()), patches
