"""The rules a recipe must meet before anything is rendered or submitted.

Each rule is checked on the loaded recipe (after `--set`); every failure is a
(field, rule) pair and all of them are reported at once, so one edit fixes a recipe.
The rules are the ones Megatron-LM (arguments.py, TransformerConfig) and hybrid_ep would
otherwise enforce on the cluster, after the queue wait:

- world size = TP x PP x CP x DP (DP a whole number);
- experts divisible by EP; EP x ETP divides W / PP (expert data parallelism, see shape.py);
- layers split over PP (x VPP), with the uneven first/last stage when given;
- global batch divisible by micro batch x DP;
- heads and query groups divisible by TP; MoE with TP > 1 and EP > 1 needs sequence
  parallelism (a TransformerConfig assertion); CP needs seq_length divisible by 2 x CP;
- balancer slots cover every expert; slots are checked only when the balancer is on
  (interval > 0: it has no slots otherwise); the balancer runs only inside hybrid_ep and
  with ETP 1 (the hybrid_ep dispatcher itself runs ETP > 1, over the ETP x EP group; the
  balancer refuses it, megatron_patches/manager.py); dispatcher, precision, GPU type from
  known sets;
- rows of a multiple of 16 bytes for hybrid_ep (model.hidden_size at the precision's
  element size; bench.hidden at bench.dtype), as every hybrid_ep backend requires;
- cluster.nvlink_domain whole hosts, at most hybrid_ep.topology.MAX_DOMAIN_RANKS GPUs;
  cluster.segment hosts of one domain; with hybrid_ep, each EP x ETP group inside one of the
  job's NVLink domains or the same number of its ranks in each (domain.py, as
  hybrid_ep/topology.py decides at run time); the node count a multiple of the segment;
- cluster.time in one of Slurm's time formats;
- cluster.workdir without shell variables, a leading ~ or a double quote (it is written as
  `#SBATCH --chdir`, which expands none, and the Slurm log and OUT_DIR resolve from it);
  output.dir not empty, without %, a leading ~ or a double quote (render.log_dir says where
  the log goes);
- real data needs a path or a blend (not both); a blend entry is "WEIGHT PREFIX", the weight > 0;
- site fields written as #SBATCH or srun options (partition, account, QoS, container image,
  mounts) hold no whitespace or quote; a mount holds no comma (the mounts are joined by commas);
  container.workdir is absolute; NIC fields hold no whitespace, and their variables are not also
  set in env (one home each); checkpoint paths follow output.dir's rules, the interval is >= 0;
  a `<...>` placeholder passes these checks (site_fields reports it, --submit refuses it);
- benchmark: every rule hybrid-ep-bench applies to its flags (hybrid_ep/bench/spec.py: routing,
  backends, SM counts, warmup, ...), for each node count, and no node count twice.
"""

from __future__ import annotations

import re

import torch

from hybrid_ep.backends import BACKEND_NAMES
from hybrid_ep.balancer.knobs import KNOBS, knob_problem
from hybrid_ep.bench.spec import BENCH_BACKENDS, ROUTINGS, BenchArgError, BenchSpec
from hybrid_ep.bench.spec import DTYPES as BENCH_DTYPES
from hybrid_ep.config import FP8_BLOCK
from hybrid_ep.rows import row_bytes_rule
from hybrid_ep.wording import plural

from . import domain, site_fields
from .memory import GPU_MEMORY_GB
from .recipe import RecipeError
from .shape import shape_of, stage_layers

