"""`auto` from the user's own measurement (hybrid_ep/backends/evidence.py): what
`hybrid-ep-bench --calibrate` writes on CPU processes, and what auto picks and logs with a
hand-written evidence file (cuda faster for one topology; stale entries; unreadable files)."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

import hybrid_ep as hep
from hybrid_ep import backends
from hybrid_ep.backends import evidence
from hybrid_ep.bench import cli
from hybrid_ep.config import BufferConfig

pytestmark = pytest.mark.unit

SHAPE = {"hidden": 7168, "tokens_per_rank": 4096, "topk": 8, "experts": 256, "dtype": "bf16", "routing": "uniform"}


def _config(world_size: int, ranks_per_node: int) -> BufferConfig:
    return BufferConfig(128, 16, 2 * world_size, world_size, ranks_per_node).validate()


def _measurement(nodes=1, ranks_per_node=4, cuda_ms=1.0, reference_ms=2.0, **identity) -> evidence.Measurement:
    here = dataclasses.replace(evidence.identity_here("cpu"), **identity)
    return evidence.Measurement(here, nodes, ranks_per_node, SHAPE, reference_ms, cuda_ms,
                                None if cuda_ms else "no CUDA device is visible", "2026-11-27T10:00:00+00:00")


@pytest.fixture
def evidence_file(tmp_path, monkeypatch):
    path = tmp_path / "auto-evidence.json"
    monkeypatch.setenv(evidence.ENV, str(path))
    monkeypatch.setattr(backends, "_warned", set())
    return path


@pytest.fixture
def cuda_runs_everywhere(monkeypatch):
    """As on a GPU machine: nothing stops the cuda backend (its construction is not reached)."""
    monkeypatch.setattr(backends, "cuda_unavailable_reason", lambda group, explicit=False: None)
    monkeypatch.setattr(backends, "_cuda_geometry_reason", lambda config, group: None)


def test_the_path_is_the_variable_else_the_cache(monkeypatch, tmp_path):
    monkeypatch.delenv(evidence.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert evidence.evidence_path() == str(tmp_path / "hybrid-ep" / "auto-evidence.json")
    monkeypatch.setenv(evidence.ENV, "/site/evidence.json")
    assert evidence.evidence_path() == "/site/evidence.json"


def test_calibrate_on_cpu_processes_records_reference_and_why_cuda_did_not_run(evidence_file, capsys):
    rc = cli.main(["--calibrate", "-w", "2", "--hidden", "128", "--tokens", "32", "--topk", "2", "--experts", "4",
                   "--warmup", "1", "--iters", "3"])
    assert rc == 0
    (m,) = evidence.read(str(evidence_file))
    assert (m.nodes, m.ranks_per_node, m.cuda_ms, m.faster) == (1, 2, None, "reference")
    assert m.reference_ms > 0 and m.cuda_unavailable  # e.g. no hybrid_ep._C, or no CUDA device
    assert m.identity == evidence.identity_here("cpu") and m.identity.nccl is None
    assert m.shape == {"hidden": 128, "tokens_per_rank": 32, "topk": 2, "experts": 4, "dtype": "bf16",
                       "routing": "uniform"}
    assert m.date[:4].isdigit() and "versions" not in json.loads(evidence_file.read_text())  # one schema
    assert f"written to {evidence_file}" in capsys.readouterr().out


@pytest.mark.parametrize("flag", [["--sms", "8"], ["--backends", "cuda"], ["--out", "x"]])
def test_calibrate_refuses_flags_it_would_ignore(flag, capsys):
    assert cli.main(["--calibrate", *flag]) == 2
    assert f"argument {flag[0]}: does not apply with --calibrate" in capsys.readouterr().err
    assert cli.main(["--evidence", "x.json"]) == 2
    assert "argument --evidence: only applies with --calibrate" in capsys.readouterr().err


def test_auto_follows_evidence_that_cuda_is_faster_for_that_topology(evidence_file, single_rank_group,
                                                                     cuda_runs_everywhere):
    evidence.write(str(evidence_file), _measurement(nodes=1, ranks_per_node=4))
    got = backends.choose_backend("auto", _config(4, 4), single_rank_group)
    assert (got.name, got.asked) == ("cuda", "auto")
    assert got.reason.startswith("measured faster here: cuda 1 ms, reference 2 ms per dispatch + combine at H 7168")
    assert str(evidence_file) in got.reason and "2026-11-27T10:00:00+00:00" in got.reason
    # another topology has no measurement: the rule
    other = backends.choose_backend("auto", _config(4, 2), single_rank_group)
    assert other.name == "reference" and other.reason.startswith("until cuda is measured faster")


def test_evidence_that_reference_is_faster_or_cuda_cannot_run_keeps_reference(evidence_file, single_rank_group,
                                                                              monkeypatch):
    evidence.write(str(evidence_file), _measurement(cuda_ms=3.0))
    monkeypatch.setattr(backends, "_cuda_geometry_reason", lambda config, group: None)
    got = backends.choose_backend("auto", _config(4, 4), single_rank_group)
    assert got.name == "reference" and got.reason.startswith("measured here: cuda 3 ms, reference 2 ms")
    evidence.write(str(evidence_file), _measurement(cuda_ms=1.0))
    monkeypatch.setattr(backends, "_cuda_geometry_reason", lambda config, group: "no CUDA device is visible")
    got = backends.choose_backend("auto", _config(4, 4), single_rank_group)
    assert got.name == "reference"
    assert got.reason.startswith("cuda cannot run here (no CUDA device is visible), though measured faster")


@pytest.mark.parametrize("stale, named", [({"device": "NVIDIA H100 80GB HBM3"}, "device NVIDIA H100 80GB HBM3, here"),
                                          ({"hybrid_ep": "0.0.1"}, "hybrid_ep 0.0.1, here"),
                                          ({"nccl": "2.21.5"}, "nccl 2.21.5, here None")])
def test_stale_evidence_is_ignored_with_a_warning(evidence_file, single_rank_group, cuda_runs_everywhere, caplog,
                                                  stale, named):
    evidence.write(str(evidence_file), _measurement(**stale))
    with caplog.at_level(logging.WARNING, logger="hybrid_ep"):
        got = backends.choose_backend("auto", _config(4, 4), single_rank_group)
        backends.choose_backend("auto", _config(4, 4), single_rank_group)
    assert got.name == "reference" and got.reason.startswith("until cuda is measured faster")  # the rule
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings  # once per process
    assert f"auto's evidence {evidence_file}: the measurement of 2026-11-27T10:00:00+00:00" in warnings[0]
    assert named in warnings[0] and "rerun hybrid-ep-bench --calibrate" in warnings[0]


@pytest.mark.parametrize("text, reason", [("{not json", "Expecting property name"),
                                          ('{"schema": "other"}', "not an evidence file"),
                                          ('{"schema": "hybrid-ep-auto-evidence/1", "measurements": [{"a": 1}]}',
                                           "a measurement cannot be read")])
def test_an_unreadable_file_is_ignored_with_a_warning(evidence_file, single_rank_group, cuda_runs_everywhere,
                                                      caplog, text, reason):
    evidence_file.write_text(text)
    with caplog.at_level(logging.WARNING, logger="hybrid_ep"):
        assert backends.choose_backend("auto", _config(4, 4), single_rank_group).name == "reference"
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith(f"hybrid_ep: auto's evidence {evidence_file}: ignored, ") and reason in warning


def test_without_a_file_auto_keeps_its_rule_silently(evidence_file, single_rank_group, cuda_runs_everywhere, caplog):
    with caplog.at_level(logging.WARNING, logger="hybrid_ep"):
        got = backends.choose_backend("auto", _config(4, 4), single_rank_group)
    assert got.name == "reference" and not caplog.records


def test_the_buffer_logs_which_evidence_it_followed(evidence_file, single_rank_group, caplog):
    evidence.write(str(evidence_file), _measurement(nodes=1, ranks_per_node=1, cuda_ms=None))
    with caplog.at_level(logging.INFO, logger="hybrid_ep"):
        buf = hep.HybridEPBuffer(single_rank_group, 128, 16, 2)
    assert buf.backend == "reference"
    lines = [r.getMessage() for r in caplog.records if "hybrid_ep: backend" in r.getMessage()]
    assert lines == [f"hybrid_ep: backend reference (asked: auto) for EP 1 node x 1 ranks: measured here: reference "
                     f"2 ms per dispatch + combine, cuda unavailable at H 7168, 4096 tokens/rank, top-8, bf16; "
                     f"measured 2026-11-27T10:00:00+00:00 ({evidence_file})"]


def test_a_new_calibration_replaces_its_own_entry_only(evidence_file):
    path = str(evidence_file)
    evidence.write(path, _measurement(ranks_per_node=4, cuda_ms=1.0))
    evidence.write(path, _measurement(ranks_per_node=8, cuda_ms=1.0))
    evidence.write(path, _measurement(ranks_per_node=4, cuda_ms=5.0))
    got = {(m.ranks_per_node, m.cuda_ms) for m in evidence.read(path)}
    assert got == {(8, 1.0), (4, 5.0)}


def test_ranks_that_disagree_run_reference(monkeypatch, single_rank_group):
    """Each rank reads its own file: where their picks differ, all run reference (a split group would hang)."""
    monkeypatch.setattr(backends.dist, "get_world_size", lambda group=None: 2)

    def gathered(out, obj, group=None):
        out[:] = [obj, "reference"]

    monkeypatch.setattr(backends.dist, "all_gather_object", gathered)
    cuda = backends.BackendChoice("cuda", "auto", "measured faster here: ...")
    got = backends._agreed(cuda, single_rank_group)
    assert got.name == "reference" and "rank 0: cuda, rank 1: reference" in got.reason
    assert backends._agreed(backends.BackendChoice("reference", "auto", "x"), single_rank_group).name == "reference"
