"""A pretraining recipe as Megatron-LM's `pretrain_gpt.py` argument list.

The list is what `python -m megatron_patches.pretrain_gpt` receives, on the cluster and in
local mode, and what the tests parse with Megatron-LM's own parser. Structured fields
(shape, parallelism, dispatcher, balancer, precision, batch, data, checkpoints) become flags here;
`model.extra_args` and `train.extra_args` are appended verbatim after them (router,
position embedding, normalisation, fusions: see each recipe).
"""

from __future__ import annotations


def _flag(args: list[str], name: str, value) -> None:
    if value is None or value is False:
        return
    args.append(name)
    if value is not True:
        args.append(str(value))


def model_args(m: dict) -> list[str]:
    a: list[str] = []
    _flag(a, "--num-layers", m["num_layers"])
    _flag(a, "--hidden-size", m["hidden_size"])
    _flag(a, "--ffn-hidden-size", m["ffn_hidden_size"])
    _flag(a, "--num-attention-heads", m["num_attention_heads"])
    if m["num_query_groups"] is not None and m["num_query_groups"] != m["num_attention_heads"]:
        _flag(a, "--group-query-attention", True)
        _flag(a, "--num-query-groups", m["num_query_groups"])
    _flag(a, "--kv-channels", m["kv_channels"])
    _flag(a, "--seq-length", m["seq_length"])
    _flag(a, "--max-position-embeddings", m["max_position_embeddings"])
    _flag(a, "--untie-embeddings-and-output-weights", m["untie_embeddings"])
    _flag(a, "--swiglu", m["swiglu"])
    _flag(a, "--num-experts", m["num_experts"])
    _flag(a, "--moe-ffn-hidden-size", m["moe_ffn_hidden_size"])
    _flag(a, "--moe-router-topk", m["moe_router_topk"])
    _flag(a, "--moe-shared-expert-intermediate-size", m["moe_shared_expert_intermediate_size"])
    if m["dense_layers"]:
        n, k = m["dense_layers"], m["num_layers"] - m["dense_layers"]
        _flag(a, "--moe-layer-freq", f"([0]*{n}+[1]*{k})")
    mla = m["mla"]
    if mla["enabled"]:
        _flag(a, "--multi-latent-attention", True)
        _flag(a, "--q-lora-rank", mla["q_lora_rank"])
        _flag(a, "--kv-lora-rank", mla["kv_lora_rank"])
        _flag(a, "--qk-head-dim", mla["qk_head_dim"])
        _flag(a, "--qk-pos-emb-head-dim", mla["qk_pos_emb_head_dim"])
        _flag(a, "--v-head-dim", mla["v_head_dim"])
    return a + list(m["extra_args"])


def parallel_args(p: dict) -> list[str]:
    a: list[str] = []
    _flag(a, "--tensor-model-parallel-size", p["tp"])
    _flag(a, "--pipeline-model-parallel-size", p["pp"])
    if p["vpp"] and p["vpp"] > 1:
        _flag(a, "--num-virtual-stages-per-pipeline-rank", p["vpp"])
    _flag(a, "--context-parallel-size", p["cp"])
    _flag(a, "--expert-model-parallel-size", p["ep"])
    _flag(a, "--expert-tensor-parallel-size", p["etp"])
    _flag(a, "--sequence-parallel", p["sequence_parallel"])
    _flag(a, "--decoder-first-pipeline-num-layers", p["first_stage_layers"])
    _flag(a, "--decoder-last-pipeline-num-layers", p["last_stage_layers"])
    _flag(a, "--account-for-embedding-in-pipeline-split", p["account_for_embedding"])
    _flag(a, "--account-for-loss-in-pipeline-split", p["account_for_loss"])
    _flag(a, "--use-distributed-optimizer", p["distributed_optimizer"])
    return a


