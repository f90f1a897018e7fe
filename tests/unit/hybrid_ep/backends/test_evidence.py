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


CALIBRATE = ["--calibrate", "-w", "2", "--hidden", "128", "--tokens", "32", "--topk", "2", "--experts", "4",
             "--warmup", "1", "--iters", "3"]


def test_calibrate_on_cpu_processes_records_reference_and_a_later_run_reuses_it(evidence_file, capsys):
    """What a CPU calibration records, then --reuse, as a recipe's next job runs it: nothing measured.
    (A changed shape measures again: test_entries_are_kept_per_shape_and_the_buffers_shape_comes_first.)"""
    rc = cli.main(CALIBRATE + ["--time-limit", "120"])
    assert rc == 0
    (m,) = evidence.read(str(evidence_file))
    assert (m.nodes, m.ranks_per_node, m.cuda_ms, m.faster, m.failure) == (1, 2, None, "reference", None)
    assert m.reference_ms > 0 and m.cuda_unavailable  # e.g. no hybrid_ep._C, or no CUDA device
    assert m.identity == evidence.identity_here("cpu") and m.identity.nccl is None
    assert m.shape == {"hidden": 128, "tokens_per_rank": 32, "topk": 2, "experts": 4, "dtype": "bf16",
                       "routing": "uniform"}
    assert m.date[:4].isdigit() and "versions" not in json.loads(evidence_file.read_text())  # one schema
    out = capsys.readouterr().out
    assert out.startswith("hybrid-ep calibration: measured in ") and " s of its 120 s bound: reference " in out
    assert out.endswith(f"auto takes reference for EP groups of 1 node x 2 ranks here; written to {evidence_file}\n")
    assert cli.main(CALIBRATE + ["--reuse"]) == 0
    assert capsys.readouterr().out.startswith(f"hybrid-ep calibration: reused the entry of {m.date} in "
                                              f"{evidence_file}: reference ")
    assert evidence.read(str(evidence_file)) == [m]


@pytest.mark.parametrize("flags, message", [(["--reuse"], "argument --reuse: only applies with --calibrate"),
                                            (["--time-limit", "5"], "argument --time-limit: only applies with "
                                                                    "--calibrate"),
                                            (["--calibrate", "--time-limit", "0"], "argument --time-limit: must be > 0 "
                                                                                   "seconds, got 0")])
def test_the_calibrations_own_flags_are_checked(flags, message, capsys):
    assert cli.main(flags) == 2
    assert message in capsys.readouterr().err


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
    assert lines == [f"hybrid_ep: backend reference (asked: auto) for EP group of ranks 0 (1 node x 1 ranks): "
                     f"measured here: reference 2 ms per dispatch + combine, cuda unavailable at H 7168, 4096 "
                     f"tokens/rank, top-8, bf16; measured 2026-11-27T10:00:00+00:00 ({evidence_file})"]


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


def _failure(failure: str, **kw) -> evidence.Measurement:
    return dataclasses.replace(_measurement(ranks_per_node=1, cuda_ms=None, **kw), cuda_unavailable=None,
                               failure=failure)


def test_a_failure_keeps_reference_and_says_why(evidence_file, single_rank_group, cuda_runs_everywhere, caplog):
    evidence.write(str(evidence_file), _failure("rank 1 failed: RuntimeError: CUDA error (timing cuda, after 2.0 s)"))
    with caplog.at_level(logging.INFO, logger="hybrid_ep"):
        buf = hep.HybridEPBuffer(single_rank_group, 128, 16, 2)
    assert buf.backend == "reference"
    (line,) = [r.getMessage() for r in caplog.records if "hybrid_ep: backend" in r.getMessage()]
    assert line == ("hybrid_ep: backend reference (asked: auto) for EP group of ranks 0 (1 node x 1 ranks): the "
                    "calibration here failed: rank 1 failed: RuntimeError: CUDA error (timing cuda, after 2.0 s); "
                    "reference 2 ms per dispatch + combine at H 7168, 4096 tokens/rank, top-8, bf16; "
                    f"2026-11-27T10:00:00+00:00 ({evidence_file}; delete it to measure again)")


def test_the_first_failure_stays_and_replaces_the_unfinished_entry(evidence_file):
    path = str(evidence_file)
    started = _failure(f"{evidence.UNFINISHED}: started 2026-11-27T10:00:00+00:00", reference_ms=None)
    evidence.write(path, started)
    assert evidence.read(path)[0].faster == "reference"
    assert evidence.write_failure(path, _failure("rank 1 failed: RuntimeError: fault"))
    assert not evidence.write_failure(path, _failure("rank 0 failed: RuntimeError: connection reset by peer"))
    (entry,) = evidence.read(path)
    assert entry.failure == "rank 1 failed: RuntimeError: fault"
    assert evidence.reusable(path, started) == (entry, "")  # the same slot: a later job reuses the failure


def test_entries_are_kept_per_shape_and_the_buffers_shape_comes_first(evidence_file):
    path = str(evidence_file)
    small = dataclasses.replace(_measurement(cuda_ms=3.0), shape={**SHAPE, "hidden": 1024},
                                date="2026-11-28T10:00:00+00:00")
    evidence.write(path, _measurement(cuda_ms=1.0))
    evidence.write(path, small)  # newer, another shape: beside the first
    here = evidence.identity_here("cpu")
    assert len(evidence.read(path)) == 2
    assert evidence.find(1, 4, here, path)[0].shape["hidden"] == 1024  # no shape asked: the newest
    assert evidence.find(1, 4, here, path, shape={"hidden": 7168, "experts": 256})[0].cuda_ms == 1.0
    found, why = evidence.reusable(path, dataclasses.replace(small, shape={**SHAPE, "hidden": 2048}))
    assert found is None and why == "the entry of 2026-11-28T10:00:00+00:00 was made with hidden 1024, here 2048"


def test_a_schema_1_file_is_still_read(evidence_file):
    entry = _measurement().to_json()
    del entry["failure"]
    evidence_file.write_text(json.dumps({"schema": "hybrid-ep-auto-evidence/1", "measurements": [entry]}))
    (m,) = evidence.read(str(evidence_file))
    assert m.failure is None and m.faster == "cuda"