DISPATCHERS = ("hybrid_ep", "alltoall", "allgather", "flex")
PRECISIONS = ("bf16", "fp8", "fp16", "fp32")
RECOMPUTE = ("none", "selective", "full")
# sbatch --time: minutes, minutes:seconds, hours:minutes:seconds, days-hours,
# days-hours:minutes, days-hours:minutes:seconds (minutes and seconds below 60).
_SLURM_TIME = re.compile(r"\d+(:[0-5]?\d){0,2}|\d+-\d{1,2}(:[0-5]?\d){0,2}|UNLIMITED|INFINITE")
# Rows the dispatcher moves at each precision (fp8 training dispatches bf16 activations).
_ROW_DTYPE = {"bf16": torch.bfloat16, "fp8": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _positive(recipe, fields, problems):
    for field in fields:
        value = recipe.get(field)
        if value is not None and value < 1:
            problems.append((field, f"must be >= 1, got {value}"))


def _cluster(recipe, problems):
    _positive(recipe, ["cluster.nodes", "cluster.gpus_per_node"], problems)
    if recipe["cluster.gpus_per_node"] >= 1:
        problems += domain.field_problems(recipe)
    if recipe["cluster.gpu_type"] not in GPU_MEMORY_GB:
        problems.append(("cluster.gpu_type", f"must be one of {', '.join(GPU_MEMORY_GB)}, "
                                             f"got {recipe['cluster.gpu_type']!r}"))
    if not _SLURM_TIME.fullmatch(recipe["cluster.time"]):
        problems.append(("cluster.time", "must be a Slurm time limit: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or "
                                         f"D-HH:MM:SS (e.g. 04:00:00 for four hours), got {recipe['cluster.time']!r}"))
    _paths(recipe, problems)


def _paths(recipe, problems):
    """The paths of the job's files (render.log_dir). cluster.workdir becomes `#SBATCH --chdir`,
    where sbatch expands no variables: with one, the Slurm log (--output) and the script's
    OUT_DIR would resolve from different folders. A leading ~ is expanded by neither, a double
    quote would end the quoted path, and % is a pattern to Slurm but not to the shell."""
    workdir = recipe["cluster.workdir"]
    if workdir and re.search(r"[$`]", workdir):
        problems.append(("cluster.workdir", "must be a path without shell variables: it is written as "
                                            "#SBATCH --chdir, which expands none; write the path out "
                                            f"(e.g. /lustre/you/run), got {workdir!r}"))
    out = recipe["output.dir"]
    if not out.strip():
        problems.append(("output.dir", "must name a folder, got an empty path"))
    if "%" in out:
        problems.append(("output.dir", "must not contain %: it is a shell path (OUT_DIR), where Slurm's %j is not "
                                       f"replaced; use ${{SLURM_JOB_ID}}, got {out!r}"))
    for field in ("cluster.workdir", "output.dir"):
        value = recipe[field]
        if value is None:
            continue
        if value.startswith("~"):
            instead = "write the path out" + (" or start it with $HOME" if field == "output.dir" else "")
            problems.append((field, "must not start with ~ (neither #SBATCH lines nor the script's quoted paths "
                                    f"expand it): {instead}, got {value!r}"))
        if '"' in value or "\n" in value:
            problems.append((field, f"must not contain a double quote or a newline, got {value!r}"))


# Site values written as #SBATCH or srun options: sbatch splits at whitespace and honours quotes.
_OPTION_VALUE = re.compile(r"[^\s\"'`$\\]+")


def _site(recipe, problems):
    """Partition, account, QoS, container and NICs (placeholders pass: site_fields reports them)."""
    def check(field, value, rule, ok):
        if value is not None and not site_fields.is_placeholder(value) and not ok(value):
            problems.append((field, f"{rule}, got {value!r}"))

    plain = "must be one word without whitespace, quotes, $ or backslashes (it is an #SBATCH or srun option)"
    for field in ("cluster.partition", "cluster.account", "cluster.qos", "container.image"):
        check(field, recipe[field], plain, _OPTION_VALUE.fullmatch)
    for mount in recipe["container.mounts"]:
        check("container.mounts", mount, "entries are SRC[:DST[:FLAGS]] without whitespace, quotes or commas "
              "(pyxis joins them with commas)", lambda m: _OPTION_VALUE.fullmatch(m) and "," not in m)
    check("container.workdir", recipe["container.workdir"], "must be an absolute path inside the container",
          lambda w: w.startswith("/") and "\n" not in w)
    if recipe["container.image"] is None:
        for field in ("container.mounts", "container.workdir"):
            if recipe[field]:
                problems.append((field, "applies only with container.image (pyxis options of srun); set the "
                                        "image or leave it out"))
    check("cluster.python", recipe["cluster.python"], "must name an interpreter (a path or a command name)",
          lambda p: p.strip() and "\n" not in p)
    for field, names in site_fields.NETWORK_ENV.items():
        value = recipe[f"network.{field}"]
        check(f"network.{field}", value, f"must be a list without whitespace (exported as {names[0]})",
              lambda v: re.fullmatch(r"[^\s\"'`]+", v))
        for name in names:
            if value is not None and name in recipe["env"]:
                problems.append((f"env.{name}", f"is set by network.{field}; give it there only"))


def _checkpoint(recipe, problems):
    interval = recipe["checkpoint.interval"]
    if interval is not None and interval < 0:
        problems.append(("checkpoint.interval", f"must be >= 0 (0: no checkpoints) or null (at the end of "
                                                f"training), got {interval}"))
    for field in ("checkpoint.save", "checkpoint.load"):
        value = recipe[field]
        if value is None:
            continue
        if not value.strip():
            problems.append((field, "must name a folder or be null (the default folder), got an empty path"))
        elif value.startswith("~") or '"' in value or "\n" in value or "%" in value:
            problems.append((field, "must not start with ~ or contain a double quote, % or a newline (a shell path "
                                    f"like output.dir; $HOME and ${{SLURM_JOB_ID}} expand), got {value!r}"))


def _data(recipe, problems):
    d = recipe["data"]
    if d["mock"]:
        return
    if not d["path"] and not d["blend"]:
        problems.append(("data.path", "is required when data.mock is false (a Megatron .bin/.idx prefix), or "
                                      "give data.blend"))
    if d["path"] and d["blend"]:
        problems.append(("data.blend", "and data.path are alternatives: give the blend's entries or one path"))
    for entry in d["blend"]:
        if site_fields.is_placeholder(entry):
            continue
        words = entry.split()
        if len(words) != 2 or not _positive_number(words[0]):
            problems.append(("data.blend", f"entries are \"WEIGHT PREFIX\" with a weight > 0, e.g. \"0.7 "
                                           f"/data/web_text_document\", got {entry!r}"))


def _positive_number(text: str) -> bool:
    try:
        value = float(text)
    except ValueError:
        return False
    return value > 0 and value != float("inf")


def _parallel(recipe, problems):
    p = "parallelism."
    _positive(recipe, [p + k for k in ("tp", "pp", "vpp", "cp", "ep", "etp")], problems)
    if problems:
        return
    shape = shape_of(recipe)
    model_size = shape.tp * shape.pp * shape.cp
    if shape.world % model_size:
        problems.append(("cluster.nodes", f"{plural(recipe['cluster.nodes'], 'node')} x "
                         f"{plural(recipe['cluster.gpus_per_node'], 'GPU')} = {shape.world} is not divisible by "
                         f"TP x PP x CP = {model_size} "
                         "(world size = TP x PP x CP x DP)"))
        return
    E = recipe["model.num_experts"]
    if E % shape.ep:
        problems.append(("parallelism.ep", f"model.num_experts {E} is not divisible by EP {shape.ep}"))
    per_stage = shape.world // shape.pp
    if per_stage % (shape.ep * shape.etp):
        problems.append(("parallelism.ep", f"EP x ETP = {shape.ep} x {shape.etp} must divide world / PP = "
                         f"TP x CP x DP = {per_stage} (Megatron's expert layout: W = PP x EP x ETP x EDP)"))
    if shape.vpp > 1 and shape.pp == 1:
        problems.append(("parallelism.vpp", "virtual pipeline stages need parallelism.pp > 1"))
    try:
        stage_layers(recipe)
    except ValueError as err:
        problems.append(("parallelism.pp", f"model.num_layers {recipe['model.num_layers']} do not split over "
                         f"PP {shape.pp} x VPP {shape.vpp} (first/last stage layers "
                         f"{recipe['parallelism.first_stage_layers']}/{recipe['parallelism.last_stage_layers']}): "
                         f"{err}"))
    for field in ("parallelism.first_stage_layers", "parallelism.last_stage_layers"):
        value = recipe[field]
        if value is not None and shape.vpp > 1 and value % shape.vpp:
            problems.append((field, f"{value} must be divisible by VPP {shape.vpp}"))
    mbs, gbs = recipe["train.micro_batch_size"], recipe["train.global_batch_size"]
    if mbs >= 1 and gbs % (mbs * shape.dp):
        problems.append(("train.global_batch_size", f"{gbs} is not divisible by micro batch x DP = "
                         f"{mbs} x {shape.dp} = {mbs * shape.dp}"))
    heads, groups = recipe["model.num_attention_heads"], recipe["model.num_query_groups"]
    if heads % shape.tp:
        problems.append(("model.num_attention_heads", f"{heads} is not divisible by TP {shape.tp}"))
    if groups is not None and groups % shape.tp:
        problems.append(("model.num_query_groups", f"{groups} is not divisible by TP {shape.tp}"))
    if groups is not None and heads % groups:
        problems.append(("model.num_query_groups", f"{groups} must divide num_attention_heads {heads}"))
    if shape.tp > 1 and shape.ep > 1 and not recipe["parallelism.sequence_parallel"]:
        problems.append(("parallelism.sequence_parallel", "MoE with TP > 1 and EP > 1 needs sequence "
                                                          "parallelism (Megatron TransformerConfig)"))
    if shape.cp > 1 and recipe["model.seq_length"] % (2 * shape.cp):
        problems.append(("model.seq_length",
                         f"{recipe['model.seq_length']} must be divisible by 2 x CP = {2 * shape.cp}"))


def _model(recipe, problems):
    m = "model."
    _positive(recipe, [m + k for k in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                                       "vocab_size", "seq_length", "num_experts", "moe_ffn_hidden_size",
                                       "moe_router_topk", "num_query_groups", "kv_channels")], problems)
    if recipe["model.moe_router_topk"] > recipe["model.num_experts"]:
        problems.append(("model.moe_router_topk", f"{recipe['model.moe_router_topk']} exceeds model.num_experts "
                                                  f"{recipe['model.num_experts']}"))
    if not 0 <= recipe["model.dense_layers"] < recipe["model.num_layers"]:
        problems.append(("model.dense_layers", f"must be in [0, num_layers = {recipe['model.num_layers']}), "
                                               f"got {recipe['model.dense_layers']}"))
    if recipe["model.seq_length"] > recipe["model.max_position_embeddings"]:
        problems.append(("model.seq_length", f"{recipe['model.seq_length']} exceeds max_position_embeddings "
                                             f"{recipe['model.max_position_embeddings']}"))
    if not recipe["model.mla.enabled"] and recipe["model.kv_channels"] is None \
            and recipe["model.num_attention_heads"] >= 1 \
            and recipe["model.hidden_size"] % recipe["model.num_attention_heads"]:
        problems.append(("model.kv_channels", "must be set when hidden_size is not divisible by the heads"))


