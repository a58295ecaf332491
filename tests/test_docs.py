"""The manual and its pages: every relative link in README.md and docs/*.md resolves, README links every docs
page, and docs/ documents every config field, every preset and every public name (a renamed one fails here)."""

import re
from pathlib import Path

import pytest

import ulysses_trainer
from ulysses_trainer.config import FIELDS

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# [text](target) and ![alt](target); a target ends at whitespace or ")" (an optional "title" follows)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
EXTERNAL = ("http://", "https://", "mailto:")


def _links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())  # code blocks hold shell, not links
    text = re.sub(r"`[^`\n]*`", "", text)  # nor does inline code
    return LINK.findall(text)


def test_link_pattern_finds_links_and_skips_code():
    page = ROOT / "README.md"
    assert "docs/configuration.md" in _links(page)
    sample = "see [a](docs/x.md) and ![p](../img.png \"t\") but not `[b](c.md)`"
    assert LINK.findall(re.sub(r"`[^`\n]*`", "", sample)) == ["docs/x.md", "../img.png"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path):
    broken = []
    for target in _links(page):
        if target.startswith(EXTERNAL) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links to missing files {broken}"


def test_readme_links_every_docs_page():
    linked = {Path(t.split("#", 1)[0]).name for t in _links(ROOT / "README.md") if t.startswith("docs/")}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages <= linked, f"README.md does not link {sorted(pages - linked)}"


def test_configuration_page_names_every_field():
    text = (ROOT / "docs" / "configuration.md").read_text()
    missing = [name for name in FIELDS if f"| `{name}` |" not in text]
    assert not missing, f"docs/configuration.md has no row for {missing}"


def test_library_api_page_names_every_public_name():
    text = (ROOT / "docs" / "library-api.md").read_text()
    missing = [name for name in ulysses_trainer.__all__ if not re.search(rf"`{name}\b", text)]
    assert not missing, f"docs/library-api.md does not mention {missing}"


def test_every_preset_is_in_help_and_on_the_configuration_page():
    from ulysses_trainer.cli.train import format_help
    from ulysses_trainer.families import PRESETS

    help_text = format_help()
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert [p for p in PRESETS if not re.search(rf"[ (,]{re.escape(p)}[,)]", help_text)] == []
    assert [p for p in PRESETS if f"`{p}`" not in page] == []


def _drawn_parts(text: str) -> list[str]:
    """The entries of docs/design.md's drawing of the package: `  name/` or `  name.py` under `ulysses_trainer/`."""
    start = text.index("```\nulysses_trainer/\n")
    block = text[start:text.index("```", start + 4)]
    return re.findall(r"^  (\w+)(?:/|\.py)\s", block, re.M)


def test_design_draws_every_part_of_the_package_once():
    # the drawing is where a reader finds a part: a part a move left out, drew twice (families/ once was) or that
    # no longer exists fails here
    pkg = Path(ulysses_trainer.__file__).parent
    parts = {p.name for p in pkg.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))} \
        | {p.stem for p in pkg.glob("*.py") if not p.stem.startswith("_")}
    drawn = _drawn_parts((ROOT / "docs" / "design.md").read_text())
    assert sorted(n for n in set(drawn) if drawn.count(n) > 1) == [], "drawn twice"
    assert sorted(parts - set(drawn)) == [], "parts missing from docs/design.md's drawing"
    assert sorted(set(drawn) - parts) == [], "drawn but not a part of the package"
