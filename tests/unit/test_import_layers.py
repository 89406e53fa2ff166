"""The daemon's and the client's modules import one another in one direction.

Every import counts: module level, inside functions, under TYPE_CHECKING, and
`from package import name` where name is a submodule. A circle anywhere is a
failure that prints the circle, so the layering cannot rot one lazy import at
a time. (That the daemon never imports the client is test_structure's.)
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"reducerd": ROOT / "reducerd", "reducer_client": ROOT / "clients/reducer_client"}


def _module_name(top: str, package_dir: Path, path: Path) -> str:
    parts = [top, *path.relative_to(package_dir).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(top: str) -> dict[str, Path]:
    package_dir = PACKAGES[top]
    return {_module_name(top, package_dir, p): p for p in sorted(package_dir.rglob("*.py"))
            if "_proto" not in p.parts}


def _resolve(node: ast.ImportFrom, name: str, is_package: bool) -> str:
    """The absolute module a (possibly relative) `from ... import` names."""
    if not node.level:
        return node.module or ""
    base = name.split(".") if is_package else name.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def import_graph(top: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports, anywhere in its body."""
    modules = _modules(top)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                module = _resolve(node, name, is_package)
                targets = [module, *(f"{module}.{alias.name}" for alias in node.names)]
            for target in targets:
                # `import a.b.c` runs a, a.b and a.b.c: the deepest known module
                # is the edge (its packages' __init__ are imported on the way, and
                # a package's own __init__ importing its children is no circle).
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None if the graph is acyclic."""
    WHITE, GREY, BLACK = 0, 1, 2
    colour = dict.fromkeys(graph, WHITE)
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        colour[node] = GREY
        stack.append(node)
        for nxt in sorted(graph[node]):
            if colour[nxt] == GREY:
                return [*stack[stack.index(nxt):], nxt]
            if colour[nxt] == WHITE and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        colour[node] = BLACK
        return None

    for start in sorted(graph):
        if colour[start] == WHITE and (cycle := visit(start)):
            return cycle
    return None


def test_find_cycle_finds_a_circle_and_passes_a_chain():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_graph_sees_lazy_relative_and_submodule_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import leaf\n")
    (pkg / "sub" / "leaf.py").write_text("def f():\n    from pkg import top\n")
    (pkg / "top.py").write_text("from pkg.sub import leaf\nimport pkg.sub\n")
    monkeypatch.setitem(PACKAGES, "pkg", pkg)
    graph = import_graph("pkg")
    assert graph == {"pkg": set(), "pkg.sub": {"pkg.sub.leaf"}, "pkg.sub.leaf": {"pkg.top"},
                     "pkg.top": {"pkg.sub.leaf", "pkg.sub"}}
    assert find_cycle(graph) == ["pkg.sub", "pkg.sub.leaf", "pkg.top", "pkg.sub"]


@pytest.mark.parametrize("top", sorted(PACKAGES))
def test_no_import_circle(top):
    graph = import_graph(top)
    assert len(graph) > 10, f"found only {sorted(graph)} under {PACKAGES[top]}"
    cycle = find_cycle(graph)
    assert cycle is None, f"import circle in {top}: {' -> '.join(cycle)}"


def _subpackage(module: str) -> str:
    """reducerd.core.chunks -> reducerd.core; reducerd.__main__ stays itself."""
    return ".".join(module.split(".")[:2])


@pytest.mark.parametrize("top", sorted(PACKAGES))
def test_no_import_circle_between_subpackages(top):
    graph: dict[str, set[str]] = {}
    for module, imported in import_graph(top).items():
        graph.setdefault(_subpackage(module), set()).update(
            _subpackage(m) for m in imported if _subpackage(m) != _subpackage(module))
    cycle = find_cycle(graph)
    assert cycle is None, f"subpackages of {top} import one another: {' -> '.join(cycle)}"


# The daemon's layers, lowest first: each imports only those before it.
DAEMON_LAYERS = ("reducerd.core", "reducerd.ops", "reducerd.service", "reducerd.dataplane",
                 "reducerd.daemon")


def test_the_daemons_layers_import_only_downwards():
    rank = {layer: i for i, layer in enumerate(DAEMON_LAYERS)}
    upward = sorted(f"{module} imports {target}"
                    for module, imported in import_graph("reducerd").items()
                    if _subpackage(module) in rank
                    for target in imported
                    if rank.get(_subpackage(target), -1) > rank[_subpackage(module)])
    assert upward == []
    # Every module of the daemon but its entry points and leaves sits in a layer.
    loose = sorted(m for m in import_graph("reducerd") if _subpackage(m) not in rank
                   and _subpackage(m) not in ("reducerd", "reducerd.__main__",
                                              "reducerd.bench", "reducerd.plan"))
    assert loose == []
