"""Which fields a recipe has, their types and defaults.

A recipe is a YAML mapping of sections. Every leaf has a declared type so that a typo or a
wrong type in the YAML or in `--set key=value` fails at load time with the dotted field name,
not as a Megatron error an hour into a queue. Two kinds: `pretrain` (a Megatron-LM run) and
`benchmark` (the dispatch microbenchmark, `python -m hybrid_ep.bench`).

Type names: int, float, str, bool, each with a trailing `?` when null is allowed;
list[str], list[int]; `map` is a free mapping of names to scalars (environment variables),
whose keys are not checked.
"""

from __future__ import annotations

REQUIRED = object()  # default of a field the recipe must give

_COMMON = {
    "name": ("str", REQUIRED),
    "kind": ("str", "pretrain"),
    "description": ("str", ""),
    "cluster": {
        "nodes": ("int", REQUIRED),
        "gpus_per_node": ("int", 8),
        "nvlink_domain": ("int?", None),  # GPUs per NVLink domain; None: one host (gpus_per_node); domain.py
        "segment": ("int?", None),  # hosts of each domain the job takes (#SBATCH --segment); None: derived
        "gpu_type": ("str", "H100"),
        "partition": ("str?", None),
        "account": ("str?", None),
        "qos": ("str?", None),
        "time": ("str", "01:00:00"),
        "job_name": ("str?", None),
        "exclusive": ("bool", True),
        "python": ("str?", None),  # None: `python` from the job's PATH (reported as unset)
        "workdir": ("str?", None),
        "sbatch_extra": ("list[str]", []),
    },
    "container": {
        "image": ("str?", None),
        "mounts": ("list[str]", []),
        "workdir": ("str?", None),  # None: the job's working directory ("$PWD" on the batch host)
    },
    "network": {  # None: the library picks its NICs itself
        "nccl_ib_hca": ("str?", None),
        "nvshmem_hca_list": ("str?", None),
        "socket_ifname": ("str?", None),
    },
    "env": ("map", {}),
    "output": {
        "dir": ("str", "results/${SLURM_JOB_ID}"),
    },
}

_PRETRAIN = {
    "model": {
        "num_layers": ("int", REQUIRED),
        "hidden_size": ("int", REQUIRED),
        "ffn_hidden_size": ("int", REQUIRED),
        "num_attention_heads": ("int", REQUIRED),
        "num_query_groups": ("int?", None),
        "kv_channels": ("int?", None),
        "vocab_size": ("int", REQUIRED),
        "seq_length": ("int", REQUIRED),
        "max_position_embeddings": ("int", REQUIRED),
        "untie_embeddings": ("bool", True),
        "swiglu": ("bool", True),
        "num_experts": ("int", REQUIRED),
        "moe_ffn_hidden_size": ("int", REQUIRED),
        "moe_router_topk": ("int", REQUIRED),
        "moe_shared_expert_intermediate_size": ("int?", None),
        "dense_layers": ("int", 0),
        "mla": {
            "enabled": ("bool", False),
            "q_lora_rank": ("int?", None),
            "kv_lora_rank": ("int", 512),
            "qk_head_dim": ("int", 128),
            "qk_pos_emb_head_dim": ("int", 64),
            "v_head_dim": ("int", 128),
        },
        "extra_args": ("list[str]", []),
    },
    "parallelism": {
        "tp": ("int", 1),
        "pp": ("int", 1),
        "vpp": ("int?", None),
        "cp": ("int", 1),
        "ep": ("int", 1),
        "etp": ("int", 1),
        "sequence_parallel": ("bool", False),
        "first_stage_layers": ("int?", None),
        "last_stage_layers": ("int?", None),
        "account_for_embedding": ("bool", False),
        "account_for_loss": ("bool", False),
        "distributed_optimizer": ("bool", True),
    },
    "dispatcher": {
        "type": ("str", "hybrid_ep"),
        "compare": ("str?", "alltoall"),
        "pad_multiple": ("int", 1),
        "num_sms_dispatch": ("int?", None),
        "num_sms_combine": ("int?", None),
        "static_size_factor": ("float?", None),
        "max_tokens_per_rank": ("int?", None),
        "backend": ("str", "auto"),
        # null: time reference against cuda first wherever it applies; auto follows it (calibration.py)
        "calibrate": ("bool?", None),
        "calibrate_time_limit_s": ("int", 300),  # the calibration's bound, printed with its result
        "dispatch_fp8": ("bool", False),  # fp8 rows on the forward dispatch (precision fp8 only; not measured yet)
    },
    "balancer": {
        "interval": ("int", 0),
        "slots_per_rank": ("int?", None),
        "window": ("int", 1),
        "decay": ("float?", None),
        "min_gain": ("float", 0.0),
        "tolerance": ("float?", None),  # None: the planner's default
        "move_budget": ("float?", None),  # None: no cap on the slots one rebalance moves
        "rdma_weight": ("float?", None),  # None: the node-agnostic plan (no replica choice by locality)
        "report_dir": ("str?", None),
    },
    "precision": ("str", "bf16"),
    "train": {
        "micro_batch_size": ("int", 1),
        "global_batch_size": ("int", REQUIRED),
        "steps": ("int", 100),
        "lr": ("float", 1.0e-4),
        "min_lr": ("float", 1.0e-5),
        "warmup_steps": ("int", 10),
        "log_interval": ("int", 1),
        "recompute": ("str", "none"),
        "recompute_modules": ("list[str]", []),
        "extra_args": ("list[str]", []),
    },
    "checkpoint": {
        "save": ("str?", None),  # None: checkpoints/ beside the job folders (megatron_args.checkpoint_dir)
        "load": ("str?", None),  # None: the save folder (a job resumes from the last checkpoint there)
        "interval": ("int?", None),  # None: once, at the end of training; 0: no checkpoints
    },
    "data": {
        "mock": ("bool", False),
        "path": ("str?", None),
        "blend": ("list[str]", []),  # "WEIGHT PREFIX" entries: Megatron's --data-path blend
        "split": ("str?", None),
        "tokenizer_type": ("str", "NullTokenizer"),
        "tokenizer_model": ("str?", None),
    },
    "megatron_lm_dir": ("str?", None),  # null: $MEGATRON_LM_DIR at submission, or PYTHONPATH
}

_BENCHMARK = {
    "bench": {
        "node_counts": ("list[int]", [1]),
        "hidden": ("int", 7168),
        "tokens": ("int", 4096),
        "experts": ("int", 256),
        "topk": ("int", 8),
        "dtype": ("str", "bf16"),
        "routing": ("str", "uniform"),
        "backends": ("list[str]", []),
        "sms": ("list[int]", []),
        "warmup": ("int", 10),
        "iters": ("int", 30),
    },
}

KINDS = {"pretrain": {**_COMMON, **_PRETRAIN}, "benchmark": {**_COMMON, **_BENCHMARK}}


def schema_for(kind: str) -> dict:
    if not isinstance(kind, str) or kind not in KINDS:
        raise KeyError(kind)
    return KINDS[kind]


def leaves(schema: dict, prefix: str = ""):
    """(dotted name, type, default) of every leaf, in declaration order."""
    for key, value in schema.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from leaves(value, name + ".")
        else:
            yield name, value[0], value[1]