def _dispatcher(recipe, problems):
    kind = recipe["dispatcher.type"]
    if kind not in DISPATCHERS:
        problems.append(("dispatcher.type", f"must be one of {', '.join(DISPATCHERS)}, got {kind!r}"))
    compare = recipe["dispatcher.compare"]
    if compare is not None and compare not in DISPATCHERS:
        problems.append(("dispatcher.compare", f"must be one of {', '.join(DISPATCHERS)} or null, got {compare!r}"))
    if recipe["dispatcher.backend"] not in BACKEND_NAMES:
        problems.append(("dispatcher.backend", f"must be one of {', '.join(BACKEND_NAMES)}, "
                                               f"got {recipe['dispatcher.backend']!r}"))
    _positive(recipe, ["dispatcher.pad_multiple", "dispatcher.num_sms_dispatch", "dispatcher.num_sms_combine",
                       "dispatcher.max_tokens_per_rank", "dispatcher.calibrate_time_limit_s"], problems)
    dtype = _ROW_DTYPE.get(recipe["precision"])
    if kind == "hybrid_ep" and dtype is not None and recipe["model.hidden_size"] >= 1:
        rule = row_bytes_rule(recipe["model.hidden_size"], dtype)
        if rule:
            problems.append(("model.hidden_size", f"with precision {recipe['precision']} and the hybrid_ep "
                                                  f"dispatcher: {rule}"))
    factor = recipe["dispatcher.static_size_factor"]
    if factor is not None and not factor > 0:
        problems.append(("dispatcher.static_size_factor", f"must be > 0 or null, got {factor}"))
    if recipe["dispatcher.dispatch_fp8"] and (kind != "hybrid_ep" or recipe["precision"] != "fp8"):
        problems.append(("dispatcher.dispatch_fp8", "needs the hybrid_ep dispatcher and precision fp8 (the rows are "
                                                    "quantized by the run's fp8 recipe, blockwise)"))
    if recipe["dispatcher.calibrate"] and (kind != "hybrid_ep" or recipe["dispatcher.backend"] != "auto"):
        problems.append(("dispatcher.calibrate", "true only applies to the hybrid_ep dispatcher with backend auto "
                                                 "(the measurement is what auto follows); null calibrates where it "
                                                 "applies, false never"))


