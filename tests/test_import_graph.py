"""The package's import graph: no cycles, and the host stays behind one package. Every import
counts (top level, inside a function, under ``TYPE_CHECKING``), so one module of a pair can always
be read, tested and changed first, and only ``runtime_plugin`` (at any depth) knows the host."""

from __future__ import annotations

import ast
from pathlib import Path

import abstractruntime_mlx

ROOT = Path(abstractruntime_mlx.__file__).parent


HOST_PACKAGES = ("abstractruntime", "abstractagent")
HOST_OWNER = "abstractruntime_mlx.runtime_plugin"


def module_files() -> dict[str, Path]:
    files = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        files[name] = path
    return files


def module_graph() -> dict[str, set[str]]:
    files = module_files()
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in files]
                targets = subs if len(subs) == len(node.names) else [target, *subs]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in files and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles() -> None:
    assert cycles(module_graph()) == []


def test_the_checker_sees_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert "abstractruntime_mlx.engine.core.stream" in module_graph()["abstractruntime_mlx.engine.core.loop"]


def absolute_imports(path: Path) -> set[str]:
    """The top-level package of every absolute import in a file."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
    return found


def host_importers() -> list[str]:
    """Modules outside ``runtime_plugin`` (and its sub-packages) that import the host."""
    return sorted(
        name
        for name, path in module_files().items()
        if name != HOST_OWNER and not name.startswith(HOST_OWNER + ".") and absolute_imports(path) & set(HOST_PACKAGES)
    )


def test_only_runtime_plugin_imports_the_host() -> None:
    assert host_importers() == []


def test_the_host_check_sees_the_sub_packages() -> None:
    files = module_files()
    inside = [name for name in files if name.startswith(HOST_OWNER + ".") and name.count(".") >= 3]
    assert "abstractruntime_mlx.runtime_plugin.hosting.host" in inside
    assert {"abstractruntime", "abstractagent"} <= absolute_imports(
        files["abstractruntime_mlx.runtime_plugin.hosting.host"]
    )
    assert "abstractruntime" in absolute_imports(files["abstractruntime_mlx.runtime_plugin.adapter.stores"])
