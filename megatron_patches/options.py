"""The hybrid_ep knobs that Megatron's TransformerConfig has no field for.

Megatron builds TransformerConfig from its own dataclass fields only, so the knobs travel
separately, looked up in this order by `options_for(config)`:

1. `config.hybrid_ep_options` (a HybridEPOptions set by library users on the config);
2. Megatron-LM's parsed arguments (`--hybrid-ep-*` flags, added by `extra_args_provider`);
3. the defaults below.
"""

from __future__ import annotations

import argparse
import dataclasses


@dataclasses.dataclass(frozen=True)
class HybridEPOptions:
    """How the hybrid_ep dispatcher runs; validated once by validate().

    num_sms_dispatch / num_sms_combine: SMs per call on the cuda backend (None: default).
    pad_multiple: rows of each local expert padded with zero rows to a multiple of this
    (combined with the quantization alignment by least common multiple).
    static_size_factor: alias of Megatron's `moe_expert_rank_capacity_factor` (which wins
    when both are set and agree; different values raise). None = exact output size (one host
    sync per dispatch); a float f gives a static output of ceil(f * tokens * topk) rows plus
    the padding bound, no host sync, and rows that do not fit are dropped and counted.
    max_tokens_per_rank: buffer size in tokens (None: the largest token count the EP group
    has seen so far; it grows with variable_seq_lengths).
    ranks_per_node: NVLink domain size (None: from LOCAL_WORLD_SIZE and the group's members).
    backend: "auto" (what it picks: docs/architecture.md#what-runs-where), "cuda", "reference".
    Nothing sizes the buffer's memory: what it holds is bounded by design (memory_plan(), logged
    when the buffer is made); --hybrid-ep-arena-layers and --hybrid-ep-arena-imbalance are
    retired (RETIRED_FLAGS).

    Expert balancer (docs/balancer.md), off while balancer_interval is 0:
    balancer_interval: K, steps between load reductions and rebalancing.
    balancer_slots_per_rank: expert slots per EP rank (None: experts / EP, placement only;
    more gives spare slots for replicas of hot experts).
    balancer_window: reductions (of K steps each) summed into the load the planner sees.
    balancer_decay: when set, an exponential moving average over reductions with this decay
    replaces the window.
    balancer_min_gain: apply a new placement only when it lowers the planned rank imbalance
    (max - mean) / mean by more than this.
    balancer_tolerance: the planner's tolerance (None: its default, 0.01): it keeps the
    previous placement (or refits few of its slots) while each layer's rank imbalance stays
    within this of a fresh plan's; larger moves fewer slots per rebalance, at a little more
    imbalance.
    balancer_move_budget: the most slots per layer one rebalance migrates, as a fraction of the
    layer's slots (None: no cap); where it binds, the imbalance may stay above the tolerance
    until later rebalances move the rest.
    balancer_rdma_weight: None (the default) plans for the spreading replica choice, copies on
    any node; a number turns on the node-aware plan and the replica choice by locality across
    nodes (experts stay on their group's node unless moving one pays for itself at this weight:
    imbalance given up per fraction of routes served off their home node;
    hybrid_ep.balancer.knobs.DEFAULT_RDMA_WEIGHT, 0.5, is the measured choice). For
    node-limited routing (--moe-router-num-groups = nodes).
    balancer_placement: YAML placement file (from `python -m hybrid_ep.balancer plan`) to
    start from.
    balancer_report_dir: folder for per-rebalance JSON reports and heatmap PNGs (rank 0).

    fp8 on the wire (docs/megatron.md; `wire_fp8` checks the run can carry it):
    dispatch_fp8: the forward dispatch sends rows as fp8 with the scales of the run's
    --fp8-recipe (blockwise: 1x128 fp32), quantized once before the dispatch.
    combine_grad_fp8: the combine's backward (a dispatch of the output gradient) likewise.
    The dispatch's backward (a sum) stays in the rows' dtype.

    expert_out_in_place: on the cuda backend's direct path with one process per GPU, the
    experts' last projection (TEGroupedMLP's linear_fc2, as Transformer Engine's GroupedLinear
    allocates it) writes its output into the buffer's expert-out block, so the forward combine
    reads it in place instead of copying it there (megatron_patches.expert_out); False: copied.
    """

    num_sms_dispatch: int | None = None
    num_sms_combine: int | None = None
    pad_multiple: int = 1
    static_size_factor: float | None = None
    max_tokens_per_rank: int | None = None
    ranks_per_node: int | None = None
    backend: str = "auto"
    balancer_interval: int = 0
    balancer_slots_per_rank: int | None = None
    balancer_window: int = 1
    balancer_decay: float | None = None
    balancer_min_gain: float = 0.0
    balancer_tolerance: float | None = None
    balancer_move_budget: float | None = None
    balancer_rdma_weight: float | None = None
    balancer_placement: str | None = None
    balancer_report_dir: str | None = None
    dispatch_fp8: bool = False
    combine_grad_fp8: bool = False
    expert_out_in_place: bool = True

    @property
    def balancer_enabled(self) -> bool:
        return self.balancer_interval > 0

    def validate(self) -> "HybridEPOptions":
        """Check every field; a bad one raises ValueError naming it (wrong types included, so a
        value never gets as far as a bare TypeError or an OverflowError in the first dispatch).
        Integers are ints but not bools (True would pass as 1); numbers are finite (inf would
        overflow ceil(f * rows)): hybrid_ep.checks, imported here so that `import
        megatron_patches` stays free of torch, as the imports below."""
        from hybrid_ep.checks import is_int, is_real

        for name in ("num_sms_dispatch", "num_sms_combine", "max_tokens_per_rank", "ranks_per_node",
                     "balancer_slots_per_rank"):
            value = getattr(self, name)
            if value is not None and not is_int(value, 1):
                raise ValueError(f"hybrid_ep option {name} must be an int >= 1 or None, got {value!r}")
        for name, low in (("pad_multiple", 1), ("balancer_window", 1), ("balancer_interval", 0)):
            value = getattr(self, name)
            if not is_int(value, low):
                rule = f"an int >= {low}" + (" (0: off)" if low == 0 else "")
                raise ValueError(f"hybrid_ep option {name} must be {rule}, got {value!r}")
        factor = self.static_size_factor
        if factor is not None and not (is_real(factor, finite=True) and factor > 0):
            raise ValueError(f"hybrid_ep option static_size_factor must be a finite number > 0 or None, got {factor!r}")
        decay = self.balancer_decay
        if decay is not None and not (is_real(decay, finite=True) and 0.0 < decay < 1.0):
            raise ValueError(f"hybrid_ep option balancer_decay must be a number in (0, 1) or None, got {decay!r}")
        if not (is_real(self.balancer_min_gain, finite=True) and self.balancer_min_gain >= 0.0):
            raise ValueError(
                f"hybrid_ep option balancer_min_gain must be a finite number >= 0, got {self.balancer_min_gain!r}"
            )
        from hybrid_ep.balancer import knobs  # here: `import megatron_patches` stays free of torch

        knobs.check_knobs("hybrid_ep option balancer_", tolerance=self.balancer_tolerance,
                          move_budget=self.balancer_move_budget, rdma_weight=self.balancer_rdma_weight)
        for name in ("dispatch_fp8", "combine_grad_fp8", "expert_out_in_place"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"hybrid_ep option {name} must be a bool, got {getattr(self, name)!r}")
        from hybrid_ep.backends import BACKEND_NAMES  # here too, for the same reason

        if self.backend not in BACKEND_NAMES:
            raise ValueError(f"hybrid_ep option backend must be one of {BACKEND_NAMES}, got {self.backend!r}")
        return self