def _dispatcher_group(recipe, problems):
    """The hybrid_ep dispatcher's groups of EP x ETP consecutive ranks on the job's NVLink domains
    (domain.py): each group inside one domain, or the same number of its ranks in each, as
    hybrid_ep/topology.py requires at run time; then the buffer the library would build."""
    layout = domain.pretrain_problems(recipe)
    if layout or recipe["dispatcher.type"] != "hybrid_ep":
        problems += layout
        return
    from .dispatcher_memory import buffer_config

    try:  # what the dispatcher builds from the --hybrid-ep-* flags of extra_args, refused as it refuses them
        buffer_config(recipe)
    except ValueError as err:
        problems.append(("extra_args", f"the hybrid_ep buffer of these --hybrid-ep-* flags: {err}"))


def _balancer(recipe, problems):
    b = "balancer."
    if recipe[b + "interval"] < 0:
        problems.append((b + "interval", f"must be >= 0 (0: off), got {recipe[b + 'interval']}"))
    _positive(recipe, [b + "window"], problems)
    decay = recipe[b + "decay"]
    if decay is not None and not 0.0 < decay < 1.0:
        problems.append((b + "decay", f"must be in (0, 1) or null, got {decay}"))
    if recipe[b + "min_gain"] < 0:
        problems.append((b + "min_gain", f"must be >= 0, got {recipe[b + 'min_gain']}"))
    for knob in KNOBS:
        problem = knob_problem(knob, recipe[b + knob], none="null")
        if problem is not None:
            problems.append((b + knob, problem))
    slots, ep = recipe[b + "slots_per_rank"], recipe["parallelism.ep"]
    E = recipe["model.num_experts"]
    if recipe[b + "interval"] > 0:  # slots exist only when the balancer is on
        _positive(recipe, [b + "slots_per_rank"], problems)
    if recipe[b + "interval"] > 0 and slots is not None and ep >= 1 and slots * ep < E:
        problems.append((b + "slots_per_rank", f"{plural(slots, 'slot')} x EP {ep} = {slots * ep} cannot hold "
                                               f"model.num_experts {E}"))
    if recipe[b + "interval"] > 0 and recipe["dispatcher.type"] != "hybrid_ep":
        problems.append((b + "interval", "the expert balancer runs inside the hybrid_ep dispatcher; "
                                         "set it to 0 with another dispatcher.type"))
    etp = recipe["parallelism.etp"]
    if recipe[b + "interval"] > 0 and recipe["dispatcher.type"] == "hybrid_ep" and etp > 1:
        # The dispatcher runs ETP > 1 (over the ETP x EP group); the balancer does not, and
        # refuses it when the dispatcher is built (megatron_patches/manager.py).
        problems.append((b + "interval", f"the expert balancer with parallelism.etp {etp} (expert tensor "
                                         "parallelism): use parallelism.etp 1 with the balancer, or turn the "
                                         "balancer off (balancer.interval 0; hybrid_ep runs ETP > 1 without it)"))


