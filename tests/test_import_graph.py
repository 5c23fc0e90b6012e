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


# --- the engine's public face ----------------------------------------------------------------

ENGINE = "abstractruntime_mlx.engine"
FACE = f"{ENGINE}.api"


def reaches_past_the_face(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module, engine module) for every import from outside ``engine/`` of an engine module
    other than the face."""
    return sorted(
        (name, target)
        for name, targets in graph.items()
        if name != ENGINE and not name.startswith(ENGINE + ".")
        for target in targets
        if target.startswith(ENGINE + ".") and target != FACE
    )


def test_outside_engine_imports_only_the_face() -> None:
    assert reaches_past_the_face(module_graph()) == []


def test_the_face_check_sees_a_deep_import() -> None:
    graph = {
        "abstractruntime_mlx.provider.x": {f"{ENGINE}.core.loop", FACE},
        f"{ENGINE}.core.loop": {f"{ENGINE}.backends.backend"},
    }
    assert reaches_past_the_face(graph) == [("abstractruntime_mlx.provider.x", f"{ENGINE}.core.loop")]
    assert FACE in module_graph()["abstractruntime_mlx.provider.mlx_provider"]


# The engine's folders, top first: each imports only the folders below it.
ENGINE_FLOORS = ("core", "backends", "cache", "model")


def upward_engine_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module, target) for every engine import from a folder to one at or above it in
    ``ENGINE_FLOORS`` (a folder's own modules excepted)."""

    def floor(module: str) -> int | None:
        parts = module.split(".")
        if module.startswith(ENGINE + ".") and len(parts) > 3 and parts[2] in ENGINE_FLOORS:
            return ENGINE_FLOORS.index(parts[2])
        return None

    return sorted(
        (name, target)
        for name, targets in graph.items()
        for target in targets
        if (a := floor(name)) is not None and (b := floor(target)) is not None and b < a
    )


def test_engine_folders_import_only_those_below() -> None:
    assert upward_engine_imports(module_graph()) == []


def test_the_floor_check_sees_an_upward_import() -> None:
    graph = {
        f"{ENGINE}.backends.text_loop": {f"{ENGINE}.core.scheduler", f"{ENGINE}.backends.rows"},
        f"{ENGINE}.core.loop": {f"{ENGINE}.backends.backend", f"{ENGINE}.model.model"},
    }
    assert upward_engine_imports(graph) == [(f"{ENGINE}.backends.text_loop", f"{ENGINE}.core.scheduler")]


# --- upstream private names: one module per engine folder ------------------------------------

UPSTREAM_PACKAGES = ("mlx", "mlx_lm", "mlx_vlm")
# The one module of each folder that may touch upstream's private names; core/ touches none.
UPSTREAM_MODULES = {
    "backends": f"{ENGINE}.backends.backend",
    "model": f"{ENGINE}.model.upstream",
    "cache": f"{ENGINE}.cache.upstream",
}
# Private upstream attributes whose names the package also uses for fields of its own
# (``LoadedModel._detokenizer``): touched on anything but ``self``, they are upstream's.
SHARED_PRIVATE_NAMES = frozenset({"_detokenizer", "_tokenizer"})
# Packages whose private attribute reads are another library's, not upstream's.
NOT_UPSTREAM = {"abstractruntime_mlx.cli": "argparse's sub-parsers and actions"}


def _upstream_bindings(tree: ast.AST) -> set[str]:
    """Names a module binds from upstream imports (at any depth)."""
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in UPSTREAM_PACKAGES:
                bound.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Import):
            bound.update(
                (a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] in UPSTREAM_PACKAGES
            )
    return bound


def _upstream_subclasses(tree: ast.AST) -> list[ast.ClassDef]:
    bound = _upstream_bindings(tree)
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
        and any(isinstance(b, (ast.Name, ast.Attribute)) and ast.unparse(b).split(".")[0] in bound for b in node.bases)
    ]


def own_private_names(trees: list[ast.AST]) -> set[str]:
    """Private names the package defines itself: functions, classes, fields (assigned on
    ``self``), globals and parameters, outside classes that extend an upstream class (whose
    overrides are upstream's)."""
    names: set[str] = set()
    for tree in trees:
        inside_upstream = {id(n) for cls in _upstream_subclasses(tree) for n in ast.walk(cls) if n is not cls}
        for node in ast.walk(tree):
            if id(node) in inside_upstream:
                continue
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    names.add(node.attr)  # a field of one of ours (``other._x = ...`` may be upstream's)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return {n for n in names if n.startswith("_")}