# Command-line flag -> HybridEPOptions field.
FLAGS = {
    "--hybrid-ep-num-sms-dispatch": ("num_sms_dispatch", int),
    "--hybrid-ep-num-sms-combine": ("num_sms_combine", int),
    "--hybrid-ep-pad-multiple": ("pad_multiple", int),
    "--hybrid-ep-static-size-factor": ("static_size_factor", float),
    "--hybrid-ep-max-tokens-per-rank": ("max_tokens_per_rank", int),
    "--hybrid-ep-ranks-per-node": ("ranks_per_node", int),
    "--hybrid-ep-backend": ("backend", str),
    "--hybrid-ep-balancer-interval": ("balancer_interval", int),
    "--hybrid-ep-balancer-slots-per-rank": ("balancer_slots_per_rank", int),
    "--hybrid-ep-balancer-window": ("balancer_window", int),
    "--hybrid-ep-balancer-decay": ("balancer_decay", float),
    "--hybrid-ep-balancer-min-gain": ("balancer_min_gain", float),
    "--hybrid-ep-balancer-tolerance": ("balancer_tolerance", float),
    "--hybrid-ep-balancer-move-budget": ("balancer_move_budget", float),
    "--hybrid-ep-balancer-rdma-weight": ("balancer_rdma_weight", float),
    "--hybrid-ep-balancer-placement": ("balancer_placement", str),
    "--hybrid-ep-balancer-report-dir": ("balancer_report_dir", str),
    "--hybrid-ep-dispatch-fp8": ("dispatch_fp8", bool),
    "--hybrid-ep-combine-grad-fp8": ("combine_grad_fp8", bool),
    "--hybrid-ep-expert-out-in-place": ("expert_out_in_place", bool),
}

