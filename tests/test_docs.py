"""The README is the user's page and docs/ holds the rest: the README stays short, opens with its
two commands, links every page under docs/, and every relative link in them lands on a file and
a heading that exist."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
PAGES = sorted((REPO / "docs").glob("*.md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
INSTALL_AND_DEMO = (
    "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/featherweight setup"
    " && .venv/bin/featherweight demo"
)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading's text."""
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return slug.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # `# comments` are no headings
    return {_anchor(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def _code_blocks(text: str) -> list[str]:
    return re.findall(r"```\w*\n(.*?)```", text, flags=re.S)


def test_readme_is_short_and_opens_with_its_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) < 300
    assert _code_blocks(text)[:2] == [INSTALL_AND_DEMO + "\n", "scripts/test\n"]


def test_readme_links_every_page_under_docs():
    linked = {
        (README.parent / target.split("#")[0]).resolve()
        for target in LINK.findall(README.read_text())
    }
    assert [page.name for page in PAGES if page.resolve() not in linked] == []


def test_every_relative_link_lands_on_a_file_and_heading():
    broken = []
    for page in [README, *PAGES]:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            destination = (page.parent / path).resolve() if path else page
            if not destination.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and destination.suffix == ".md" and anchor not in _anchors(destination):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert broken == []
