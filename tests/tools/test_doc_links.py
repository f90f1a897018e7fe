"""Every relative link of the documentation resolves: README.md, every Markdown page under docs/
and the pages they lead to (the measurement records of benchmarks/results/, the CHANGELOG,
CONTRIBUTING, csrc/README.md, the recipes' pages). A link's file or folder must exist, its
#anchor must be a heading of the target page by GitHub's rule (or an <a id>), and on a page
with reference links each label used must be defined there. Each page is its own test; a
failure lists every broken link of the page with its line."""

from __future__ import annotations

import pytest

from doc_pages import LINK_CHECKED, anchors, is_external, links, markdown_files, rel, slug, split_target

pytestmark = pytest.mark.unit

PAGES = markdown_files(*LINK_CHECKED)


def broken_links(page) -> list[str]:
    text = page.read_text()
    found, undefined = links(text)
    problems = [f"{rel(page)}:{u.line}: reference [{u.target}] is not defined on the page" for u in undefined]
    cache: dict = {}
    for link in found:
        if is_external(link.target):
            continue
        path, anchor = split_target(page, link.target)
        where = f"{rel(page)}:{link.line}: {link.target}"
        if not path.exists():
            problems.append(f"{where}: no such file or folder")
        elif anchor and path.suffix == ".md":
            if path not in cache:
                cache[path] = anchors(path.read_text())
            if anchor not in cache[path]:
                problems.append(f"{where}: no heading with the anchor #{anchor}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_link_resolves(page):
    problems = broken_links(page)
    assert not problems, f"{len(problems)} broken link(s):\n" + "\n".join(problems)


def test_the_pages_are_found():
    names = {rel(p) for p in PAGES}
    assert {"README.md", "docs/architecture.md", "docs/benchmarks/README.md", "docs/benchmarks/cuda.md"} <= names
    assert any(n.startswith("docs/dev/") for n in names)
    assert any(n.startswith("benchmarks/results/") for n in names)


def test_anchors_follow_githubs_rule():
    text = "\n".join([
        "# Architecture and semantics",
        "## How to measure (one single-GPU H100 / H200 machine, offline)",
        "## What `auto` picks",
        "## The [CPU model](dev/cpu_model.md)",
        "## Runs",
        "## Runs",
        "```",
        "## not a heading",
        "```",
        '<a id="kept-anchor"></a>',
    ])
    assert anchors(text) == {"architecture-and-semantics", "how-to-measure-one-single-gpu-h100--h200-machine-offline",
                             "what-auto-picks", "the-cpu-model", "runs", "runs-1", "kept-anchor"}
    assert slug("2026-11-26, NVIDIA H200 (one 15-minute lease)") == "2026-11-26-nvidia-h200-one-15-minute-lease"


def test_a_broken_link_is_reported_with_its_line(tmp_path, monkeypatch):
    import doc_pages

    monkeypatch.setattr(doc_pages, "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "there.md").write_text("# Title\n\n## Section two\n")
    page = tmp_path / "docs" / "page.md"
    page.write_text("\n".join([
        "# Page",
        "[fine](there.md#section-two) and [also](#page) and [web](https://example.com/x)",
        "[missing](nothere.md) `[in code](nothere.md)`",
        "[bad anchor](there.md#section-three)",
        "see [the run][run] and [another][nope]",
        "",
        "[run]: there.md",
        "```",
        "[in a fence](nothere.md)",
        "```",
    ]))
    assert broken_links(page) == [
        "docs/page.md:5: reference [nope] is not defined on the page",
        "docs/page.md:3: nothere.md: no such file or folder",
        "docs/page.md:4: there.md#section-three: no heading with the anchor #section-three",
    ]