_HELP = {
    "num_sms_dispatch": "SMs used by hybrid_ep dispatch (cuda backend; default: library choice)",
    "num_sms_combine": "SMs used by hybrid_ep combine (cuda backend; default: library choice)",
    "pad_multiple": "pad each local expert's rows with zero rows to a multiple of this",
    "static_size_factor": "alias of --moe-expert-rank-capacity-factor: static dispatch output of "
                          "factor x tokens x topk rows (no host sync; overflow is dropped and "
                          "counted); default: exact size",
    "max_tokens_per_rank": "hybrid_ep buffer size in tokens per rank (default: the EP group's largest so far)",
    "ranks_per_node": "NVLink domain size of the EP group (default: from LOCAL_WORLD_SIZE and its members)",
    "backend": "hybrid_ep backend: auto (docs/architecture.md#what-runs-where), cuda or reference",
    "balancer_interval": "expert balancer: steps between load reductions and rebalancing (0: off)",
    "balancer_slots_per_rank": "expert balancer: expert slots per EP rank (default experts / EP: "
                               "placement only; more: replicas of hot experts)",
    "balancer_window": "expert balancer: reductions summed into the planned load",
    "balancer_decay": "expert balancer: moving-average decay over reductions (replaces the window)",
    "balancer_min_gain": "expert balancer: least drop of the rank imbalance that triggers a migration",
    "balancer_tolerance": "expert balancer: rank imbalance by which a kept placement may exceed a fresh "
                          "plan's; larger moves fewer slots per rebalance, at a little more imbalance (default: "
                          "the planner's, 0.01)",
    "balancer_move_budget": "expert balancer: most slots per layer one rebalance migrates, as a fraction of the "
                            "slots; where it binds the imbalance may stay above the tolerance until later "
                            "rebalances (default: no cap)",
    "balancer_rdma_weight": "expert balancer: the node-aware plan and replica choice by locality, for node-limited "
                            "routing: imbalance given up per fraction of routes served off their home node (0.5 "
                            "is the measured choice; default: none, the node-agnostic plan)",
    "balancer_placement": "expert balancer: initial placement YAML (python -m hybrid_ep.balancer plan)",
    "balancer_report_dir": "expert balancer: folder for JSON reports and heatmap PNGs",
    "dispatch_fp8": "send the forward dispatch's rows in fp8 with the scales of --fp8-recipe (blockwise only: "
                    "1x128 fp32 scales); default: the rows' own dtype",
    "combine_grad_fp8": "send the combine's backward (the output gradient to the expert rows) in fp8 likewise",
    "expert_out_in_place": "cuda backend, direct path: the experts' fc2 (TEGroupedMLP) writes its output where the "
                           "forward combine reads it, not copied there (default: on; "
                           "--no-hybrid-ep-expert-out-in-place: copied)",
}


# Flags that no longer exist, and why: given, they stop the parse with this reason instead of
# argparse's "unrecognized arguments" (a job script written for an older release says what to drop).
RETIRED_FLAGS = {
    "--hybrid-ep-arena-layers": "the cuda backend no longer keeps dispatch outputs in an arena sized by hand: "
                                "they come from PyTorch's allocator, and the memory the buffer holds is bounded "
                                "by design (its startup line and memory_plan() say how much); drop the flag",
    "--hybrid-ep-arena-imbalance": "it sized the retired --hybrid-ep-arena-layers arena; drop the flag",
}


