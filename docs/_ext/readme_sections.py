"""Pages made of the README's sections, so that the guide has one source.

A page holds a line ``{readme} START | END``: it is replaced, when Sphinx
reads the page, by the README from the heading line START up to (not
including) the heading line END (or the end). Headings are shifted so the
section's top level sits under the page's title, and links are rewritten:
``#anchor`` to the page that holds that heading, ``docs/...`` to the file
relative to the page, and links to other files of the repository become
their text. A link whose anchor no page holds is left as it is, and the
build (warnings as errors) fails on it.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from sphinx.application import Sphinx

DOCS = Path(__file__).resolve().parent.parent
README = DOCS.parent / "README.md"
MARKER = re.compile(r"^\{readme\} (?P<start>.+?)(?: \| (?P<end>.+))?$", re.M)
HEADING = re.compile(r"^(#{1,6}) (.+)$", re.M)
LINK = re.compile(r"\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)\)")
FENCE = re.compile(r"^```", re.M)
#: README anchors of sections no page includes, and where the site has them.
ELSEWHERE = {"settings": "reference/settings"}


def slug(title: str) -> str:
    """GitHub's heading anchor (the README's links use these), and the site's."""
    text = re.sub(r"[^\w\- ]", "", title.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _slice(readme: str, start: str, end: str | None) -> str:
    lines = readme.splitlines(keepends=True)
    begin = next(i for i, line in enumerate(lines) if line.rstrip("\n") == start)
    stop = len(lines)
    if end is not None:
        stop = next(i for i, line in enumerate(lines) if i > begin and line.rstrip("\n") == end)
    return "".join(lines[begin + 1 : stop])


def _headings(text: str) -> list[tuple[int, str]]:
    """``(level, title)`` of the headings of ``text`` outside code fences."""
    found = []
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        match = HEADING.match(line)
        if match and not fenced:
            found.append((len(match.group(1)), match.group(2)))
    return found


def _pages(app: Sphinx) -> dict[str, tuple[str, str | None]]:
    """Every page that includes a README section: docname -> (start, end)."""
    pages = {}
    for path in DOCS.rglob("*.md"):
        if "_build" in path.parts:
            continue
        match = MARKER.search(path.read_text())
        if match:
            docname = path.relative_to(DOCS).with_suffix("").as_posix()
            pages[docname] = (match["start"], match["end"])
    return pages


def _anchors(readme: str, pages: dict[str, tuple[str, str | None]]) -> dict[str, str]:
    """README anchor -> the page holding it (``page#`` when it is the page itself)."""
    where = {anchor: f"{page}#" for anchor, page in ELSEWHERE.items()}
    for docname, (start, end) in pages.items():
        where[slug(start.lstrip("# "))] = f"{docname}#"  # the page's own title
        for _level, title in _headings(_slice(readme, start, end)):
            where[slug(title)] = docname
    return where


def _relative(target: str, docname: str) -> str:
    """``target`` (relative to docs/) as a link from page ``docname``."""
    return posixpath.relpath(target, posixpath.dirname(docname) or ".")


def render(readme: str, docname: str, start: str, end: str | None, where: dict[str, str]) -> str:
    """The README section for page ``docname``, headings shifted and links rewritten."""
    text = _slice(readme, start, end)
    levels = [level for level, _ in _headings(text)]
    shift = (min(levels) - 2) if levels else 0

    def heading(match: re.Match[str]) -> str:
        return f"{'#' * max(2, len(match.group(1)) - shift)} {match.group(2)}"

    out, fenced = [], False
    for line in text.splitlines(keepends=True):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            line = HEADING.sub(heading, line)
            line = LINK.sub(lambda m: _link(m, docname, where), line)
        out.append(line)
    return "".join(out)


def _link(match: re.Match[str], docname: str, where: dict[str, str]) -> str:
    text, target = match["text"], match["target"]
    if target.startswith(("http://", "https://", "mailto:")):
        return match.group(0)
    if target.startswith("#"):
        page = where.get(target[1:])
        if page is None or page.rstrip("#") == docname:
            return match.group(0)
        if page.endswith("#"):  # the section that makes that page: link the page
            return f"[{text}]({_relative(page[:-1] + '.md', docname)})"
        return f"[{text}]({_relative(page + '.md', docname)}{target})"
    if target.startswith("docs/"):
        return f"[{text}]({_relative(target.removeprefix('docs/'), docname)})"
    return text  # a file of the repository, not of the site


def _source_read(app: Sphinx, docname: str, source: list[str]) -> None:
    match = MARKER.search(source[0])
    if not match:
        return
    readme = README.read_text()
    where = _anchors(readme, _pages(app))
    section = render(readme, docname, match["start"], match["end"], where)
    source[0] = source[0][: match.start()] + section + source[0][match.end() :]


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("source-read", _source_read)
    return {"parallel_read_safe": True, "version": "1"}
