"""The timing model's reports against those of an earlier model, to the bit.

A change that makes the timing model cheaper (the copy engines' calendar kept as ordered
intervals, not scanned as a list, after 4465b5d) must leave every report as it was: each
launch's kernel time, per-role busy and waits, block ends, the engine's busy time, critical
path and counts. tests/timing_reports_reference.json holds the reports for these jobs (H200
table, payload-free, one and two nodes, both data paths): 4465b5d's model's, with the layout
launches made again once the layout kernel counted its tile loop's instructions
(dev::plain_instructions; no other launch changed); made again where the kernel skeleton
(042f4a5, 41893c6: the receive path's kernels -2.0 to +0.2 % on these small jobs, the direct
path's to the bit) and the reports' lane paths (3b234a7) met; made again when bulk loads and stores
got their own rates and a pair came to cost per instruction of its kind, h200.json taking
h100.json's fit of the three (the combines 20-23 % faster on these jobs, the dispatches 3-9 %,
the layout kernel to the bit); made again when the layout kernel reported a bad route in
its count row instead of aborting (each layout launch 16.48 ns shorter, nothing else);
when a static-size call with a bad route came to be completed without an abort (the sites'
lines in layout.cuh, skeleton.cuh and state.cuh moved; no time changed); and when the layout
kernel's instruction counts moved from layout.cuh into the timing tables (dev::plain_code: its
sites 9 lines up, every time to the bit); and when the
combine's partial sums, forwarded partials and node partials moved into rings of chunk slots
freed by their readers' credits (the receive combines -0.2 and -0.1 %, the two-node combine
+1.6 % on these jobs, whose 2 to 3 chunks per source fit in a ring); and when the receive
rows and their RDMA staging moved into rings freed by credits and the send units were merged
by chunk index; and when a block's setup ended with a barrier, plain global stores came to take
the SM's request path (request_ns) and the direct dispatch went templated over the transport
(the direct dispatches +1.4 to +1.7 %, the receive ones +0.04 to +2.8 %, the combines within
0.3 %); when the two-node dispatch's RDMA warps came to read the block's abort word once per
warp (warp_uniform) in their loop condition (that dispatch -2.80 %, every other launch to the
bit); and when the rings between ranks got one type, PeerRing (sites' lines only, every time to
the bit; see the commit that last replaced the file).
A change that means to change the times replaces the file and says so in its commit.
"""

from __future__ import annotations

import json
import os

import pytest

from tools.timing import constants, driver, predict

pytestmark = pytest.mark.model

REFERENCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "timing_reports_reference.json")

# Small shapes with several copies open on an engine at once: receive at W = 4 and two nodes
# queue the most.
JOBS = {
    "direct": (predict.Shape(world_size=2, nodes=1, hidden=512, tokens=96, topk=4, experts=8), [1, 2]),
    "receive": (predict.Shape(world_size=4, nodes=1, hidden=512, tokens=96, topk=4, experts=8), [1, 2]),
    "nodes": (predict.Shape(world_size=4, nodes=2, hidden=512, tokens=64, topk=4, experts=8), [1]),
}


@pytest.mark.parametrize("name", sorted(JOBS))
def test_reports_are_those_of_the_earlier_model(name, monkeypatch):
    shape, sms = JOBS[name]
    monkeypatch.setenv("HYBRID_EP_DATA_PATH", "direct" if name == "direct" else "receive")
    table = constants.load_table(constants.H200).costs()
    result = driver.run_job(predict.job(shape, shape.tokens, sms, [table], payload=False))
    got = [{"sms": run["sms"], **{call: run[call]["launches"] for call in ("dispatch", "combine")}}
           for run in result["runs"]]
    with open(REFERENCE) as f:
        want = json.load(f)[name]
    # through JSON, as the reference went: tuples become lists, floats keep every bit
    got = json.loads(json.dumps(got))
    assert [r["sms"] for r in got] == [r["sms"] for r in want]
    for g, w in zip(got, want, strict=True):
        for call in ("dispatch", "combine"):
            assert [x["kernel"] for x in g[call]] == [x["kernel"] for x in w[call]]
            for launch_got, launch_want in zip(g[call], w[call], strict=True):
                assert launch_got["time_ns"] == launch_want["time_ns"]
                assert launch_got == launch_want
    assert any(x["copies"] > 0 for r in got for call in ("dispatch", "combine") for x in r[call])
