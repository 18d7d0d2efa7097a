"""`common/` stays plain Python + numpy (no torch, jax, flax, optax or orbax, ever), and no module
of the project imports, even lazily inside a function, one that imports it back."""

import ast
import pathlib
import subprocess
import sys

import pytest

FORBIDDEN = {"torch", "jax", "jaxlib", "flax", "optax", "orbax"}
COMMON = pathlib.Path(__file__).resolve().parents[1] / "common"


def test_no_framework_import_statement_in_common():
    offenders = []
    for path in COMMON.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    assert offenders == []


def test_whole_common_package_imports_without_frameworks():
    modules = sorted(".".join(p.relative_to(COMMON.parent).with_suffix("").parts)
                     for p in COMMON.rglob("*.py") if p.stem != "__init__")
    code = (f"import sys, importlib\nfor m in {modules!r}: importlib.import_module(m)\n"
            f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {sorted(FORBIDDEN)!r})\n"
            "print(bad)\nassert not bad, bad\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=COMMON.parent, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert len(modules) >= 9


@pytest.mark.slow
def test_jax_learner_needs_no_torch():
    """The JAX learner and its engine run where torch is absent (TPU hosts); only the
    cross-backend check (numerics, main) imports torch, inside the functions that compare
    against it."""
    modules = [f"geo3k_jax.{m}" for m in (
        "models.layers", "core.vision_grid", "models.vision", "models.text", "models.model",
        "models.weights", "core.sharding", "core.batch", "core.buckets", "learner.learner",
        "check.check_batch", "check.numerics", "main", "engine.decode", "engine.engine",
        "engine.backend", "train")]
    code = (f"import sys, importlib\nfor m in {modules!r}: importlib.import_module(m)\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=COMMON.parent, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


PACKAGES = ("common", "geo3k_torch", "geo3k_jax", "configs")


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its text (top level or in a function)."""
    root = COMMON.parent
    files = {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
             for pkg in PACKAGES for p in (root / pkg).rglob("*.py")}
    graph = {}
    for mod, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        graph[mod] = {d for d in deps if d in files and d != mod}
    return graph


def test_no_import_cycle():
    graph, cycles = import_graph(), []

    def visit(mod, path):
        for dep in sorted(graph[mod]):
            if dep in path:
                cycles.append(path[path.index(dep):] + [dep])
            elif dep not in done:
                visit(dep, path + [dep])
        done.add(mod)

    done: set[str] = set()
    for mod in sorted(graph):
        if mod not in done:
            visit(mod, [mod])
    assert cycles == [], cycles[:5]
    assert {"geo3k_torch.prepare", "geo3k_torch.prime"} <= set(graph)  # the graph saw the tree
