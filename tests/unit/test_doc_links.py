"""Every relative link and ``#anchor`` in the docs resolves, and every tool they name exists.

The docs are README.md, docs/*.md and the README.md of scripts/ and its folders.
A link's target must exist, relative to the file that links to it; an anchor into a
Markdown file must be the slug of one of that file's headings, as GitHub makes them
(lower case, punctuation dropped, spaces as hyphens, ``-1``, ``-2`` on repeats).
Links to other sites are not fetched. Code blocks and code spans are skipped, since
``# comments`` in a shell block are not headings and ``[x](y)`` in code is not a link.

Tools are checked everywhere, code blocks and spans included, since that is where the
commands are: every ``scripts/...`` path must exist from the repository's root, and every
``scripts.x.y`` module (as in ``SERVE_MODEL=scripts.fixtures.free_model:create``) must be
importable from it, so that a command copied from the docs finds what it runs.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "scripts").glob("**/README.md")),
]

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+).*?\1")
# [text](target) and ![alt](target); the text may hold one level of brackets, as in [`x[0]`](y).
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)
# A path or module under scripts/, not part of a longer path or name (docs/scripts/x, my.scripts.x).
SCRIPT_PATH = re.compile(r"(?<![\w./-])scripts/[\w./-]*")
SCRIPT_MODULE = re.compile(r"(?<![\w./-])scripts(?:\.\w+)+")


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


def missing_module(dotted: str, root: Path) -> bool:
    """Whether a dotted name names no module under root; the parts after a module are its attributes."""
    here = root
    for part in dotted.split("."):
        if (here / f"{part}.py").is_file():
            return False
        if not (here / part / "__init__.py").is_file():
            return True
        here = here / part
    return False


def missing_tools(path: Path, root: Path = ROOT) -> list[str]:
    """The page's scripts/ paths and scripts.* modules that do not exist, as 'line: name'."""
    found = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        for match in SCRIPT_PATH.finditer(line):
            name = match.group().rstrip(".,:;")
            if not (root / name).exists():
                found.append(f"{number}: {name}")
        for match in SCRIPT_MODULE.finditer(line):
            if missing_module(match.group(), root):
                found.append(f"{number}: {match.group()}")
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_scripts_path_and_module_the_docs_name_exists(page: Path) -> None:
    problems = [f"{page.relative_to(ROOT)}:{where}" for where in missing_tools(page)]
    assert not problems, "these do not exist; fix the command or the path:\n" + "\n".join(problems)


def test_the_tool_check_finds_missing_paths_and_modules(tmp_path: Path) -> None:
    (tmp_path / "scripts" / "bench").mkdir(parents=True)
    for name in ("__init__.py", "bench/__init__.py", "bench/bench.py", "serve"):
        (tmp_path / "scripts" / name).write_text("")
    page = tmp_path / "page.md"
    page.write_text(
        "Run `bash scripts/serve`, then scripts/bench/bench.py.\n"
        "```bash\n.venv/bin/python scripts/bench.py --out docs/scripts/x\nbash scripts/deploy/serve\n```\n"
        "SERVE_MODEL=scripts.bench.bench:create and scripts.bench.gone:create, in scripts.\n",
        encoding="utf-8",
    )
    assert missing_tools(page, tmp_path) == [
        "3: scripts/bench.py",
        "4: scripts/deploy/serve",
        "6: scripts.bench.gone",
    ]


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