def _train(recipe, problems):
    _positive(recipe, ["train.micro_batch_size", "train.global_batch_size", "train.steps",
                       "train.log_interval"], problems)
    if recipe["train.warmup_steps"] < 0:
        problems.append(("train.warmup_steps", "must be >= 0"))
    if recipe["train.recompute"] not in RECOMPUTE:
        problems.append(("train.recompute",
                         f"must be one of {', '.join(RECOMPUTE)}, got {recipe['train.recompute']!r}"))
    if recipe["train.recompute_modules"] and recipe["train.recompute"] != "selective":
        problems.append(("train.recompute_modules", "only apply with train.recompute selective"))
    if recipe["precision"] not in PRECISIONS:
        problems.append(("precision", f"must be one of {', '.join(PRECISIONS)}, got {recipe['precision']!r}"))


def _bench(recipe, problems):
    """The rules hybrid-ep-bench applies to its flags (hybrid_ep/bench/spec.py), per node count."""
    b = "bench."
    counts = recipe[b + "node_counts"]
    G = recipe["cluster.gpus_per_node"]
    if not counts:
        problems.append((b + "node_counts", "must list at least one node count"))
    repeated = sorted({n for n in counts if counts.count(n) > 1})
    if repeated:
        problems.append((b + "node_counts", f"{', '.join(map(str, repeated))} listed more than once (each node "
                                            "count writes $OUT_DIR/nodes<N>)"))
    for n in dict.fromkeys(counts):
        if not 1 <= n <= recipe["cluster.nodes"]:
            problems.append((b + "node_counts", f"{n} must be in [1, cluster.nodes = {recipe['cluster.nodes']}]"))
        world = n * G
        if world >= 1 and recipe[b + "experts"] % world:
            problems.append((b + "experts", f"{recipe[b + 'experts']} is not divisible by {plural(n, 'node')} x "
                             f"{plural(G, 'GPU')} = {plural(world, 'rank')}"))
    _positive(recipe, [b + k for k in ("hidden", "tokens", "experts", "topk", "iters")], problems)
    if recipe[b + "warmup"] < 0:
        problems.append((b + "warmup", f"must be >= 0, got {recipe[b + 'warmup']}"))
    if recipe[b + "topk"] > recipe[b + "experts"]:
        problems.append((b + "topk", f"{recipe[b + 'topk']} exceeds bench.experts {recipe[b + 'experts']}"))
    if recipe[b + "dtype"] not in BENCH_DTYPES:
        problems.append((b + "dtype", f"must be one of {', '.join(BENCH_DTYPES)}, got {recipe[b + 'dtype']!r}"))
    if recipe[b + "dtype"] == "fp8" and recipe[b + "hidden"] % FP8_BLOCK:
        problems.append((b + "hidden", f"must be a multiple of {FP8_BLOCK} with bench.dtype fp8"))
    elif recipe[b + "dtype"] in BENCH_DTYPES and recipe[b + "hidden"] >= 1:
        rule = row_bytes_rule(recipe[b + "hidden"], BENCH_DTYPES[recipe[b + "dtype"]])
        if rule:
            problems.append((b + "hidden", f"with bench.dtype {recipe[b + 'dtype']}: {rule}"))
    if recipe[b + "routing"] not in ROUTINGS:
        problems.append((b + "routing", f"must be one of {', '.join(ROUTINGS)}, got {recipe[b + 'routing']!r}"))
    for name in recipe[b + "backends"]:
        if name not in BENCH_BACKENDS:
            problems.append((b + "backends", f"must be among {', '.join(BENCH_BACKENDS)}, got {name!r}"))
    for n in recipe[b + "sms"]:
        if n < 1:
            problems.append((b + "sms", f"SM counts must be >= 1, got {n}"))
    if problems:
        return
    problems += domain.bench_problems(recipe)
    if problems:
        return
    # Whatever else hybrid-ep-bench would refuse for one of the runs (e.g. top-k beyond the
    # experts group-limited routing reaches): its own check, named by the recipe field.
    for n in counts:
        try:
            _bench_spec(recipe, n).validate()
        except BenchArgError as err:
            field = _BENCH_FLAG_FIELDS.get(err.flag, "bench." + err.flag.lstrip("-").replace("-", "_"))
            problems.append((field, f"with {plural(n, 'node')}: {str(err).split(': ', 1)[1]} (hybrid-ep-bench "
                                    f"{err.flag})"))
            return