def upstream_private_uses(tree: ast.AST, own: set[str]) -> list[str]:
    """What one module touches of upstream's private names, by line: a private name imported
    from an upstream package, a class extending an upstream class, an attribute ``x._name``
    that the package does not define (or that upstream shares with it, unless on ``self``)."""
    found: list[tuple[int, str]] = [
        (node.lineno, f"import {node.module}.{a.name}")
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
        if node.module.split(".")[0] in UPSTREAM_PACKAGES
        for a in node.names
        if a.name.startswith("_") or any(part.startswith("_") for part in node.module.split("."))
    ]
    subclasses = _upstream_subclasses(tree)
    found += [(cls.lineno, f"class {cls.name} extends upstream") for cls in subclasses]
    inside_upstream = {id(n) for cls in subclasses for n in ast.walk(cls)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        on_self = (
            isinstance(node.value, ast.Name) and node.value.id in ("self", "cls") and id(node) not in inside_upstream
        )
        if node.attr in SHARED_PRIVATE_NAMES and not on_self or node.attr not in own and not on_self:
            found.append((node.lineno, ast.unparse(node)))
    return [f"{line}: {what}" for line, what in sorted(found)]


def misplaced_upstream_uses() -> dict[str, list[str]]:
    files = module_files()
    trees = {name: ast.parse(path.read_text(encoding="utf-8")) for name, path in files.items()}
    own = own_private_names(list(trees.values()))
    misplaced: dict[str, list[str]] = {}
    for name, tree in trees.items():
        if any(name == p or name.startswith(p + ".") for p in NOT_UPSTREAM):
            continue
        folder = name.split(".")[2] if name.startswith(ENGINE + ".") and name.count(".") >= 3 else None
        if folder is not None and UPSTREAM_MODULES.get(folder) == name:
            continue
        uses = upstream_private_uses(tree, own)
        if uses:
            misplaced[name] = uses
    return misplaced


def test_upstream_private_names_are_touched_in_one_module_per_folder() -> None:
    assert misplaced_upstream_uses() == {}


def test_the_upstream_check_sees_each_kind_of_use() -> None:
    tree = ast.parse(
        "from mlx_vlm.apc import APCManager, _free_ram_bytes\n"
        "class Counted(APCManager):\n"
        "    def _make_room(self): return self._free_head\n"
        "def cut(cache): cache._idx -= 1\n"
        "def ours(engine): return engine._worker\n"
    )
    uses = upstream_private_uses(tree, own={"_worker"})
    assert uses == [
        "1: import mlx_vlm.apc._free_ram_bytes",
        "2: class Counted extends upstream",
        "3: self._free_head",
        "4: cache._idx",
    ]
    # An override's name is upstream's, so it is not taken for one of the package's own names.
    assert "_make_room" not in own_private_names([tree]) and "_worker" not in own_private_names([tree])
    files = module_files()
    for module in UPSTREAM_MODULES.values():
        assert upstream_private_uses(ast.parse(files[module].read_text(encoding="utf-8")), set()), module


def test_each_upstream_module_names_the_pinned_versions() -> None:
    """The versions each upstream module was checked against are the ones pyproject.toml pins."""
    pyproject = (ROOT.parents[1] / "pyproject.toml").read_text(encoding="utf-8")
    files = module_files()
    for package, module in (
        ("mlx-vlm", UPSTREAM_MODULES["backends"]),
        ("mlx-lm", UPSTREAM_MODULES["backends"]),
        ("mlx-lm", UPSTREAM_MODULES["model"]),
        ("mlx-vlm", UPSTREAM_MODULES["cache"]),
    ):
        pin = next(line for line in pyproject.splitlines() if line.strip().startswith(f'"{package}>='))
        spec = pin.strip().strip('",')[len(package) :]
        assert "<" in spec, f"{package} has no upper bound in pyproject.toml"
        docstring = ast.get_docstring(ast.parse(files[module].read_text(encoding="utf-8"))) or ""
        assert spec in docstring.replace(" ", "").replace("``", ""), (module, package, spec)


def test_the_backend_protocol_and_request_import_no_mlx() -> None:
    """A backend can be faked, and a request built, without loading MLX."""
    import os
    import subprocess
    import sys

    probe = (
        "import sys\n"
        "import abstractruntime_mlx.engine.backends.rows, abstractruntime_mlx.engine.core.request\n"
        "print(sorted(m for m in ('mlx', 'mlx.core', 'mlx_lm', 'mlx_vlm') if m in sys.modules))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT.parent)}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "[]"
