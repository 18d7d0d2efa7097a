"""`common/` stays plain Python + numpy: no torch, jax, flax, optax or orbax, ever."""

import ast
import pathlib
import subprocess
import sys

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
    modules = sorted(f"common.{p.stem}" for p in COMMON.glob("*.py") if p.stem != "__init__")
    code = (f"import sys, importlib\nfor m in {modules!r}: importlib.import_module(m)\n"
            f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {sorted(FORBIDDEN)!r})\n"
            "print(bad)\nassert not bad, bad\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=COMMON.parent, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert len(modules) >= 9


def test_jax_learner_needs_no_torch():
    """The JAX learner and its engine run where torch is absent (TPU hosts); only the
    cross-backend check (numerics, main) imports torch, inside the functions that compare
    against it."""
    modules = [f"geo3k_jax.{m}" for m in ("layers", "vision_grid", "vision", "text", "model", "weights",
                                           "sharding", "batch", "buckets", "learner",
                                           "check_batch", "numerics", "main", "decode",
                                           "engine", "backend", "train")]
    code = (f"import sys, importlib\nfor m in {modules!r}: importlib.import_module(m)\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=COMMON.parent, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
