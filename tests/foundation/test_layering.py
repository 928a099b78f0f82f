"""The packages' layering (docs/ARCHITECTURE.md, each package's __init__ docstring), read
from the source: no import circles, no imports of another module's private names, and
each package imports only the packages below it."""
import ast
import graphlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _modules() -> dict[str, Path]:
    out = {}
    for top in ("eth", "megatron/hpp"):
        for path in (ROOT / top).rglob("*.py"):
            name = path.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".")
            out[name.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(imported project module, names taken from it) for every import in the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            cands = [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            cands = [(f"{node.module}.{a.name}", []) if f"{node.module}.{a.name}" in MODULES
                     else (node.module, [a.name]) for a in node.names]
        else:
            continue
        for mod, names in cands:
            while mod and mod not in MODULES:
                mod = mod.rpartition(".")[0]
            if mod:
                out.append((mod, names))
    return out


GRAPH = {name: {m for m, _ in _imports(path)} - {name} for name, path in MODULES.items()}


def test_the_graph_is_read():
    assert "eth.cost.equations" in GRAPH["eth.cost.model"]
    assert "megatron.hpp.parallel.topology" in GRAPH["megatron.hpp.training.loop"]


def test_no_import_circles():
    try:
        tuple(graphlib.TopologicalSorter(GRAPH).static_order())
    except graphlib.CycleError as err:
        pytest.fail(f"modules import each other: {' -> '.join(err.args[1])}")


def test_no_module_imports_private_names():
    bad = [f"{name} imports {n} from {mod}" for name, path in MODULES.items()
           for mod, names in _imports(path) for n in names if n.startswith("_") and not n.startswith("__")]
    assert not bad, bad


# package -> the project packages it may import (besides itself and eth.errors / eth.fileio)
ALLOWED = {
    "eth.spec": set(),
    "eth.layout": {"eth.spec"},
    "eth.profiles": {"eth.spec"},
    "eth.cost": {"eth.spec", "eth.layout", "eth.profiles"},
    "eth.planner": {"eth.spec", "eth.layout", "eth.profiles", "eth.cost"},
    "eth.report": {"eth.spec", "eth.layout", "eth.profiles", "eth.cost"},
    "megatron.hpp.models": {"eth", "megatron.hpp.compat"},
    "megatron.hpp.data": {"eth", "megatron.hpp.compat"},
    "megatron.hpp.parallel": {"eth", "megatron.hpp.compat", "megatron.hpp.data"},
    "megatron.hpp.distributed": {"eth", "megatron.hpp.compat", "megatron.hpp.models"},
    "megatron.hpp.profiling": {"eth", "megatron.hpp.compat", "megatron.hpp.rank_exit", "megatron.hpp.models",
                               "megatron.hpp.data", "megatron.hpp.distributed"},
}


def _package(name: str) -> str:
    for pkg in ALLOWED:
        if name == pkg or name.startswith(pkg + "."):
            return pkg
    return ""


@pytest.mark.parametrize("pkg", sorted(ALLOWED))
def test_package_imports_only_the_layers_below(pkg):
    allowed = ALLOWED[pkg] | {pkg, "eth.errors", "eth.fileio"}
    bad = sorted(f"{name} -> {dep}" for name, deps in GRAPH.items() if _package(name) == pkg for dep in deps
                 if not any(dep == a or dep.startswith(a + ".") for a in allowed))
    assert not bad, bad


def test_eth_never_imports_the_runtime():
    bad = sorted(f"{name} -> {dep}" for name, deps in GRAPH.items() if name.startswith("eth")
                 for dep in deps if dep.startswith("megatron"))
    assert not bad, bad
    for name, path in MODULES.items():
        if name.startswith("eth"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                    assert not any(m.split(".")[0] == "torch" for m in mods), f"{name} imports torch"
