"""Every relative link and ``#anchor`` in README.md and docs/*.md resolves.

A link's target must exist, relative to the file that links to it; an anchor into a
Markdown file must be the slug of one of that file's headings, as GitHub makes them
(lower case, punctuation dropped, spaces as hyphens, ``-1``, ``-2`` on repeats).
Links to other sites are not fetched. Code blocks and code spans are skipped, since
``# comments`` in a shell block are not headings and ``[x](y)`` in code is not a link.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+).*?\1")
# [text](target) and ![alt](target); the text may hold one level of brackets, as in [`x[0]`](y).
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """The file's lines outside fenced code blocks, with code spans blanked, numbered from 1."""
    lines, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)  # code spans keep their text
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links keep their text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(path):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return frozenset(found)


def links(path: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in prose_lines(path):
        for match in LINK.finditer(CODE_SPAN.sub("", line)):
            found.append((number, match.group(1)))
    return found


def broken(path: Path, target: str) -> str | None:
    """Why a link does not resolve, or None if it does."""
    file_part, _, anchor = target.partition("#")
    dest = (path.parent / file_part).resolve() if file_part else path
    if not dest.exists():
        return f"{file_part} does not exist"
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        return f"{file_part or path.name} has no heading with the anchor #{anchor}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    problems = [
        f"{page.relative_to(ROOT)}:{number}: ({target}): {why}"
        for number, target in links(page)
        if not EXTERNAL.match(target) and (why := broken(page, target))
    ]
    assert not problems, "\n".join(problems)


def test_the_checker_finds_links_and_makes_github_slugs(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# Images: a ResNet-18-shaped CNN, 2-core CPU\n"
        "## `SERVE_MODEL` names\n"
        "## Notes\n## Notes\n"
        "```bash\n# not a heading\n[not](a-link.md)\n```\n"
        "See [here](#notes-1), `[nor](this.md)`, ![a figure](fig.png) and [away](https://example.com).\n",
        encoding="utf-8",
    )
    assert anchors(page) == {
        "images-a-resnet-18-shaped-cnn-2-core-cpu",
        "serve_model-names",
        "notes",
        "notes-1",
    }
    assert links(page) == [(9, "#notes-1"), (9, "fig.png"), (9, "https://example.com")]
    assert broken(page, "#notes-1") is None
    assert broken(page, "#notes-2") == "page.md has no heading with the anchor #notes-2"
    assert broken(page, "fig.png") == "fig.png does not exist"
