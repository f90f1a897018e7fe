"""User pages say what the software does now; a dated measurement lives with its run. So no
Markdown page under docs/ (docs/dev/ included) carries more than five lines with a date (a year
and a month: 2026-11, 2026-11-26) or a commit hash (7 to 40 hex digits, a letter and a digit
among them). Exempt: the record of one run or prediction, a folder named for its date or commit
(benchmarks/results/<date>-<device>/, predicted/<commit>/), and a CHANGELOG. Each page is its
own test; a failure lists every dated line of the page."""

from __future__ import annotations

import re

import pytest

from doc_pages import dated, markdown_files, rel

pytestmark = pytest.mark.unit

MAX_DATED_LINES = 5
_RECORD_FOLDER = re.compile(r"^((19|20)\d\d-\d\d-\d\d.*|[0-9a-f]{7,40}(-.*)?)$")


def is_exempt(relpath: str) -> bool:
    *folders, name = relpath.split("/")
    return name.upper() == "CHANGELOG.MD" or any(_RECORD_FOLDER.match(f) for f in folders)


PAGES = [p for p in markdown_files("docs") if not is_exempt(rel(p))]


def dated_lines(text: str) -> list[tuple[int, str]]:
    return [(n, line) for n, line in enumerate(text.splitlines(), 1) if dated(line)]


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_page_carries_at_most_five_dated_lines(page):
    lines = dated_lines(page.read_text())
    assert len(lines) <= MAX_DATED_LINES, (
        f"{rel(page)}: {len(lines)} lines with a date or a commit hash (at most {MAX_DATED_LINES}); move the "
        "measurement into its run's folder (benchmarks/results/) or the history into CHANGELOG.md:\n"
        + "\n".join(f"{rel(page)}:{n}: {line.strip()[:160]}" for n, line in lines))


def test_what_counts_as_dated():
    assert dated("measured on 2026-11-26 (H100)") and dated("since 2026-11") and dated("at commit 99c63ea")
    assert dated("the H200 run (635aa82's kernels)") and dated("d93f79d")
    assert not dated("4096 tokens per rank, 1000003 x seed, float8_e4m3fn, H = 8192, 0x1f2e3d4c")
    assert not dated("defaced accede") and not dated("sm_90a, 2026 tokens, 12-13 %")


def test_run_records_and_the_changelog_are_exempt():
    assert is_exempt("docs/benchmarks/timing/predicted/d93f79d/README.md")
    assert is_exempt("benchmarks/results/2026-11-26-h100-b/README.md")
    assert is_exempt("docs/CHANGELOG.md")
    assert not is_exempt("docs/benchmarks/README.md") and not is_exempt("docs/dev/timing_model.md")
    assert any(rel(p) == "docs/architecture.md" for p in PAGES)
