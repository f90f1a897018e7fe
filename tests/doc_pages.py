"""The Markdown pages the documentation tests read, and how a page's links and headings are
found: fenced code blocks and code spans are not Markdown, so nothing in them is a link or a
heading; a heading's anchor follows GitHub's rule (the heading's text, lower case, every
character but letters, digits, `_`, `-` and spaces dropped, each space a `-`, and `-1`, `-2`,
... after a repeated one)."""

from __future__ import annotations

import dataclasses
import re
import urllib.parse
from pathlib import Path

from helpers import REPO

ROOT = Path(REPO)
# README.md, every page under docs/, and the pages they link to most: the measurement records
# of benchmarks/results/, the CHANGELOG, CONTRIBUTING, the kernels' README and the recipes'.
LINK_CHECKED = ["README.md", "CHANGELOG.md", "CONTRIBUTING.md", "csrc/README.md", "docs", "benchmarks", "recipes"]


def markdown_files(*places: str) -> list[Path]:
    """The .md files at `places` (files or folders, relative to the repository), sorted."""
    found: set[Path] = set()
    for place in places:
        path = ROOT / place
        if path.is_file():
            found.add(path)
        elif path.is_dir():
            found.update(path.rglob("*.md"))
    return sorted(found)


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


_FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) for every line outside fenced code blocks, code spans blanked."""
    out, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
            continue
        if fence is not None:  # a closing fence: the same character, at least as long, nothing after it
            run = m.group(1) if m else ""
            if run[:1] == fence[0] and len(run) >= len(fence) and not line.strip()[len(run):]:
                fence = None
            continue
        out.append((number, _CODE_SPAN.sub(lambda c: " " * len(c.group(0)), line)))
    return out


_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_HTML_ANCHOR = re.compile(r"<a\s+[^>]*(?:id|name)\s*=\s*[\"']([^\"']+)[\"']", re.I)


def heading_text(raw: str) -> str:
    """The text GitHub renders for a heading's source: code spans keep their content, links and
    images their text, HTML tags and emphasis markers go."""
    text = _CODE_SPAN.sub(lambda c: c.group(2).strip(), raw)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"!?\[([^\]]*)\]\[[^\]]*\]", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)
    return text.replace("*", "")


def slug(text: str) -> str:
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor a page defines: its headings' (GitHub's rule) and explicit <a id/name>."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    lines = text.splitlines()
    kept = {number for number, _ in prose_lines(text)}
    for number, line in enumerate(lines, 1):
        if number not in kept:
            continue
        m = _HEADING.match(line)
        if m:
            base = slug(heading_text(m.group(2)))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
        found.update(_HTML_ANCHOR.findall(line))
    return found


@dataclasses.dataclass(frozen=True)
class Link:
    line: int
    target: str  # as written


_INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^\s)]+)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
_REF_DEF = re.compile(r"^\s{0,3}\[([^\]]+)\]:\s*(<[^>]*>|\S+)")
_REF_USE = re.compile(r"\[((?:[^\[\]]|\[[^\[\]]*\])+)\]\[([^\]]*)\]")
_HTML_LINK = re.compile(r"<(?:a|img)\s+[^>]*(?:href|src)\s*=\s*[\"']([^\"']+)[\"']", re.I)


def _label(label: str) -> str:
    return " ".join(label.lower().split())


def links(text: str) -> tuple[list[Link], list[Link]]:
    """(every link target of a page with its line, and on a page that defines reference links,
    every reference `[text][label]` whose label it never defines, as a Link to the label)."""
    found, uses, defined = [], [], set()
    for number, line in prose_lines(text):
        d = _REF_DEF.match(line)
        if d:
            defined.add(_label(d.group(1)))
            found.append(Link(number, d.group(2).strip("<>")))
            continue
        found += [Link(number, m.group(1).strip("<>")) for m in _INLINE.finditer(line)]
        found += [Link(number, m) for m in _HTML_LINK.findall(line)]
        uses += [Link(number, m.group(2) or m.group(1)) for m in _REF_USE.finditer(line)]
    # `[W][E]` on a page without reference links is text, not a link (GitHub renders it as typed).
    undefined = [u for u in uses if _label(u.target) not in defined] if defined else []
    return found, undefined


def is_external(target: str) -> bool:
    return re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) is not None


def split_target(page: Path, target: str) -> tuple[Path, str]:
    """The file a relative link names (the page itself for `#anchor`), and its anchor."""
    path, _, anchor = target.partition("#")
    path = urllib.parse.unquote(path)
    if not path:
        return page, urllib.parse.unquote(anchor)
    base = ROOT if path.startswith("/") else page.parent
    return (base / path.lstrip("/")).resolve(), urllib.parse.unquote(anchor)


_DATE = re.compile(r"\b(19|20)\d\d-(0[1-9]|1[0-2])\b")
_HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")


def dated(line: str) -> bool:
    """Whether a line carries a date (a year and a month: 2026-11, 2026-11-26) or a commit hash
    (7 to 40 lower-case hex digits with at least one letter and one digit)."""
    return bool(_DATE.search(line) or _HASH.search(line))
