"""Every link between the pages resolves: each relative link of README.md, protocol.md and
docs/**/*.md names a file that exists and, for a page, a heading it has (the anchor as GitHub
makes it); and every page the package's messages, the tests and the pages name in plain text
(`docs/<page>.md`) exists. Pages move; this says which link a move broke."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", REPO / "protocol.md", *sorted((REPO / "docs").rglob("*.md"))]
#: ``[text](target)`` and ``![alt](target)``; a target has no spaces (titles are not used here).
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")
CODE_SPAN = re.compile(r"`+[^`]*`+")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of the lines outside fenced code blocks, with inline code blanked."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, CODE_SPAN.sub("", line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text (links as their text, no markup) lower-cased,
    everything but letters, digits, ``_``, ``-`` and spaces dropped, spaces made ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor of ``page``'s headings; a repeated one also as ``name-1``, ``name-2``, ..."""
    seen: dict[str, int] = {}
    found = set()
    fenced = False
    for line in page.read_text().splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
        if fenced or not (m := re.match(r"^#{1,6} +(.*?) *#* *$", line)):
            continue
        name = slug(m.group(1))
        found.add(f"{name}-{seen[name]}" if name in seen else name)
        seen[name] = seen.get(name, 0) + 1
    return found


def links(page: Path) -> list[tuple[int, str]]:
    return [(n, m.group(1)) for n, line in prose_lines(page.read_text()) for m in LINK.finditer(line)]


def broken(page: Path) -> list[str]:
    """What is wrong with ``page``'s relative links, one line each."""
    problems = []
    for number, target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not ours to check
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(REPO) if REPO in page.parents else page.name}:{number}: {target}"
        if not file.exists():
            problems.append(f"{where}: no such file")
        elif REPO not in file.parents and file != page:
            problems.append(f"{where}: outside the repository")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            problems.append(f"{where}: {file.name} has no heading with that anchor")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken(page) == []


def test_the_pages_link_to_each_other() -> None:
    """Every page is reachable from README.md through the links of the pages."""
    reached, todo = set(), [REPO / "README.md"]
    while todo:
        page = todo.pop()
        if page in reached:
            continue
        reached.add(page)
        for _, target in links(page):
            path = target.partition("#")[0]
            if path and not re.match(r"^[a-z][a-z0-9+.-]*:", path):
                file = (page.parent / path).resolve()
                if file.suffix == ".md" and file.is_file():
                    todo.append(file)
    assert sorted(str(p.relative_to(REPO)) for p in set(PAGES) - reached) == []


#: Pages that record history: they name pages as they were then.
RECORDS = {REPO / "docs" / "bench" / "earlier.md"}


def test_every_page_named_in_plain_text_exists() -> None:
    """``docs/<page>.md`` in the package's docstrings and messages (`saev-shards dump --help`
    names docs/dump.md), in the tests, the benchmarks, the Makefile and the pages."""
    sources = [
        *(REPO / "saev_shards").rglob("*.py"),
        *(REPO / "tests").rglob("*.py"),
        *(REPO / "benchmarks").rglob("*.py"),
        *(REPO / "benchmarks").glob("*.sh"),
        REPO / "Makefile",
        *(page for page in PAGES if page not in RECORDS),
    ]
    missing = sorted(
        f"{source.relative_to(REPO)}: {name}"
        for source in sources
        for name in set(re.findall(r"\bdocs/[\w/.-]+?\.md\b", source.read_text()))
        if not (REPO / name).is_file()
    )
    assert missing == []


def test_the_checks_catch_what_they_should(tmp_path: Path) -> None:
    assert (
        slug("Every chosen layer from one read: `stack_layers=True`")
        == "every-chosen-layer-from-one-read-stack_layerstrue"
    )
    assert slug("9.5 saev's earlier formats (read only)") == "95-saevs-earlier-formats-read-only"
    assert slug("Pickle shards — `--from pickle`") == "pickle-shards----from-pickle"
    assert slug("See [the guide](x.md) here") == "see-the-guide-here"
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## Twice\n\n## Twice\n\n```\n## not a heading [x](gone.md)\n```\n")
    assert anchors(page) == {"title", "twice", "twice-1"}
    assert links(page) == []
    page.write_text("[a](#twice) `[b](gone.md)` [c](https://example.com/x) ![d](missing.png)\n\n## Twice\n")
    assert [t for _, t in links(page)] == ["#twice", "https://example.com/x", "missing.png"]
    assert broken(page) == ["page.md:1: missing.png: no such file"]
    page.write_text("[a](#nope) [b](gone.md#x)\n\n## Here\n")
    assert broken(page) == [
        "page.md:1: #nope: page.md has no heading with that anchor",
        "page.md:1: gone.md#x: no such file",
    ]
