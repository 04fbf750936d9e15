"""Every relative link in README.md and docs/ (docs/results/ included) resolves:
the file, and the ``#anchor`` to one of its headings (GitHub's slugs). Links
inside code are not links; neither are ``#`` lines inside fenced code blocks
headings. The guides (README.md and docs/ outside docs/results/) carry no
dates: measurements, with their dates, live in the lab notebook, docs/results/."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RESULTS = ROOT / "docs" / "results"
GUIDES = [path for path in DOCS if RESULTS not in path.parents]
DATE = re.compile(r"20\d\d-\d\d-\d\d")

FENCE = re.compile(r"^(`{3,}|~{3,})[^\n]*\n.*?^\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]"  # [text], [a [nested] text]
                  r"\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")  # (target "title")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:


def _prose(text: str) -> str:
    """``text`` without fenced blocks (lines kept, emptied) and code spans."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return CODE_SPAN.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: link text kept, markup and punctuation
    dropped, lower case, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of every heading of ``path`` (repeats get ``-1``, ``-2``...)."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), path.read_text())
    seen: dict[str, int] = {}
    out = set()
    for _, title in HEADING.findall(text):
        base = slug(title)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path: Path) -> list[str]:
    """``target (why)`` for every relative link of ``path`` that does not resolve."""
    bad = []
    for target in LINK.findall(_prose(path.read_text())):
        if EXTERNAL.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target} (no heading with this anchor in {dest.name})")
    return bad


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    assert broken_links(path) == []


def test_the_notebook_is_covered() -> None:
    """The link check reaches docs/results/, and the guides exclude it."""
    notebook = [path for path in DOCS if RESULTS in path.parents]
    assert RESULTS / "README.md" in notebook and len(notebook) > 1
    assert not set(notebook) & set(GUIDES)
    assert ROOT / "README.md" in GUIDES and ROOT / "docs" / "taylor.md" in GUIDES


@pytest.mark.parametrize("path", GUIDES, ids=lambda p: str(p.relative_to(ROOT)))
def test_guides_carry_no_dates(path: Path) -> None:
    """Guides and reference say how things are, not when: a dated measurement
    belongs in docs/results/, and the guide links to it."""
    text = path.read_text(encoding="utf-8")
    dated = [f"line {text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
             for m in DATE.finditer(text)]
    assert dated == [], f"dates in a guide (move them to docs/results/): {dated}"


def test_the_checker_finds_missing_files_and_anchors(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text(
        "# Other page\n\n## The `taylor` certificate (ours)\n\n## Repeat\n\n## Repeat\n"
        "```bash\n# not a heading\n```\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n## Known limits\n\n"
        "[ok](other.md) [ok](other.md#the-taylor-certificate-ours) "
        "[ok](other.md#repeat-1) [ok](#known-limits) [ok](https://example.org/x) "
        "![ok](other.md)\n"
        "[missing](nothere.md) [bad anchor](other.md#nope) [bad](#not-a-heading)\n"
        "`[code](is-not-a-link.md)`\n"
        "```\n[fenced](not-a-link-either.md)\n```\n")
    assert broken_links(page) == [
        "nothere.md (no such file)",
        "other.md#nope (no heading with this anchor in other.md)",
        "#not-a-heading (no heading with this anchor in page.md)",
    ]
    assert "not-a-heading" not in anchors(tmp_path / "other.md")
    assert slug("Training for the certificate (`--relu-stability`)") == (
        "training-for-the-certificate---relu-stability")


def test_readme_stays_short() -> None:
    """The README chooses for the user and links the rest (≤ 10,000 characters)."""
    assert len((ROOT / "README.md").read_text(encoding="utf-8")) <= 10_000
