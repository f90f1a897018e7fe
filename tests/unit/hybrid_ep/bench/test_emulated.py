"""CPU parts of `python -m hybrid_ep.bench --emulate`: the plain-PyTorch baseline moves the
same rows as the oracle, the table and plot render, and without a GPU it exits cleanly."""

from __future__ import annotations

import pytest
import torch

from hybrid_ep.backends.cuda.layout import MAX_LAUNCH_RANKS
from hybrid_ep.bench import emulated
from hybrid_ep.bench.cli import main
from hybrid_ep.bench.spec import BenchArgError
from hybrid_ep.config import BufferConfig
from hybrid_ep.metadata import metadata
from hybrid_ep.synthetic import iter_rank_routings
from hybrid_ep.verify.oracle import combine_oracle, dispatch_oracle

pytestmark = pytest.mark.unit


def test_index_select_baseline_moves_the_oracle_rows():
    W, T, H, E, K = 3, 11, 8, 6, 2
    cfg = BufferConfig(H, T, E, W, W).validate()
    idx = list(iter_rank_routings("uniform", [T] * W, E, K, seed=5))
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(T, H, generator=gen) for _ in range(W)]
    dispatch, combine, rows = emulated.torch_movement(xs, idx, E // W)
    run = dispatch_oracle(cfg, xs, idx)
    rows.zero_()
    dispatch()
    assert torch.equal(rows, torch.cat([r.tokens for r in run.ranks]))
    y = combine()
    want_y, _ = combine_oracle(cfg, run, [r.tokens for r in run.ranks], idx)
    torch.testing.assert_close(y.double(), torch.cat(want_y), rtol=1e-6, atol=1e-6)


def test_table_and_plot(tmp_path):
    runs = [{"world_size": w, "sms_per_rank": s, "total_sms": w * s, "dispatch_ms": 1.0 / s,
             "dispatch_dest_gbps_per_sm": 60.0 - w, "dispatch_copy_fraction": 0.1 * s, "combine_ms": 2.0 / s,
             "combine_dest_gbps_per_sm": 50.0 - w, "combine_copy_fraction": 0.05 * s,
             "dispatch_moved_gbps_per_sm": 88.0 + s, "combine_moved_gbps_per_sm": 77.0 + s, "data_path": "direct",
             "held_bytes_per_rank": w * 2**27}
            for w in (2, 8) for s in (1, 2, 4)]
    config = {"world_sizes": [2, 8], "hidden": 8192, "tokens_per_rank": 4096, "topk": 8, "experts": 16,
              "dtype": "bf16", "routing": "uniform"}
    doc = {
        "metadata": dict(metadata("test", device_type="cpu", config=config, units=emulated.UNITS), device="GPU"),
        "device_sms": 132, "copy_gbps": 3000.0,
        "runs": runs,
        "index_select_index_add": [{"world_size": 2, "dispatch_ms": 0.5, "combine_ms": 0.7},
                                   {"world_size": 8, "dispatch_ms": 1.5, "combine_ms": 1.7}],
        "host_time": {"W=2": {"ranks": 2, "median_us": 21.5}, "W=8": {"ranks": 8, "median_us": 40.25}},
    }
    table = emulated.format_table(doc)
    lines = table.splitlines()
    assert "W = 2, 8 virtual ranks on one GPU" in lines[0] and "132 SMs" in lines[0]
    # one row per (W, SMs): W=8 on the direct path with 4 SMs per rank is 32 SMs in all, the
    # bytes moved per SM beside the destination bytes
    assert any(line.split()[:5] == ["8", "direct", "4", "32", "0.250"] and line.split()[6] == "92.0"
               for line in lines)
    assert "moved/SM" in lines[1] and "path" in lines[1] and lines[1].split()[-1] == "GiB"
    # the memory each rank's buffer holds, beside its speed: W=8 holds 8 x 128 MiB = 1 GiB here
    assert any(line.split()[:3] == ["8", "direct", "4"] and line.split()[-1] == "1.000" for line in lines)
    assert "W=8: dispatch 1.500 ms" in table and "21.5 us" in table and "40.2 us" in table
    # the host time per rank, against the target (older JSON without the per-rank number too)
    assert "10.8 us per rank" in table and "5.0 us per rank (target <= 30 us)" in table
    emulated._plot(doc, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_emulate_takes_several_world_sizes_and_skips_the_reference_by_default():
    from hybrid_ep.bench.cli import build_parser

    args = build_parser().parse_args(["--emulate", "2", "8", "--sms", "1", "2", "4"])
    assert args.emulate == [2, 8]
    assert args.reference_iters is None  # not given: no reference run (0 skips it too)


def test_emulate_without_a_gpu_exits_with_a_message(capsys, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("checks the behaviour without a GPU")
    assert main(["--emulate", "2", "--out", str(tmp_path)]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_rdma_rows_of_the_kernels_equal_the_traffic_model(capsys):
    """The count the benchmark reports with --emulate-nodes, on the CPU model of the kernels:
    what the forwarders' handles say they received equals the traffic model's count."""
    pytest.importorskip("hybrid_ep._model")
    from hybrid_ep.backends.cuda.emulation import EmulatedGroup

    tokens = [40, 17, 0, 33]
    idx = list(iter_rank_routings("uniform", tokens, 8, 4, seed=3))
    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(t, 128, generator=gen).to(torch.bfloat16) for t in tokens]
    two_nodes = EmulatedGroup(4, 128, 40, 8, num_sms_dispatch=2, num_sms_combine=2, device="cpu", ranks_per_node=2)
    got, model = emulated.rdma_rows(two_nodes.dispatch(xs, idx), idx, two_nodes.config)
    # every token of a rank with a route to the other node crosses once: count them here too
    crossing = sum(int(((i // 4) != (r // 2)).any(dim=1).sum()) for r, i in enumerate(idx))
    assert got == model == crossing > 0
    two_nodes.close()
    one_node = EmulatedGroup(4, 128, 40, 8, num_sms_dispatch=2, num_sms_combine=2, device="cpu")
    assert emulated.rdma_rows(one_node.dispatch(xs, idx), idx, one_node.config) == (0, 0)
    one_node.close()


@pytest.mark.parametrize("path, kinds", [("direct", {"dispatch_direct", "combine_direct"}),
                                         ("receive", {"dispatch_receive", "combine_receive"})])
def test_launch_shapes_record_the_store_queue_each_kernel_ran_with(monkeypatch, path, kinds):
    """The bench's rows name the stages and store groups of each launch (the default is chosen
    per launch from the stages, so the override alone does not say what ran), for the kernels
    of each data path; the direct combine has no store queue."""
    pytest.importorskip("hybrid_ep._model")
    from hybrid_ep.backends.cuda import launch
    from hybrid_ep.backends.cuda.emulation import EmulatedGroup

    def direct(stages, override):  # the direct dispatch sizes its queue by its stages' bytes too
        return launch.direct_store_groups(stages, launch.fifo_shape(2048, smem, max_stages=stages).stage_bytes,
                                          override)

    rule = {"dispatch_receive": launch.store_groups, "combine_receive": launch.combine_store_groups,
            "dispatch_direct": direct, "combine_direct": lambda stages, override: 0}
    tokens = [9, 4]
    idx = list(iter_rank_routings("uniform", tokens, 4, 2, seed=1))
    xs = [torch.randn(t, 1024).to(torch.bfloat16) for t in tokens]
    for override in (None, 0):
        if override is None:
            monkeypatch.delenv(launch.STORE_GROUPS_ENV, raising=False)
        else:
            monkeypatch.setenv(launch.STORE_GROUPS_ENV, str(override))
        group = EmulatedGroup(2, 1024, 9, 4, num_sms_dispatch=1, num_sms_combine=1, device="cpu", data_path=path)
        smem = group.engine.smem_per_block
        res = group.dispatch(xs, idx, num_sms=1)
        group.combine([r.tokens for r in res], [r.handle for r in res], num_sms=1)
        shapes = group.engine.launch_shapes(1)
        assert set(shapes) == kinds and group.engine.launch_shapes(2) == {}
        for kind, shape in shapes.items():
            assert shape["stages"] >= 2
            assert shape["store_groups"] == rule[kind](shape["stages"], override), kind
        group.close()


def test_emulate_nodes_must_divide_every_world_size(capsys, tmp_path, monkeypatch):
    from hybrid_ep.bench.cli import build_parser

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = build_parser().parse_args(["--emulate", "4", "6", "--emulate-nodes", "4", "--out", str(tmp_path)])
    assert emulated.run(args) == 2
    err = capsys.readouterr().err
    assert "argument --emulate-nodes: 4 must be >= 1 and divide every emulated world size, got [4, 6]" in err
    # Up to the virtual ranks one emulated launch holds (EmulatedGroup's limit, csrc's), on one
    # node (an NVLink domain) or several.
    over = MAX_LAUNCH_RANKS + 4
    for nodes in ([], ["--emulate-nodes", "4"]):
        args = build_parser().parse_args(["--emulate", "36", str(over), *nodes, "--out", str(tmp_path)])
        assert emulated.run(args) == 2
        assert f"must be in [1, {MAX_LAUNCH_RANKS}], got [{over}]" in capsys.readouterr().err
    assert emulated.settings(build_parser().parse_args(["--emulate", "36", "--out", str(tmp_path)]))["worlds"] == [36]


def test_table_with_nodes_has_the_rdma_columns():
    runs = [{"world_size": 8, "nodes": 2, "sms_per_rank": 2, "total_sms": 16, "dispatch_ms": 1.0,
             "dispatch_dest_gbps_per_sm": 5.0, "dispatch_copy_fraction": 0.1, "combine_ms": 2.0,
             "combine_dest_gbps_per_sm": 1.0, "combine_copy_fraction": 0.05, "rdma_rows": 12345,
             "dispatch_rdma_gbps_per_sm": 3.25, "combine_rdma_gbps_per_sm": 0.5}]
    config = {"world_sizes": [8], "nodes": 2, "hidden": 8192, "tokens_per_rank": 4096, "topk": 8, "experts": 16,
              "dtype": "bf16", "routing": "uniform"}
    doc = {"metadata": dict(metadata("test", device_type="cpu", config=config, units=emulated.UNITS), device="GPU"),
           "device_sms": 132, "copy_gbps": 3000.0, "runs": runs, "index_select_index_add": [], "host_time": {}}
    table = emulated.format_table(doc)
    assert "W = 8 virtual ranks as 2 nodes (loopback transport between them)" in table
    assert table.splitlines()[2].split()[-3:] == ["12345", "3.25", "0.50"]


def _emulate_args(*flags):
    from hybrid_ep.bench.cli import build_parser

    return build_parser().parse_args(["--emulate", *flags])


def test_emulate_settings_keep_an_explicit_zero_and_fill_in_the_defaults():
    """`--warmup 0` means no warm-up, not the default 10 (the settings need no GPU)."""
    s = emulated.settings(_emulate_args("2", "8", "--warmup", "0"))
    assert (s["warmup"], s["iters"], s["hidden"], s["tokens"]) == (0, 30, 8192, 4096)
    assert (s["worlds"], s["nodes"], s["experts"], s["topk"], s["sms"]) == ([2, 8], 1, 16, 8, [1, 2, 4, 8, 16])
    s = emulated.settings(_emulate_args("4", "--hidden", "256", "--tokens", "1", "--experts", "4", "--iters", "1",
                                        "--sms", "3", "5"))
    assert (s["hidden"], s["tokens"], s["experts"], s["topk"], s["iters"], s["sms"]) == (256, 1, 4, 4, 1, [3, 5])


@pytest.mark.parametrize("flags, flag", [
    (["--hidden", "0"], "--hidden"),
    (["--hidden", "-8"], "--hidden"),
    (["--tokens", "0"], "--tokens"),
    (["--experts", "0"], "--experts"),
    (["--experts", "-4"], "--experts"),
    (["--experts", "6"], "--experts"),  # not a multiple of W = 4
    (["--topk", "0"], "--topk"),
    (["--topk", "9"], "--topk"),  # > E = 8
    (["--warmup", "-1"], "--warmup"),
    (["--iters", "0"], "--iters"),
    (["--sms", "0", "4"], "--sms"),
    (["--dtype", "fp8", "--hidden", "100"], "--hidden"),
    (["--hidden", "6"], "--hidden"),  # 12-byte bf16 rows
    (["--emulate-nodes", "0"], "--emulate-nodes"),
    (["--reference-iters", "-1"], "--reference-iters"),
    (["--reference-iters", "2", "--group-limit", "2"], "--group-limit"),  # the reference run: one node
    # The rules of hybrid-ep-bench's own check (BenchSpec.validate), which --emulate lacked:
    (["--emulate-nodes", "2", "--routing", "group-limited", "--group-limit", "1", "--experts", "8", "--topk", "8"],
     "--topk"),  # 1 node reaches 4 experts
    (["--routing", "zipf", "--zipf-exponent", "-1"], "--zipf-exponent"),
    (["--routing", "zipf", "--zipf-exponent", "nan"], "--zipf-exponent"),  # routed every token alike
    (["--routing", "zipf", "--zipf-exponent", "inf"], "--zipf-exponent"),
    (["--seed", str(2**64)], "--seed"),
    (["--seed", "-1"], "--seed"),
])
def test_emulate_refuses_bad_flags_before_touching_the_gpu(flags, flag, capsys, tmp_path, monkeypatch):
    def never(args):
        raise AssertionError("the emulation ran")

    monkeypatch.setattr(emulated, "run", never)
    out = tmp_path / "never"
    assert main(["--emulate", "4", *flags, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"error: argument {flag}:" in err and "Traceback" not in err
    assert not out.exists()
    with pytest.raises(BenchArgError) as exc:  # what emulated.run checks too, before it looks for a GPU
        emulated.settings(_emulate_args("4", *flags))
    assert exc.value.flag == flag


@pytest.mark.parametrize("make", ["file", "under a file"])
def test_emulate_refuses_a_bad_out_before_the_run(make, capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(emulated, "run", lambda args: pytest.fail("the emulation ran"))
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    out = blocker if make == "file" else blocker / "sub"
    assert main(["--emulate", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "error: argument --out:" in err and "not a folder" in err and "Traceback" not in err


@pytest.mark.parametrize("routing, flags", [("zipf", ["--zipf-exponent", "1.4"]),
                                            ("group-limited", ["--emulate-nodes", "2", "--group-limit", "1"])])
def test_emulated_inputs_route_as_the_bench_ranks_do(routing, flags):
    """--emulate draws the routing hybrid-ep-bench's ranks draw for the same flags (it ignored
    --zipf-exponent and --group-limit)."""
    from hybrid_ep.bench.inputs import make_inputs
    from hybrid_ep.bench.spec import BenchSpec

    args = _emulate_args("4", "--routing", routing, "--experts", "16", "--tokens", "64", "--hidden", "128", *flags)
    s = emulated.settings(args)
    idxs, _, _ = emulated._inputs(4, s["tokens"], s["hidden"], s["experts"], s["topk"], torch.bfloat16, routing,
                                  args.seed, torch.device("cpu"), args.zipf_exponent, s["nodes"], args.group_limit)
    spec = BenchSpec(world_size=4, ranks_per_node=4 // s["nodes"], hidden=128, tokens=64, topk=s["topk"], experts=16,
                     dtype="bf16", routing=routing, sms=(), backends=("reference",), warmup=1, iters=1, seed=args.seed,
                     device="cpu", zipf_exponent=args.zipf_exponent, group_limit=args.group_limit).validate()
    for rank in range(4):
        assert torch.equal(idxs[rank], make_inputs(spec, rank, torch.device("cpu"))[2])
    plain = emulated._inputs(4, 64, 128, 16, s["topk"], torch.bfloat16, routing, args.seed, torch.device("cpu"))[0]
    assert not all(torch.equal(a, b) for a, b in zip(idxs, plain))  # the flags change the routing


def test_emulate_checks_are_the_bench_spec_rules(monkeypatch):
    """settings() asks BenchSpec.validate (one copy of the rules) for the group of every emulated W."""
    from hybrid_ep.bench.spec import BenchSpec

    seen = []
    validate = BenchSpec.validate
    monkeypatch.setattr(BenchSpec, "validate", lambda spec: seen.append(spec) or validate(spec))
    emulated.settings(_emulate_args("4", "8", "--emulate-nodes", "2", "--routing", "zipf", "--seed", "7"))
    assert [(s.world_size, s.num_nodes, s.routing, s.seed) for s in seen] == [(4, 2, "zipf", 7), (8, 2, "zipf", 7)]


def test_reference_run_has_the_emulated_nodes_and_routing(tmp_path, monkeypatch):
    """--reference-iters timed the reference backend on one node (ranks_per_node = W): a valid
    --group-limit 2 on 2 emulated nodes was refused, and --group-limit 1 routed otherwise."""
    from hybrid_ep.bench import cli
    from hybrid_ep.bench.inputs import make_inputs

    ran = []
    monkeypatch.setattr(emulated, "run", lambda args: 0)
    monkeypatch.setattr(cli, "_execute", lambda spec, out: ran.append((spec, out)) or 0)
    flags = ["--emulate", "4", "8", "--emulate-nodes", "2", "--routing", "group-limited", "--experts", "16",
             "--topk", "4", "--tokens", "64", "--hidden", "128", "--reference-iters", "3", "--out", str(tmp_path)]
    assert main([*flags, "--group-limit", "2"]) == 0
    assert main([*flags, "--group-limit", "1"]) == 0
    for (spec, out), limit in zip(ran, (2, 1)):
        assert out == str(tmp_path / "reference")
        assert (spec.world_size, spec.num_nodes, spec.ranks_per_node, spec.topk_groups) == (4, 2, 2, limit)
        assert (spec.backends, spec.device, spec.iters, spec.routing) == (("reference",), "cpu", 3, "group-limited")
        idxs, _, _ = emulated._inputs(4, 64, 128, 16, 4, torch.bfloat16, "group-limited", 0, torch.device("cpu"),
                                      1.2, 2, limit)
        for rank in range(4):
            assert torch.equal(make_inputs(spec, rank, torch.device("cpu"))[2], idxs[rank])


def test_emulated_json_records_routing_and_seed():
    """emulated.json's config lacked the seed, the Zipf exponent and the group limit."""
    for flags, zipf, limit in ((["--routing", "zipf", "--zipf-exponent", "1.4"], 1.4, None),
                               (["--routing", "group-limited", "--emulate-nodes", "2"], None, 2),
                               (["--routing", "group-limited", "--emulate-nodes", "2", "--group-limit", "1"], None, 1),
                               (["--routing", "uniform"], None, None)):
        args = _emulate_args("4", "--seed", "11", "--topk", "4", *flags)
        config = emulated.run_config(args, emulated.settings(args))
        assert (config["seed"], config["zipf_exponent"], config["group_limit"]) == (11, zipf, limit)
        assert config["routing"] == args.routing and config["world_sizes"] == [4]


def test_emulated_json_gives_every_number_a_unit():
    """Every number of a row (and of the document) has its unit: dispatch_rw_gbps and
    combine_rw_gbps had none."""
    for nodes in (1, 2):
        row = emulated.measurement_row(4, nodes, 2, 1.0, 2.0, 100, 300, 40 * (nodes - 1), 2048, 2048, 10**6, 2 * 10**6,
                                       3e12, 300)
        assert row["dispatch_rw_gbps"] == pytest.approx(1.0)  # 1e6 bytes read + written in 1 ms
        assert [key for key in row if key not in emulated.UNITS] == []
    for key in ("device_sms", "copy_gbps", "elapsed_s", "median_us", "median_us_per_rank", "target_us_per_rank",
                "ranks", "pipelines"):
        assert key in emulated.UNITS


def test_the_bench_reports_what_the_dispatchs_writes_carried():
    """dispatch_written_gbps_per_sm: the rows the dispatch writes (traffic.model's count) x row
    bytes / time / SMs: here 300 rows of 2048 bytes in 1 ms on 4 x 2 SMs, three times the
    destination rate of its 100 rows received."""
    row = emulated.measurement_row(4, 1, 2, 1.0, 2.0, 100, 300, 0, 2048, 2048, 10**6, 2 * 10**6, 3e12, 300)
    assert row["dispatch_written_gbps_per_sm"] == pytest.approx(300 * 2048 / 1e-3 / 8 / 1e9)
    assert row["dispatch_written_gbps_per_sm"] == pytest.approx(row["dispatch_dest_gbps_per_sm"] * 3)
