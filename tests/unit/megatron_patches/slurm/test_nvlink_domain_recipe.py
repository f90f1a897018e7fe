"""NVLink domains across hosts in the recipes (megatron_patches/slurm/domain.py): the GB200 NVL72
recipe renders and validates; its EP groups of 64 are costed as one domain, not 16 hosts of 4;
#SBATCH --segment and the IMEX check appear only where the job's domain spans hosts; a domain
that is not whole hosts, one over the library's limit and a segment that splits EP groups are
refused naming the field."""

from __future__ import annotations

import os
import stat
import subprocess

import pytest

from helpers import REPO
from hybrid_ep.topology import MAX_DOMAIN_RANKS
from megatron_patches.slurm import cli, dispatcher_memory, domain, memory, render

pytestmark = pytest.mark.unit

GB200 = os.path.join(REPO, "recipes", "deepseek_v3_gb200")
BENCH = os.path.join(REPO, "recipes", "bench_dispatch")
HOST_DOMAIN = ["cluster.nvlink_domain=null", "cluster.segment=null"]  # the same job, each host its own domain


def load(path, *sets):
    return cli.load_checked(path, list(sets))


def errors(capsys, path, *sets) -> list[str]:
    """The launcher's error lines for the recipe with these overrides (exit status 2)."""
    assert cli.main([path, *[w for s in sets for w in ("--set", s)]]) == 2
    return [line for line in capsys.readouterr().err.splitlines() if ": error: " in line]


