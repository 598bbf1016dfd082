"""The README stays short, links every page of docs/, and every link in it and in docs/ leads somewhere.

README.md is what a newcomer reads first: at most 250 lines, the rest lives in docs/. A
relative link (a file, or a heading of a file as GitHub anchors it) must resolve, so moving
a section or renaming a page cannot leave readers at a dead end.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation out, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    in_code = False
    found = set()
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            found.add(_anchor(line.lstrip("#")))
    return found


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


def test_relative_links_resolve():
    broken = []
    for page in _pages():
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target) or target.startswith("#") and not target[1:]:
                continue  # a web address or a bare "#"
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_readme_links_every_docs_page():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    linked = {target.partition("#")[0] for target in LINK.findall(readme)}
    pages = sorted(f"docs/{page.name}" for page in (ROOT / "docs").glob("*.md"))
    assert [page for page in pages if page not in linked] == [], "pages of docs/ the README does not link"