class _Retired(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} was retired: {RETIRED_FLAGS[option_string]}")


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the --hybrid-ep-* flags to an argparse parser (Megatron's or any other)."""
    defaults = HybridEPOptions()
    group = parser.add_argument_group(title="hybrid_ep token dispatcher")
    for flag, (field, kind) in FLAGS.items():
        kwargs = {"type": kind, "default": getattr(defaults, field), "help": _HELP[field]}
        if kind is bool:  # a switch: given, on; one that defaults to on also takes --no-<flag>
            action = argparse.BooleanOptionalAction if getattr(defaults, field) else "store_true"
            kwargs = {"action": action, "default": getattr(defaults, field), "help": _HELP[field]}
        if field == "backend":
            from hybrid_ep.backends import BACKEND_NAMES  # not at import: `import megatron_patches` stays free of torch

            kwargs["choices"] = list(BACKEND_NAMES)
        group.add_argument(flag, dest=f"hybrid_ep_{field}", **kwargs)
    for flag in RETIRED_FLAGS:
        group.add_argument(flag, action=_Retired, nargs="?", help=argparse.SUPPRESS)
    return parser


DISPATCHER_TYPE = "hybrid_ep"


def extra_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's `extra_args_provider` for hybrid_ep: "hybrid_ep" among the choices of
    --moe-token-dispatcher-type, and the --hybrid-ep-* flags. The launcher passes it; a script of
    its own passes it to `parse_and_validate_args` / `parse_args` (after its own provider, if
    any: `lambda p: extra_args_provider(own(p))`). Adding it twice changes nothing."""
    for action in parser._actions:
        if "--moe-token-dispatcher-type" in action.option_strings and action.choices is not None \
                and DISPATCHER_TYPE not in action.choices:
            action.choices = list(action.choices) + [DISPATCHER_TYPE]
    if not any(flag in action.option_strings for action in parser._actions for flag in FLAGS):
        add_arguments(parser)
    return parser


def from_args(args) -> HybridEPOptions:
    """HybridEPOptions from a namespace that holds the hybrid_ep_* attributes (others default)."""
    values = {}
    for field in (f.name for f in dataclasses.fields(HybridEPOptions)):
        if hasattr(args, f"hybrid_ep_{field}"):
            values[field] = getattr(args, f"hybrid_ep_{field}")
    return HybridEPOptions(**values).validate()


def _megatron_args():
    try:
        from megatron.training import global_vars
    except ImportError:
        return None
    return getattr(global_vars, "_GLOBAL_ARGS", None)


def options_for(config) -> HybridEPOptions:
    explicit = getattr(config, "hybrid_ep_options", None)
    if explicit is not None:
        if not isinstance(explicit, HybridEPOptions):
            raise TypeError(
                f"config.hybrid_ep_options must be a HybridEPOptions, got {type(explicit).__name__}"
            )
        return explicit.validate()
    args = _megatron_args()
    if args is not None:
        return from_args(args)
    return HybridEPOptions()


def static_size_factor(config, opts: HybridEPOptions) -> float | None:
    """The static-size factor: Megatron's moe_expert_rank_capacity_factor, or its alias
    --hybrid-ep-static-size-factor; both set to different values is an error."""
    from hybrid_ep.checks import is_real  # here: `import megatron_patches` stays free of torch

    megatron = getattr(config, "moe_expert_rank_capacity_factor", None)
    alias = opts.static_size_factor
    if megatron is not None and not (is_real(megatron, finite=True) and megatron > 0):
        raise ValueError(
            f"moe_expert_rank_capacity_factor must be a finite number > 0 or None, got {megatron!r}"
        )
    if megatron is not None and alias is not None and float(megatron) != float(alias):
        raise ValueError(
            f"moe_expert_rank_capacity_factor={megatron} and --hybrid-ep-static-size-factor={alias} "
            "disagree; --hybrid-ep-static-size-factor is an alias, set only "
            "moe_expert_rank_capacity_factor"
        )
    factor = megatron if megatron is not None else alias
    if factor is not None and not (is_real(factor, finite=True) and factor > 0):
        raise ValueError(
            f"hybrid_ep option static_size_factor (--hybrid-ep-static-size-factor) must be a finite "
            f"number > 0 or None, got {factor!r}"
        )
    return factor
