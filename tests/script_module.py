"""Import a file of scripts/ as a module, for the tests of its functions."""

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str):
    """scripts/<name>.py, executed as the module `name` (its `__main__` block not run)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def import_script(name: str):
    """scripts/<name>.py imported as the module `name` with scripts/ on the path, as the check
    scripts import their sibling modules (gpu_check imports gpu_sections): one module per name,
    so a test that patches `check.gpu_sections` patches what the check runs."""
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    return importlib.import_module(name)


def script_fixture(name: str):
    """A module-scoped fixture of `import_script(name)`, named as the attribute it is
    assigned to (`check = script_fixture("gpu_check")`)."""
    return pytest.fixture(scope="module")(lambda: import_script(name))
