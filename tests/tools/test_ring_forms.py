"""One home for the rings between ranks: a chunk's slot, the words that tag it and the writer's
wait for a credit are written in csrc/kernels/peer_ring.cuh only (PeerRing), never again in a
kernel, as tests/unit/hybrid_ep/backends/cuda/test_layout_constants.py keeps csrc's sizes out of the Python."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers import REPO

pytestmark = pytest.mark.unit

CSRC = Path(REPO) / "csrc"
HOME = CSRC / "kernels" / "peer_ring.cuh"
# The forms each fact had before it had a home: a slot as `c % ring...`, a tag as `call << 32 | ...`
# (the call then named epoch) or `ring_tag(...)`, and a credit wait as a flag wait on a ring's phase.
OLD_FORMS = {
    "slot": re.compile(r"%\s*(?:d\.|this->)?(?:ring|ring_slots|ring_chunks|comb_ring\b)"),
    "tag": re.compile(r"\b(?:epoch|call)\s*<<|\bring_tag\s*\(|\bcomb_ring\s*\("),
    "credit wait": re.compile(r"kPhase(?:Recv|Staged|Partial|Forward|NodePart)Ring"),
}
# Where a form may stand besides the home: the phase codes and their names (common/params.h).
ALLOWED = {"credit wait": {CSRC / "common" / "params.h"}}


def old_forms(path: Path, text: str) -> list[str]:
    found = []
    for lineno, line in enumerate(text.splitlines(), 1):
        code = line.split("//", 1)[0]
        for what, form in OLD_FORMS.items():
            if form.search(code) and path not in ALLOWED.get(what, set()):
                found.append(f"{path.relative_to(CSRC)}:{lineno}: {what}: {line.strip()}")
    return found


def test_slots_tags_and_credit_waits_are_written_in_peer_ring_only():
    files = [p for p in sorted(CSRC.rglob("*")) if p.suffix in {".cuh", ".cu", ".h", ".cpp"} and p != HOME]
    assert len(files) > 50
    found = [hit for path in files for hit in old_forms(path, path.read_text())]
    assert found == [], "\n".join(["written outside csrc/kernels/peer_ring.cuh (use PeerRing):", *found])
    home = HOME.read_text()
    assert "struct PeerRing" in home and "writer_acquire" in home and "reader_release" in home


def test_the_check_finds_each_old_form():
    """The check above can fail: the forms the kernels had before PeerRing are found."""
    bad = CSRC / "kernels" / "bad.cuh"
    text = ("  return (static_cast<int64_t>(source) * ring + c % ring) * kChunkTokens + q;\n"
            "  __device__ uint64_t tag(int c) const { return call << 32 | static_cast<uint64_t>(c + 1); }\n"
            "  const uint64_t need = ring_tag(d.call, c - d.ring_slots);\n"
            "  ok = wait_at_least(args, word, need, kPhasePartialRing, rank, s, call);\n"
            "  // a comment may say c % ring\n")
    assert [hit.split(": ")[1] for hit in old_forms(bad, text)] == ["slot", "tag", "tag", "credit wait"]
