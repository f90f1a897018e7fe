"""The soak (harness.soak) on the CPU model at a small shape, and its verdicts.

The GPU run soaks thousands of calls (scripts/gpu_check.sh, stage `soak`); here a few calls of
each kind show that the rotation runs every kind of call against the oracle on both data paths
and across nodes, and that a wrong row, a raised call, grown memory and a spent budget each make
the run fail with the call named.
"""

from __future__ import annotations

import json

import pytest

from harness import soak

pytestmark = pytest.mark.model


def soak_args(*extra: str):
    parser = soak.build_parser()
    args = parser.parse_args(["--device", "cpu", "--hidden", "128", "--topk", "2", *extra])
    soak.check_args(parser, args)
    return args


def test_rotation_draws_every_kind_of_call():
    args = soak_args("-w", "4", "--tokens", "16")
    cases = [soak.call_case(args, call) for call in range(len(soak.ROTATION))]
    assert {c.routing for c in cases} == {"uniform", "zipf", "one-expert"}
    assert any(0 in c.tokens for c in cases), "no call with a rank without tokens"
    assert any(c.num_out_tokens is not None for c in cases) and any(c.num_out_tokens is None for c in cases)
    assert len({c.seed for c in cases}) == len(cases), "routing is not fresh every call"
    assert all(max(c.tokens) <= 16 for c in cases)


@pytest.mark.parametrize("path,world,per_node,calls", [("direct", 4, 2, 8), ("receive", 3, 3, 4)],
                         ids=["direct-2x2", "receive-W3"])
def test_soak_matches_the_oracle(tmp_path, path, world, per_node, calls):
    status = soak.main(["--device", "cpu", "-w", str(world), "--ranks-per-node", str(per_node), "--hidden", "128",
                        "--tokens", "12", "--topk", "2", "--calls", str(calls), "--check-every", "2",
                        "--data-path", path, "--out", str(tmp_path)])
    record = json.loads((tmp_path / "soak.json").read_text())
    assert status == 0, record["failure"]
    assert record["calls_done"] == calls and record["checks_passed"] == calls // 2
    assert record["data_paths"] == {path: calls}
    assert len(record["samples"]) == calls // 2 and record["memory"]["flat"] is True


class FakeGroup:
    device = soak.torch.device("cpu")

    def close(self):
        self.closed = True


class Res:
    class handle:  # noqa: N801 - stands for a DispatchHandle
        data_path = "direct"


def fake_run(monkeypatch, fail_at: int | None = None):
    """Patch the group and the call so the soak's own logic runs without kernels."""
    group = FakeGroup()
    monkeypatch.setattr(soak, "emulated_group_for", lambda case, device, **kw: group)

    def check(group_, case, check):
        if case.seed == soak_args().seed * 1_000_003 + (fail_at if fail_at is not None else -1):
            raise AssertionError("rank 1: row 3 differs")
        return [Res()]

    monkeypatch.setattr(soak, "check_emulated", check)
    return group


def test_a_wrong_row_fails_the_soak_at_its_call(monkeypatch):
    group = fake_run(monkeypatch, fail_at=5)
    status, record = soak.run(soak_args("--calls", "20", "--check-every", "2"))
    assert status == 1 and record["calls_done"] == 5
    assert record["failure"].startswith("call 5 (") and "row 3 differs" in record["failure"]
    assert group.closed


def test_a_spent_budget_stops_with_status_3(monkeypatch):
    fake_run(monkeypatch)
    status, record = soak.run(soak_args("--calls", "20", "--budget-s", "0"))
    assert status == 3 and record["calls_done"] == 0 and "budget" in record["failure"]


def test_memory_growth_in_the_second_half_fails(monkeypatch):
    fake_run(monkeypatch)
    rss = iter(range(100 << 20, 1 << 40, 8 << 20))  # 8 MiB more at every sample
    monkeypatch.setattr(soak, "host_rss_bytes", lambda: next(rss))
    status, record = soak.run(soak_args("--calls", "8", "--check-every", "1", "--flat-mib", "16"))
    assert status == 1 and record["memory"]["flat"] is False
    assert record["memory"]["growth_bytes"]["rss_bytes"] == 4 * (8 << 20)
    assert "memory grew" in record["failure"]


def test_steady_memory_is_flat():
    samples = [soak.MemorySample(c, 100 << 20) for c in range(6)]
    assert soak.flat_verdict(samples, 0) == {"tolerance_bytes": 0, "flat": True, "growth_bytes": {"rss_bytes": 0}}
    assert soak.flat_verdict(samples[:1], 0)["flat"] is None


@pytest.mark.parametrize("argv,message", [(["--calls", "0"], "--calls must be >= 1"),
                                          (["-w", "4", "--ranks-per-node", "3"], "must divide --world-size"),
                                          (["-w", "4", "--experts", "6"], "multiple of --world-size")])
def test_bad_arguments_are_named(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        soak.main(["--device", "cpu", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def _process_soak(tmp_path, *extra: str):
    status = soak.main(["--processes", "--backend", "reference", "--device", "cpu", "-w", "3", "--hidden", "128",
                        "--tokens", "12", "--topk", "2", "--calls", "6", "--check-every", "3", "--timeout-s", "30",
                        "--out", str(tmp_path), *extra])
    return status, json.loads((tmp_path / "soak.json").read_text())


def test_the_process_soak_keeps_one_buffer_per_rank_and_matches_the_oracle(tmp_path):
    status, record = _process_soak(tmp_path)
    assert status == 0, record["failure"]
    assert record["processes"] == 3 and record["calls_done"] == 6 and record["checks_passed"] == 2
    assert sum(record["data_paths"].values()) == 6  # every call of rank 0, checked or not
    assert [len(rank) for rank in record["samples"]] == [2, 2, 2] and record["memory"]["flat"] is True


def test_a_wrong_row_from_a_process_fails_the_soak_at_its_call(tmp_path, monkeypatch):
    check = soak.Expected.check_call

    def corrupted(self, results, label=""):
        if label == " call 5":
            results[1]["y"] = results[1]["y"] + 1  # rank 1's combine, one off in every value
        return check(self, results, label)

    monkeypatch.setattr(soak.Expected, "check_call", corrupted)
    status, record = _process_soak(tmp_path)
    assert status == 1 and record["checks_passed"] == 1 and record["calls_done"] == 5
    assert record["failure"].startswith("call 5") and "rank 1" in record["failure"]
