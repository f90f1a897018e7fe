"""The timing model's reports against those of an earlier model, to the bit.

A change that makes the timing model cheaper or moves code without meaning to change a time
must leave every report as it was: each launch's kernel time, per-role busy and waits, block
ends, the engine's busy time, critical path and counts. tests/tools/timing_reports_reference.json
holds the reports for these jobs (H200 table, payload-free, one and two nodes, both data paths).
A change that means to change the times replaces the file and says in its commit which
launches moved and by how much (`git log tests/tools/timing_reports_reference.json` is the history).
Wait labels are compared without their line numbers ("flag wait (count.cuh)"): an edit that
moves a wait down the file moves no time, and the waits' order still tells them apart.
"""

from __future__ import annotations

import json
import os
import re

import pytest

from tools.timing import constants, driver, predict

pytestmark = pytest.mark.model

_LINE = re.compile(r"(\.\w+):\d+\)")


def _without_lines(report):
    """The report with every "file.ext:N)" in a label written "file.ext)"."""
    return json.loads(_LINE.sub(r"\1)", json.dumps(report)))


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
    got, want = _without_lines(got), _without_lines(want)
    assert [r["sms"] for r in got] == [r["sms"] for r in want]
    for g, w in zip(got, want, strict=True):
        for call in ("dispatch", "combine"):
            assert [x["kernel"] for x in g[call]] == [x["kernel"] for x in w[call]]
            for launch_got, launch_want in zip(g[call], w[call], strict=True):
                assert launch_got["time_ns"] == launch_want["time_ns"]
                assert launch_got == launch_want
    assert any(x["copies"] > 0 for r in got for call in ("dispatch", "combine") for x in r[call])
