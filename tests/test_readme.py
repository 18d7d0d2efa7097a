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


STATUS_HEADING = "## What has run where"
MAX_CELL = 200  # characters: a status cell is one line and a link, its details live in docs/


def status_cells(text: str) -> list[str]:
    """The cells of the first table under the README's status heading."""
    assert STATUS_HEADING in text, f"the README has no {STATUS_HEADING!r} section"
    section = text.split(STATUS_HEADING, 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    assert rows, "the status section has no table"
    return [cell.strip() for row in rows for cell in row.strip().strip("|").split("|")]


def test_status_table_cells_are_short():
    long = [c[:60] + "..." for c in status_cells((ROOT / "README.md").read_text())
            if len(c) > MAX_CELL]
    assert not long, f"status cells over {MAX_CELL} characters (move the details to docs/): {long}"


# "issue 48", "issues 47 and 48", "issue #48", "#48": the project's tracker, which a reader of the
# docs cannot follow. Another project's thread names its project ("verl#2579") and stays legal.
ISSUE_NUMBER = re.compile(r"\bissues?\s+#?\d+|(?<![\w/.-])#\d+\b", re.I)


def issue_citations(text: str) -> list[str]:
    return [m.group(0) for m in ISSUE_NUMBER.finditer(text)]


@pytest.mark.parametrize("text, cited", [
    ("the target (issue 48): first try", ["issue 48"]),
    ("Issue #47 asked that", ["Issue #47"]),
    ("see #49 and issues 47", ["#49", "issues 47"]),
    ("actor MFU 0.5 (verl#2579), slime#1072, design.md#data-layout, an issue with it", []),
])
def test_issue_citations_are_found(text, cited):
    assert issue_citations(text) == cited


def test_docs_cite_no_issue_numbers():
    cited = {str(p.relative_to(ROOT)): issue_citations(p.read_text())
             for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]}
    cited = {name: found for name, found in cited.items() if found}
    assert not cited, f"issue numbers a reader cannot follow: {cited}"
