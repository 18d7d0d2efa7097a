"""geo3k_jax/ keeps one folder per component, in layers: a module imports (at top level or inside
a function) only modules of its own folder or of a folder below it; learner/ and engine/ never
import each other; the entry points at the top may import any folder, and nothing else sits
there. Reads the source with `ast`: imports no jax."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "geo3k_jax"
# Rank of each folder, lowest first. learner and engine share a rank: neither imports the other.
RANK = {"core": 0, "kernels": 1, "models": 2, "learner": 3, "engine": 3, "tpu": 4, "check": 5}
ENTRY_POINTS = {"__init__.py", "train.py", "main.py", "aot.py"}


def project_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of every geo3k_jax import of `source`, lazy ones included; for
    `from geo3k_jax.x import y` both geo3k_jax.x and geo3k_jax.x.y (y may be a module)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, node.module)]
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.ImportFrom):  # relative: the project never uses them
            found.append((node.lineno, "." * node.level + (node.module or "")))
    return [(line, m) for line, m in found if m.startswith(("geo3k_jax", "."))]


def violations(folder: str, module: str, source: str) -> list[str]:
    """What `source`, the module `module` of folder `folder` (None: an entry point), imports
    against the layering."""
    out = []
    for line, imported in project_imports(source):
        where = f"{folder or '.'}/{module}:{line} imports {imported}"
        if imported.startswith("."):
            out.append(f"{where} (relative)")
            continue
        parts = imported.split(".")
        if folder is None or len(parts) < 2:
            continue  # an entry point imports anything; `import geo3k_jax` imports no module
        target = parts[1]
        if target == folder:
            continue
        if target not in RANK:
            out.append(f"{where} (the top of geo3k_jax/ sits above every folder)")
        elif {folder, target} == {"learner", "engine"}:
            out.append(f"{where} (learner/ and engine/ never import each other)")
        elif RANK[target] >= RANK[folder]:
            out.append(f"{where} ({target}/ is not below {folder}/)")
    return out


def package_violations(package: Path) -> list[str]:
    out = []
    for path in sorted(package.glob("*.py")):
        if path.name not in ENTRY_POINTS:
            out.append(f"{path.name}: a module directly in geo3k_jax/ (it belongs in a folder)")
        out += violations(None, path.name, path.read_text())
    for path in sorted(package.glob("*/")):
        if path.name == "__pycache__":
            continue
        if path.name not in RANK:
            out.append(f"{path.name}/: a folder with no rank in the layout")
            continue
        if not (path / "__init__.py").exists():
            out.append(f"{path.name}/: no __init__.py")
        for module in sorted(path.rglob("*.py")):
            out += violations(path.name, str(module.relative_to(path)), module.read_text())
    return out


def test_the_folders_are_layered():
    assert package_violations(PACKAGE) == []
    assert {p.name for p in PACKAGE.glob("*/") if p.name != "__pycache__"} == set(RANK)


def test_a_folder_init_holds_only_its_docstring():
    for folder in RANK:
        tree = ast.parse((PACKAGE / folder / "__init__.py").read_text())
        assert ast.get_docstring(tree), folder
        assert len(tree.body) == 1, f"{folder}/__init__.py holds more than its docstring"


@pytest.mark.parametrize("folder, source, broken", [
    ("core", "from geo3k_jax.models.layers import Linear\n", True),
    ("kernels", "def f():\n    from geo3k_jax.engine.decode import decode\n", True),  # lazy
    ("learner", "import geo3k_jax.engine.engine\n", True),
    ("engine", "from geo3k_jax.learner import learner\n", True),
    ("models", "from geo3k_jax.tpu.topology import one_host\n", True),
    ("check", "from geo3k_jax.tpu.compiled import report\n", False),
    ("tpu", "from geo3k_jax.check.numerics import run_check\n", True),
    ("models", "from geo3k_jax.kernels.splash import Attention\n", False),
    ("models", "from . import layers\n", True),
    (None, "from geo3k_jax.check.numerics import run_check\n", False),  # an entry point
    ("tpu", "from geo3k_jax import aot\n", True),  # a folder imports no entry point
])
def test_a_bad_import_is_found(folder, source, broken):
    assert bool(violations(folder, "m.py", source)) == broken


def test_a_stray_module_is_found(tmp_path):
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "__init__.py").write_text('"""Core."""\n')
    (tmp_path / "core" / "sharding.py").write_text("from geo3k_jax.engine import engine\n")
    (tmp_path / "splash.py").write_text("")
    found = package_violations(tmp_path)
    assert any("splash.py" in v for v in found) and any("core/sharding.py" in v for v in found)
