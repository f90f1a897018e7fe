"""Which backend runs where is stated once, in docs/architecture.md's "What runs where" table,
which follows the rule `auto` runs by (hybrid_ep/backends/choice.py); the other docs link to it
and do not restate it."""

from __future__ import annotations

import pathlib
import re

import pytest

from hybrid_ep.backends.choice import AUTO_RULES

pytestmark = pytest.mark.unit

REPO = pathlib.Path(__file__).resolve().parents[2]
ARCHITECTURE = REPO / "docs" / "architecture.md"
ANCHOR = "architecture.md#what-runs-where"

# Pages a user reads to learn what runs: each must point at the table.
MUST_LINK = ["README.md", "docs/quickstart.md", "docs/testing_on_clusters.md", "recipes/README.md",
             *sorted(str(p.relative_to(REPO)) for p in (REPO / "recipes").glob("*/README.md"))]

# Ways the docs used to say it; a page that says any of them restates the table.
RESTATEMENTS = [
    r"use[sd]? the `?reference`? backend",
    r"runs? multi-node (ep )?groups",
    r"multi-node (ep )?groups (use|run)",
    r"`?auto`? (picks|chooses|selects|can pick) (`?cuda|`?reference|it\b)",
    r"picks? `?cuda`? (on|for|across)",
    r"intra-node only",
    r"(has|have) not run on",
    r"nothing has run on",
    r"(has|have) not (yet )?been run",
    r"(backend|cuda|reference|kernels|nccl)[^.|]{0,80}in this release",
]


def _section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def _user_docs() -> list[pathlib.Path]:
    """Every page a user reads, the measurement logs of docs/benchmarks/ aside."""
    pages = [REPO / "README.md", REPO / "csrc" / "README.md", *(REPO / "docs").glob("*.md"),
             REPO / "docs" / "benchmarks" / "README.md", *(REPO / "recipes").rglob("*.md")]
    return sorted(pages)


def test_the_table_is_in_architecture_once_and_follows_the_rule():
    text = ARCHITECTURE.read_text()
    assert text.count("\n## What runs where\n") == 1
    rows = {}
    for line in _section(text, "What runs where").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[1].startswith("`") and cells[0] != "EP group":
            rows[cells[0]] = cells[1].strip("`")
    assert rows == {"CPU processes (gloo)": "reference",
                    "one node of GPUs (NCCL)": AUTO_RULES["one node"].picks,
                    "several nodes (NCCL)": AUTO_RULES["several nodes"].picks}


@pytest.mark.parametrize("page", MUST_LINK)
def test_page_links_to_the_table(page):
    assert ANCHOR in (REPO / page).read_text(), f"{page} does not link to {ANCHOR}"


def test_no_page_restates_the_table():
    found = []
    for page in _user_docs():
        text = page.read_text()
        if page == ARCHITECTURE:
            text = text.replace(_section(text, "What runs where"), "")
        flat = re.sub(r"\s+", " ", text.lower())
        for pattern in RESTATEMENTS:
            for m in re.finditer(pattern, flat):
                found.append(f"{page.relative_to(REPO)}: ...{flat[max(0, m.start() - 60):m.end() + 40]}...")
    assert not found, "restates docs/architecture.md#what-runs-where:\n" + "\n".join(found)