def dispatcher_args(d: dict, b: dict) -> list[str]:
    a = ["--moe-token-dispatcher-type", d["type"]]
    if d["type"] != "hybrid_ep":
        return a
    _flag(a, "--hybrid-ep-pad-multiple", d["pad_multiple"] if d["pad_multiple"] != 1 else None)
    _flag(a, "--hybrid-ep-num-sms-dispatch", d["num_sms_dispatch"])
    _flag(a, "--hybrid-ep-num-sms-combine", d["num_sms_combine"])
    _flag(a, "--hybrid-ep-static-size-factor", d["static_size_factor"])
    _flag(a, "--hybrid-ep-max-tokens-per-rank", d["max_tokens_per_rank"])
    _flag(a, "--hybrid-ep-backend", d["backend"] if d["backend"] != "auto" else None)
    _flag(a, "--hybrid-ep-dispatch-fp8", d["dispatch_fp8"])
    if b["interval"] > 0:
        _flag(a, "--hybrid-ep-balancer-interval", b["interval"])
        _flag(a, "--hybrid-ep-balancer-slots-per-rank", b["slots_per_rank"])
        _flag(a, "--hybrid-ep-balancer-window", b["window"] if b["window"] != 1 else None)
        _flag(a, "--hybrid-ep-balancer-decay", b["decay"])
        _flag(a, "--hybrid-ep-balancer-min-gain", b["min_gain"] if b["min_gain"] else None)
        _flag(a, "--hybrid-ep-balancer-tolerance", b["tolerance"])
        _flag(a, "--hybrid-ep-balancer-move-budget", b["move_budget"])
        _flag(a, "--hybrid-ep-balancer-rdma-weight", b["rdma_weight"])
        _flag(a, "--hybrid-ep-balancer-report-dir", b["report_dir"])
    return a


def precision_args(precision: str) -> list[str]:
    return {"bf16": ["--bf16"], "fp16": ["--fp16"], "fp32": [],
            "fp8": ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "blockwise"]}[precision]


def train_args(t: dict) -> list[str]:
    a: list[str] = []
    _flag(a, "--micro-batch-size", t["micro_batch_size"])
    _flag(a, "--global-batch-size", t["global_batch_size"])
    _flag(a, "--train-iters", t["steps"])
    _flag(a, "--lr", t["lr"])
    _flag(a, "--min-lr", t["min_lr"])
    _flag(a, "--lr-warmup-iters", t["warmup_steps"])
    _flag(a, "--log-interval", t["log_interval"])
    if t["recompute"] == "selective":
        a += ["--recompute-granularity", "selective"]
        if t["recompute_modules"]:
            a += ["--recompute-modules", *t["recompute_modules"]]
    elif t["recompute"] == "full":
        a += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    return a


def data_args(d: dict, m: dict) -> list[str]:
    """Mock data only when data.mock asks for it; else the dataset prefix or the blend
    ("WEIGHT PREFIX" entries, one --data-path list as Megatron reads it)."""
    a: list[str] = []
    if d["mock"]:
        _flag(a, "--mock-data", True)
    elif d["blend"]:
        a += ["--data-path", *(word for entry in d["blend"] for word in entry.split())]
    else:
        _flag(a, "--data-path", d["path"])
    if not d["mock"]:
        _flag(a, "--split", d["split"])
    _flag(a, "--tokenizer-type", d["tokenizer_type"])
    _flag(a, "--tokenizer-model", d["tokenizer_model"])
    if d["tokenizer_type"] == "NullTokenizer":
        _flag(a, "--vocab-size", m["vocab_size"])
    return a


def beside_job_folders(recipe, name: str) -> str:
    """`name` beside the job folders, where what the recipe's jobs share is kept (checkpoints,
    the calibration's evidence): in the parent of output.dir when its last part names the job
    (has a variable: results/x/${SLURM_JOB_ID} -> results/x/name), else inside output.dir. May
    hold shell variables, as output.dir may (the script expands them)."""
    out = recipe["output.dir"].rstrip("/") or "."
    parent, _, last = out.rpartition("/")
    if "$" in last:
        return f"{parent or '.'}/{name}"
    return f"{out}/{name}"


def checkpoint_dir(recipe) -> str:
    """Where checkpoints go by default: checkpoints/ beside the job folders, so the next job
    of the recipe resumes from the last one."""
    return beside_job_folders(recipe, "checkpoints")


CHECKPOINT_PATH_FLAGS = ("--save", "--load")


def checkpoint_args(recipe) -> list[str]:
    """--save, --load and --save-interval: none with checkpoint.interval 0; null saves once, at
    the end (Megatron-LM needs an interval with --save: train.steps)."""
    c = recipe["checkpoint"]
    if c["interval"] == 0:
        return []
    save = c["save"] or checkpoint_dir(recipe)
    return ["--save", save, "--load", c["load"] or save, "--save-interval", str(c["interval"] or recipe["train.steps"])]


def megatron_args(recipe) -> list[str]:
    """The full pretrain_gpt.py argument list of a pretraining recipe."""
    r = recipe.data
    return (model_args(r["model"]) + parallel_args(r["parallelism"])
            + dispatcher_args(r["dispatcher"], r["balancer"]) + precision_args(r["precision"])
            + train_args(r["train"]) + data_args(r["data"], r["model"]) + checkpoint_args(recipe)
            + list(r["train"]["extra_args"]))
