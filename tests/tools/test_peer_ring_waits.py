"""The rings between ranks keep their protocol in one type (csrc/kernels/peer_ring.cuh): a
kernel waits for a chunk's signal or a slot's credit only through PeerRing, so the encoding of
the words and the phase a timeout names are written once. This keeps the raw waits out of the
other kernel sources: what is left there waits on flow control (done flags, counts, the direct
path's tensors), never on a ring."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

KERNELS = Path(__file__).resolve().parents[2] / "csrc" / "kernels"
RING_FILE = "peer_ring.cuh"

# Loads of a word another rank raises: a wait or a peek written out by hand.
RAW_LOADS = re.compile(r"\bld_(?:relaxed|acquire)_sys\s*\(")
# The bounded waits on a word (common/state.cuh, kernels/hierarchy.cuh) and the phases they may
# name outside the ring type: flow control and count exchange, no ring.
WAITS = re.compile(r"\b(?:wait_at_least|wait_delivered)\s*\(")
FLOW_PHASES = {"kPhaseDispatchFlow", "kPhaseCombineFlow", "kPhaseRdmaFlow", "kPhaseCounts", "kPhaseRdmaCounts",
               "kPhaseDirectTensors", "kPhaseDirectRows", "kPhaseDirectReads"}
FORWARDER = "hierarchy.cuh"  # Hierarchy::wait_delivered (the count exchange's wait over the transport)
# The phases of the rings' two sides (peer_rings:: in peer_ring.cuh names each once).
RING_PHASES = re.compile(r"\bkPhase(?:RecvRing|StagedRing|PartialRing|ForwardRing|NodePartRing|DispatchRows|RdmaRows"
                         r"|CombineRows|NodePartials|RdmaPartials)\b")


def _code(path: Path) -> str:
    """The source without its comments (a comment may name a wait)."""
    text = re.sub(r"/\*.*?\*/", "", path.read_text(), flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def _call_args(code: str, start: int) -> str:
    """The argument text of the call whose '(' ends the match at `start`."""
    depth, i = 1, start
    while depth:
        depth += {"(": 1, ")": -1}.get(code[i], 0)
        i += 1
    return code[start:i - 1]


def _others() -> dict[str, str]:
    return {p.name: _code(p) for p in sorted(KERNELS.glob("*.cuh")) if p.name != RING_FILE}


def test_the_kernels_load_no_peer_word_outside_the_ring_type():
    found = {name: RAW_LOADS.findall(code) for name, code in _others().items()}
    assert {name: hits for name, hits in found.items() if hits} == {}


def test_the_waits_outside_the_ring_type_name_flow_control_only():
    phases = []
    for name, code in _others().items():
        for m in WAITS.finditer(code):
            args = _call_args(code, m.end())
            if name == FORWARDER and re.search(r"\bphase\b", args):
                continue  # Hierarchy::wait_delivered: its own definition, forwarding its caller's phase
            named = set(re.findall(r"\bkPhase\w+", args))
            assert named and named <= FLOW_PHASES, f"{name}: a wait names {sorted(named)}"
            phases += named
    # the scan sees the flow-control waits the kernels have (count, combines, direct path)
    assert {"kPhaseDispatchFlow", "kPhaseRdmaFlow", "kPhaseCounts", "kPhaseDirectTensors"} <= set(phases)


def test_the_ring_phases_are_named_by_the_ring_type_only():
    found = {name: RING_PHASES.findall(code) for name, code in _others().items()}
    assert {name: hits for name, hits in found.items() if hits} == {}
    ring = _code(KERNELS / RING_FILE)
    # each of the five rings has its writer's and its reader's phase there, once
    assert len(RING_PHASES.findall(ring)) == 10
    assert "wait_at_least(" in ring and "ld_relaxed_sys(" in ring


def test_the_scan_finds_a_wait_written_out_by_hand(tmp_path):
    code = "if (dev::ld_relaxed_sys(sig) < tag) return false;\n" \
           "ok = wait_at_least(d.args, sig, tag, kPhaseCombineRows, d.a.rank, g, d.call);  // a ring's\n"
    assert RAW_LOADS.findall(code)
    m = next(WAITS.finditer(code))
    assert set(re.findall(r"\bkPhase\w+", _call_args(code, m.end()))) == {"kPhaseCombineRows"}
    assert RING_PHASES.findall(code) == ["kPhaseCombineRows"]
