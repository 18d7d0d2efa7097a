"""The README's commands name things that exist: make targets, config files, config keys, our
modules and scripts, and the documents it links to (a renamed setting fails here, not in a
user's first run)."""

import re
from pathlib import Path

import pytest

from configs import base

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "docs" / "gpu.md", ROOT / "docs" / "design.md"]
EXTERNAL_MODULES = {"sglang.launch_server"}  # commands of other packages the README shows


def commands(path: Path) -> str:
    """The text of every fenced code block of `path`, joined (continuation lines included)."""
    return "\n".join(re.findall(r"```(?:bash|sh)?\n(.*?)```", path.read_text(), re.S))


def keys(c, prefix="") -> set[str]:
    out = set()
    for k, v in c.items():
        out |= keys(v, f"{prefix}{k}.") if hasattr(v, "items") else {prefix + k}
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_commands_name_what_exists(doc):
    text = commands(doc)
    assert text, f"{doc.name} has no command block"
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    for target in re.findall(r"\bmake ([\w-]+)", text):
        assert target in targets, f"{doc.name}: make {target}"
    for config in re.findall(r"--config=(configs/[\w/]+\.py)", text):
        assert (ROOT / config).exists(), f"{doc.name}: {config}"
    known = keys(base.get_config())
    for key in re.findall(r"--config\.([\w.]+)=", text):
        assert key in known, f"{doc.name}: --config.{key} is no config key"
    for module in re.findall(r"python3? -m ([\w.]+)", text):
        if module in EXTERNAL_MODULES or module in ("pip",):
            continue
        as_path = ROOT / module.replace(".", "/")
        assert as_path.with_suffix(".py").exists() or (as_path / "__init__.py").exists(), \
            f"{doc.name}: python -m {module}"
    for script in re.findall(r"\b(scripts/[\w/]+\.py)", text):
        assert (ROOT / script).exists(), f"{doc.name}: {script}"


def test_links_reach_files():
    text = (ROOT / "README.md").read_text()
    for link in re.findall(r"\]\(((?:docs/)?[\w./-]+\.(?:md|png))\)", text):
        assert (ROOT / link).exists(), f"README links {link}"