def test_the_gb200_recipe_dry_run_renders_and_bash_accepts_it(capsys, tmp_path):
    assert cli.main([GB200, "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert "deepseek_v3_gb200: 1024 GPUs = TP 1 x PP 16 x CP 1 x DP 64; experts: EP 64 x ETP 1 x EDP 1" in err
    assert ("hybrid-ep-launch: deepseek_v3_gb200: NVLink domains of 72 GPUs (18 hosts of 4): the job takes 16 hosts "
            "(64 GPUs) of each, #SBATCH --segment=16; EP x ETP groups of 64 ranks: ranks_per_node 64, 1 domain each\n"
            in err)
    assert "error" not in err and "warning: estimated" not in err
    for line in ("#SBATCH --nodes=256", "#SBATCH --ntasks-per-node=4", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --segment=16", "  --expert-model-parallel-size 64", "  --pipeline-model-parallel-size 16"):
        assert line in out.splitlines(), line
    assert "--hybrid-ep-ranks-per-node" not in out  # the runtime finds the domain (the GPU fabric's clique)
    assert "NVSHMEM" not in out  # no RDMA in an EP group that stays in one domain
    script = tmp_path / "gb200.sbatch"
    script.write_text(out)
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_the_recipes_layout_puts_one_ep_group_on_16_hosts_of_one_rack():
    recipe = load(GB200)
    job = domain.job_domain(recipe)
    assert (job.domain, job.hosts, job.segment, job.used, job.given) == (72, 18, 16, 64, True)
    # derived without cluster.segment: the most hosts of a rack holding whole groups of 64
    derived = domain.job_domain(load(GB200, "cluster.segment=null"))
    assert (derived.segment, derived.given) == (16, False)
    assert recipe["cluster.nodes"] % job.segment == 0 and recipe["cluster.nodes"] // job.segment == 16  # racks


def test_the_memory_estimate_costs_the_ep_group_as_one_domain():
    """64 ranks in one 72-GPU domain: ranks_per_node 64 (one node, no RDMA region); the same job
    with each host its own domain: 4 (16 nodes, with the NVSHMEM heap of the inter-node path)."""
    nvl = dispatcher_memory.buffer_config(load(GB200))
    hosts = dispatcher_memory.buffer_config(load(GB200, *HOST_DOMAIN))
    assert (nvl.world_size, nvl.ranks_per_node, nvl.num_nodes) == (64, 64, 1)
    assert (hosts.world_size, hosts.ranks_per_node, hosts.num_nodes) == (64, 4, 16)
    cuda_nvl = memory.estimate(load(GB200, "dispatcher.backend=cuda")).dispatcher
    cuda_hosts = memory.estimate(load(GB200, "dispatcher.backend=cuda", *HOST_DOMAIN)).dispatcher
    assert "nvshmem_heap" not in dict(cuda_nvl.regions()) and dict(cuda_hosts.regions())["nvshmem_heap"] > 0
    assert cuda_nvl.held_bytes < cuda_hosts.held_bytes
    auto = memory.estimate(load(GB200)).dispatcher
    assert auto.why == "auto's pick for one node"


def test_segment_and_imex_check_only_where_the_domain_spans_hosts():
    gb200 = render.render(load(GB200))
    assert gb200.count("#SBATCH --segment=16\n") == 1
    assert "export FABRIC_CHECK=" in gb200 and 'LOCAL_WORLD_SIZE="$SLURM_NTASKS_PER_NODE"; eval "$FABRIC_CHECK"; exec' \
        in gb200
    assert "# IMEX: peer memory crosses hosts as fabric handles" in gb200
    host = ["cluster.nvlink_domain=4", "cluster.segment=1"]  # a domain of one host, said outright
    for text in (render.render(load(GB200, *HOST_DOMAIN)), render.render(load(GB200, *host)),
                 render.render(load(os.path.join(REPO, "recipes", "deepseek_v3")))):
        assert "--segment" not in text and "FABRIC_CHECK" not in text and "IMEX" not in text
    # the alltoall comparison keeps the placement; NCCL needs no IMEX check from the script
    alltoall = render.render(load(GB200, "dispatcher.type=alltoall", "balancer.interval=0"))
    assert "#SBATCH --segment=16\n" in alltoall and "FABRIC_CHECK" not in alltoall
    # EP 4 x ETP 1 fits one host of 4: no NVLink beyond it is needed, so no segment
    small = load(GB200, "parallelism.ep=4", "balancer.interval=0")
    assert domain.job_domain(small).segment == 16  # cluster.segment as given
    derived = load(GB200, "parallelism.ep=4", "balancer.interval=0", "cluster.segment=null")
    assert domain.job_domain(derived).segment == 1 and "--segment" not in render.render(derived)


def test_calibration_runs_one_ep_group_on_its_16_hosts():
    text = render.render(load(GB200))  # as shipped: it calibrates
    start = text.index(" --calibrate --reuse ")
    step = text[text.rindex("srun ", 0, start):text.index("\n\n", start)]
    assert step.startswith("srun --nodes=16 --ntasks-per-node=4 ")  # 64 ranks, hosts of 4
    assert 'eval "$FABRIC_CHECK"' in step and "--ranks-per-node 64 --device cuda --time-limit 300" in step


def test_the_benchmark_tells_each_run_its_domain():
    """bench_dispatch on hosts of 4 in NVL72 racks: 1, 2 and 4 hosts in one segment of 4, each run's
    --ranks-per-node its whole world (one domain); with each host its own domain, 4 for all."""
    sets = ["cluster.gpus_per_node=4", "cluster.nvlink_domain=72"]
    text = render.render(load(BENCH, *sets))
    assert "#SBATCH --segment=4\n" in text
    for n, g in ((1, 4), (2, 8), (4, 16)):
        assert f'"${{BENCH_ARGS[@]}}" --ranks-per-node {g} --out "$OUT_DIR/nodes{n}"' in text
    runs = text.split("srun ")[1:]
    assert ['eval "$FABRIC_CHECK"' in run for run in runs] == [False, True, True]  # one host needs no fabric
    plain = render.render(load(BENCH, "cluster.gpus_per_node=4"))
    assert "--segment" not in plain and "  --ranks-per-node 4\n" in plain and plain.count("--ranks-per-node") == 1


@pytest.mark.parametrize("sets, field, words", [
    (["cluster.nvlink_domain=70"], "cluster.nvlink_domain",
     "must be a positive multiple of cluster.gpus_per_node 4 (an NVLink domain holds whole hosts), got 70"),
    (["cluster.nvlink_domain=0"], "cluster.nvlink_domain", "must be a positive multiple of cluster.gpus_per_node 4"),
    ([f"cluster.nvlink_domain={MAX_DOMAIN_RANKS + 4}"], "cluster.nvlink_domain",
     f"must be at most {MAX_DOMAIN_RANKS}, the largest NVLink domain hybrid_ep lays out (hybrid_ep/topology.py), "
     f"got {MAX_DOMAIN_RANKS + 4}"),
    (["cluster.segment=19"], "cluster.segment", "19 hosts of 4 GPUs do not fit in an NVLink domain of 72 GPUs"),
    (["cluster.segment=0"], "cluster.segment", "must be >= 1"),
    # whole racks: 72 GPUs are not a whole number of EP groups of 64, so a group would straddle two racks
    (["cluster.segment=18"], "cluster.segment",
     "18 hosts x 4 GPUs = 72 GPUs of each NVLink domain (cluster.nvlink_domain 72): not a whole number of EP x ETP "
     "groups of 64, so a group would straddle two domains; hybrid_ep refuses a group whose domains hold different "
     "numbers of its ranks (hybrid_ep/topology.py); cluster.segment 16 fits"),
    (["cluster.segment=18"], "cluster.nodes", "256 must be a multiple of cluster.segment 18"),
    # 12 hosts: 48 GPUs, and a group of 64 is no whole number of them
    (["cluster.segment=12"], "cluster.segment", "an EP x ETP group of 64 is not a whole number of them"),
    # 8 hosts: a group spans two segments, which Slurm may put in one rack (64 there, 0 in another)
    (["cluster.segment=8"], "cluster.segment", "an EP x ETP group of 64 spans 2 segments, and Slurm may place two "
                                               "of them in one domain of 72 GPUs"),
])
def test_refusals_name_the_field(capsys, sets, field, words):
    lines = errors(capsys, GB200, *sets)
    assert any(f"error: {field}: " in line and words in line for line in lines), lines


def test_a_domain_no_group_layout_fits_is_refused(capsys):
    """EP 2 x ETP 3 = 6 ranks on hosts of 2 in domains of 4: 6 ranks are not a whole number of a
    domain's 4, and 3 parts of 2 (one host each) would let two parts share a domain: nothing fits."""
    sets = ["cluster.nodes=3", "cluster.nvlink_domain=4", "parallelism.etp=3", "train.global_batch_size=24"]
    lines = errors(capsys, os.path.join(REPO, "recipes", "tiny_moe"), *sets)
    assert lines == ["hybrid-ep-launch: error: parallelism.ep: EP x ETP = 6 ranks per hybrid_ep group cannot come "
                     "domain by domain on NVLink domains of 4 GPUs (cluster.nvlink_domain 4) in hosts of 2: hybrid_ep "
                     "needs each group inside one domain, or the same number of its ranks in each"], lines


def test_the_host_rule_reads_as_before_without_a_domain(capsys):
    lines = errors(capsys, os.path.join(REPO, "recipes", "qwen3_30b_a3b"), "cluster.gpus_per_node=6",
                   "train.global_batch_size=480")
    assert any("error: parallelism.ep: EP x ETP = 8 ranks per hybrid_ep group must be a multiple or a divisor of "
               "cluster.gpus_per_node 6" in line for line in lines), lines


def _fake_python(tmp_path, has_pynvml: bool):
    path = tmp_path / ("python-ok" if has_pynvml else "python-bare")
    path.write_text(f"#!/bin/sh\nexit {0 if has_pynvml else 1}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


@pytest.mark.parametrize("channel, has_pynvml, words", [
    (False, True, "no IMEX channel in"),
    (True, False, "has no pynvml (nvidia-ml-py)"),
    (True, True, None),
])
def test_the_fabric_check_stops_a_task_naming_its_host(tmp_path, channel, has_pynvml, words):
    """FABRIC_CHECK as a task runs it (`eval` inside bash -c, "$0" the interpreter), with the IMEX
    folder moved under tmp_path: it passes only with a channel and a Python that imports pynvml."""
    channels = tmp_path / "imex"
    channels.mkdir()
    if channel:
        (channels / "channel0").write_text("")
    check = domain.fabric_check().replace(domain.IMEX_CHANNELS, str(channels))
    proc = subprocess.run(["bash", "-c", 'eval "$FABRIC_CHECK"; echo started', _fake_python(tmp_path, has_pynvml)],
                          capture_output=True, text=True, env=dict(os.environ, FABRIC_CHECK=check,
                                                                   SLURMD_NODENAME="nvl72-07"))
    if words is None:
        assert proc.returncode == 0 and proc.stdout == "started\n" and proc.stderr == ""
    else:
        assert proc.returncode == 1 and proc.stdout == ""
        assert proc.stderr.startswith("hybrid-ep: nvl72-07: ") and words in proc.stderr
        assert domain.TROUBLESHOOTING in proc.stderr


def test_the_readme_quotes_the_launchers_numbers():
    """recipes/deepseek_v3_gb200/README.md: the estimate and the cuda buffer as the launcher computes them."""
    with open(os.path.join(GB200, "README.md")) as f:
        text = " ".join(f.read().split())
    gib = 1024**3
    est = memory.estimate(load(GB200))
    off = memory.estimate(load(GB200, "balancer.interval=0"))
    assert f"fullest stage {est.stage} (4 MoE layers)" in text and est.stage == 1
    assert f"about {est.total_gb:.1f} GiB of {est.gpu_gb:g}" in text and not est.over
    assert f"spare slots {est.spare_slots_gb:.1f} GiB ({off.total_gb:.1f} GiB with `--set balancer.interval=0`)" in text
    nvl = memory.estimate(load(GB200, "dispatcher.backend=cuda")).dispatcher
    hosts = memory.estimate(load(GB200, "dispatcher.backend=cuda", *HOST_DOMAIN)).dispatcher
    assert f"holds {nvl.held_bytes / gib:.1f} GiB per GPU" in text
    assert f"it would hold {hosts.held_bytes / gib:.1f} GiB (an NVSHMEM heap of " \
           f"{dict(hosts.regions())['nvshmem_heap'] / 2**20:.0f} MiB" in text


def test_docs_quote_the_dry_runs_domain_line():
    recipe = load(GB200)
    line = domain.describe(recipe, dispatcher_memory.buffer_config(recipe).ranks_per_node)
    with open(os.path.join(REPO, "docs", "slurm.md")) as f:
        assert f"(`{line}`)" in " ".join(f.read().split())
