"""What `backend="auto"` picks (hybrid_ep/backends/choice.py): the evidence rule, one log line
per buffer, the choice kept on the buffer; by name, what was asked runs."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import hybrid_ep as hep
from hybrid_ep import backends
from hybrid_ep.backends import choice as choice_module
from hybrid_ep.config import BufferConfig

pytestmark = pytest.mark.unit


def _config(world_size: int, ranks_per_node: int) -> BufferConfig:
    return BufferConfig(128, 16, 2 * world_size, world_size, ranks_per_node).validate()


@pytest.fixture
def cuda_runs_everywhere(monkeypatch):
    """As on a GPU machine whose build has every transport: nothing stops the cuda backend."""
    monkeypatch.setattr(backends, "cuda_unavailable_reason", lambda group, explicit=False: None)
    monkeypatch.setattr(backends, "_cuda_geometry_reason", lambda config, group: None)


def test_auto_keeps_one_node_on_reference_where_cuda_could_run(single_rank_group, monkeypatch):
    # only the availability check passes: the older rule then went on to pick cuda
    monkeypatch.setattr(backends, "cuda_unavailable_reason", lambda group, explicit=False: None)
    buf = hep.HybridEPBuffer(single_rank_group, 128, 16, 2)
    assert buf.backend == "reference"
    assert buf.backend_choice.name == "reference" and buf.backend_choice.asked == "auto"
    reason = buf.backend_choice.reason
    assert "measured faster than NCCL on one node" in reason and "backend='cuda'" in reason
    assert choice_module.WHERE_DOCUMENTED in reason
    # the log line stays under 200 characters at the largest group (64 ranks as 8 nodes of 8)
    assert len(buf.backend_choice.describe(8, 8)) < 200


def test_auto_keeps_several_nodes_on_reference(single_rank_group, cuda_runs_everywhere):
    got = backends.choose_backend("auto", _config(4, 2), single_rank_group)
    assert (got.name, got.asked) == ("reference", "auto")
    assert "several nodes" in got.reason and len(got.describe(2, 2)) < 200
    assert "two real GPUs" in choice_module.AUTO_RULES["several nodes"].evidence


def test_by_name_runs_what_was_asked(single_rank_group, cuda_runs_everywhere):
    for name in ("cuda", "reference"):
        got = backends.choose_backend(name, _config(4, 2), single_rank_group)
        assert (got.name, got.asked, got.reason) == (name, name, "asked for by name")
    with pytest.raises(ValueError, match="backend must be one of auto, cuda, reference, got 'nccl'"):
        backends.choose_backend("nccl", _config(4, 2), single_rank_group)


def test_a_new_measurement_flips_one_entry(single_rank_group, monkeypatch):
    """The rule's table is the one place a benchmark result changes what auto picks."""
    faster = dataclasses.replace(choice_module.AUTO_RULES["one node"], picks="cuda", evidence="measured faster")
    monkeypatch.setitem(choice_module.AUTO_RULES, "one node", faster)
    monkeypatch.setattr(backends, "_cuda_geometry_reason", lambda config, group: None)
    got = backends.choose_backend("auto", _config(4, 4), single_rank_group)
    assert got.name == "cuda" and "measured faster" in got.reason
    # where cuda cannot run, the pick falls back and says why
    monkeypatch.setattr(backends, "_cuda_geometry_reason", lambda config, group: "no CUDA device is visible")
    got = backends.choose_backend("auto", _config(4, 4), single_rank_group)
    assert got.name == "reference" and got.reason == "cuda cannot run here (no CUDA device is visible)"
    # the several-nodes entry is untouched by the flip
    assert backends.choose_backend("auto", _config(4, 2), single_rank_group).name == "reference"


def test_the_choice_is_logged_once_per_buffer(single_rank_group, caplog):
    with caplog.at_level(logging.INFO, logger="hybrid_ep"):
        buf = hep.HybridEPBuffer(single_rank_group, 128, 16, 2)
        x = torch.zeros(3, 128)
        res = buf.dispatch(x, torch.tensor([[0], [1], [0]]))
        buf.combine(res.tokens, res.handle)
    lines = [r.getMessage() for r in caplog.records if "hybrid_ep: backend" in r.getMessage()]
    assert lines == [buf.backend_choice.describe(1, 1, [0])]
    assert lines[0].startswith("hybrid_ep: backend reference (asked: auto) for EP group of ranks 0 (1 node x 1 "
                               "ranks): ")


@pytest.mark.parametrize("ranks, text", [([0], "0"), (list(range(8, 16)), "8-15"), ([1, 3, 5, 7], "1-7 step 2"),
                                         ([0, 1, 5, 9, 10], "0, 1, 5, 9, ... (5)")])
def test_the_line_names_the_groups_ranks(ranks, text):
    """One line per EP group of a job: the ranks say which group (TP x CP strides an EP group)."""
    line = choice_module.BackendChoice("reference", "auto", "why").describe(2, 4, ranks)
    assert line == f"hybrid_ep: backend reference (asked: auto) for EP group of ranks {text} (2 nodes x 4 ranks): why"
