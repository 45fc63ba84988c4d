"""The package's import graph, read from the source (ast, nothing imported): no import cycle, imports point one
way (kernels -> cache -> modules / sizing -> dynamic -> collection / prefetch -> distributed -> recipes / tools), no
`thing_*.py` family of files where a folder belongs, every package in the wheel's package list, and each
subpackage says what it owns and may import. The checkers are run on small bad graphs too, so they can fail."""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# import name -> folder, as pyproject's package-dir installs them
PACKAGES = {"cachedemb": ROOT / "cachedemb", "cachedemb.kernels": ROOT / "kernels",
            "cachedemb.recipes": ROOT / "recipes"}

# (module-name prefix, layer): a module may import modules of a lower layer, or of its own group (same prefix).
# `cachedemb` alone is the facade (__init__: the public names); the offline tools and the recipes sit on top.
LAYERS = [
    ("cachedemb.kernels", 0),
    ("cachedemb.cache", 1),
    ("cachedemb.optim", 1),
    ("cachedemb.modules", 2),
    ("cachedemb.sizing", 2),
    ("cachedemb.dynamic", 3),
    ("cachedemb.storage", 3),
    ("cachedemb.collection", 4),
    ("cachedemb.prefetch", 4),
    ("cachedemb.materialize", 5),
    ("cachedemb", 6),
    ("cachedemb.distributed", 7),
    ("cachedemb.recipes", 8),
    ("cachedemb.tools", 8),
]


def module_files() -> dict[str, Path]:
    """Every module of the installed package, by import name (a package by its own name, for __init__.py)."""
    out = {}
    for name, folder in PACKAGES.items():
        for path in sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mod = ".".join([name, *parts])
            out[mod] = path
    return out


def _type_checking(node) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports_of(mod: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules `mod` imports, anywhere in the file (function-level imports too; not under
    `if TYPE_CHECKING:`). `from pkg import name` counts pkg.name when that is a module, else pkg."""
    tree = ast.parse(path.read_text(), str(path))
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    skip = {id(n) for node in ast.walk(tree) if _type_checking(node) for n in ast.walk(node)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                names.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module") and node.args \
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            names.add(node.args[0].value)
    out = set()
    for name in names:
        parts = name.split(".")
        while parts and ".".join(parts) not in known:
            parts.pop()
        if parts and ".".join(parts) != mod:
            out.add(".".join(parts))
    return out


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {mod: imports_of(mod, path, set(files)) for mod, path in files.items()}


def layer_of(mod: str) -> tuple[str, int]:
    group = max((p for p, _ in LAYERS if mod == p or mod.startswith(p + ".")), key=len)
    return group, dict(LAYERS)[group]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for mod, deps in sorted(graph.items()):
        group, layer = layer_of(mod)
        for dep in sorted(deps):
            dep_group, dep_layer = layer_of(dep)
            if dep_group != group and dep_layer >= layer:
                bad.append(f"{mod} (layer {layer}) imports {dep} (layer {dep_layer})")
    return bad


def prefix_families(folder: Path) -> list[list[str]]:
    """Modules of one folder sharing a first word, one of them with an underscore (`dynamic.py`,
    `dynamic_index.py`): a folder asking to exist."""
    by_word: dict[str, list[str]] = {}
    for path in folder.glob("*.py"):
        if path.stem != "__init__":
            by_word.setdefault(path.stem.split("_")[0], []).append(path.stem)
    return [sorted(v) for v in by_word.values() if len(v) > 1 and any("_" in s for s in v)]


# ----------------------------------------------------------------------------------------------- the package


def test_the_graph_is_read():
    graph = import_graph()
    assert "cachedemb.cache.embedding_cache" in graph["cachedemb.modules.embedding_bag"]
    assert "cachedemb.kernels.dispatch" in graph["cachedemb.kernels.id_index"]  # relative imports resolved
    assert "cachedemb.recipes.dlrm.data.preprocess" in graph["cachedemb.recipes.dlrm.data"]
    assert "cachedemb.optim" in graph["cachedemb"]  # `from cachedemb import optim`: the module


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_no_two_modules_import_each_other():
    graph = import_graph()
    pairs = sorted({tuple(sorted((a, b))) for a, deps in graph.items() for b in deps if a in graph.get(b, ())})
    assert pairs == []


def test_imports_point_one_way():
    assert layer_violations(import_graph()) == []


def test_every_module_has_a_layer():
    for mod in import_graph():
        assert layer_of(mod)


def test_library_imports_no_tool_and_no_recipe():
    graph = import_graph()
    for mod, deps in graph.items():
        if layer_of(mod)[1] < 8:
            assert not {d for d in deps if d.startswith(("cachedemb.tools", "cachedemb.recipes"))}, mod


@pytest.mark.parametrize("folder", sorted({p.parent for p in (ROOT / "cachedemb").rglob("*.py")}),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_prefix_family(folder):
    assert prefix_families(folder) == []


def test_wheel_lists_every_package():
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = {mod for mod, path in module_files().items() if path.name == "__init__.py"}
    assert set(config["packages"]) == packages
    assert {k: ROOT / v for k, v in config["package-dir"].items()} == {k: v for k, v in PACKAGES.items()
                                                                       if k != "cachedemb"}


@pytest.mark.parametrize("package", ["cache", "modules", "collection", "dynamic", "distributed", "storage", "tools",
                                     "sizing"])
def test_subpackage_says_what_it_owns_and_may_import(package):
    doc = ast.get_docstring(ast.parse((ROOT / "cachedemb" / package / "__init__.py").read_text()))
    assert doc and re.search(r"may import|imports? this package|nothing in `?cachedemb`? imports", doc, re.I)


# ------------------------------------------------------------------------------- the checkers on bad graphs


def test_checkers_catch_a_cycle_and_a_backward_import():
    graph = {"cachedemb.modules.a": {"cachedemb.dynamic.b"}, "cachedemb.dynamic.b": {"cachedemb.modules.a"},
             "cachedemb.cache.c": {"cachedemb.collection.d"}, "cachedemb.collection.d": set(),
             "cachedemb.collection.e": {"cachedemb.prefetch"}, "cachedemb.prefetch": set()}
    assert cycles(graph) == [["cachedemb.dynamic.b", "cachedemb.modules.a"]]
    assert layer_violations(graph) == [
        "cachedemb.cache.c (layer 1) imports cachedemb.collection.d (layer 4)",
        "cachedemb.collection.e (layer 4) imports cachedemb.prefetch (layer 4)",  # same layer, other group
        "cachedemb.modules.a (layer 2) imports cachedemb.dynamic.b (layer 3)",
    ]


def test_reader_sees_lazy_relative_and_string_imports(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import importlib\nfrom typing import TYPE_CHECKING\n"
                   "if TYPE_CHECKING:\n    from cachedemb.tools import aot\n"
                   "def f():\n    from . import policy\n    from ..modules.errors import X\n"
                   "    return importlib.import_module('cachedemb.prefetch')\n")
    known = {"cachedemb.cache.policy", "cachedemb.modules.errors", "cachedemb.prefetch", "cachedemb.tools.aot"}
    assert imports_of("cachedemb.cache.m", src, known) == {"cachedemb.cache.policy", "cachedemb.modules.errors",
                                                           "cachedemb.prefetch"}


def test_prefix_family_is_found(tmp_path):
    for name in ("dynamic.py", "dynamic_index.py", "plan.py", "model_parallel.py"):
        (tmp_path / name).write_text("")
    assert prefix_families(tmp_path) == [["dynamic", "dynamic_index"]]