# hybrid-ep-bench flags the recipe sets from other fields than bench.<flag>.
_BENCH_FLAG_FIELDS = {"--world-size": "bench.node_counts", "--ranks-per-node": "cluster.gpus_per_node"}


def _bench_spec(recipe, nodes: int) -> BenchSpec:
    """The BenchSpec the rendered `python -m hybrid_ep.bench` run on `nodes` nodes resolves to."""
    b, g = recipe["bench"], recipe["cluster.gpus_per_node"]
    return BenchSpec(world_size=nodes * g, ranks_per_node=domain.bench_ranks_per_node(recipe, nodes),
                     hidden=b["hidden"], tokens=b["tokens"], topk=b["topk"], experts=b["experts"], dtype=b["dtype"],
                     routing=b["routing"], sms=tuple(b["sms"]), backends=tuple(dict.fromkeys(b["backends"])),
                     warmup=b["warmup"], iters=b["iters"], seed=0, device="cuda")


def validate(recipe) -> None:
    """Raise RecipeError listing every (field, rule) the recipe breaks."""
    problems: list[tuple[str, str]] = []
    _cluster(recipe, problems)
    _site(recipe, problems)
    if recipe.kind == "benchmark":
        _bench(recipe, problems)
    else:
        _model(recipe, problems)
        if not problems:
            _parallel(recipe, problems)
        _dispatcher(recipe, problems)
        _balancer(recipe, problems)
        _train(recipe, problems)
        _data(recipe, problems)
        _checkpoint(recipe, problems)
        if not problems:
            _dispatcher_group(recipe, problems)
    if problems:
        raise RecipeError(problems)
