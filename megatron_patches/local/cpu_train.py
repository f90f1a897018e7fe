"""A small Megatron-Core trainer for local mode without Megatron-LM's pretrain_gpt.py or a GPU.

    RANK=.. WORLD_SIZE=.. MASTER_ADDR=.. MASTER_PORT=.. python -m megatron_patches.local.cpu_train <Megatron args>

Local mode (`hybrid-ep-launch <recipe> --local`) runs this, one process per rank, when
pretrain_gpt.py cannot be found or there is no GPU per rank: Megatron-LM's training loop
needs CUDA (device placement, fused kernels, CUDA RNG and memory calls) and is not installed
with Megatron-Core. It takes the same argument list the cluster job gets and parses it with
Megatron-LM's own parser (megatron.training, with megatron_patches.extra_args_provider), so the model
(TransformerConfig, layer count, experts, top-k, dispatcher, --hybrid-ep-* knobs) is the
recipe's. It then builds Megatron-Core's GPTModel on gloo with Megatron's decoder block
spec (local modules), as pretrain_gpt.py builds a MoE model: dense and MoE layers follow
--moe-layer-freq (the recipe's model.dense_layers; the second line lists them). It trains
it for --train-iters steps on counting sequences (each sequence counts upward from a random
start by a stride of 1-4, modulo the vocabulary: learnable in a few dozen steps), printing
the loss of every step. With --hybrid-ep-balancer-interval K > 0 the expert balancer runs
as under pretrain_gpt.py: megatron_patches.balancer.attach() once the optimizer exists,
which wraps the optimizer step the loop calls (replica gradients summed before it; every K
steps after it the load is reduced, a placement planned and slots migrated), with the
recipe's slots per rank, tolerance, move budget and report folder; its log lines go to the
output.

What differs from pretrain_gpt.py, on purpose:
- GPU-only fusions are switched off (gradient-accumulation fusion, bias/activation fusion,
  masked-softmax fusion, persistent layer norm); weights are built on the host;
- optimizer: torch AdamW with linear warm-up and cosine decay to --min-lr; gradients are
  averaged by all-reduce over the data-parallel group (dense weights) and the expert
  data-parallel group (experts), as Megatron's DDP does; no distributed optimizer;
- only TP = PP = CP = 1 (EP x ETP any divisor of the world: the parallel state is built with
  the recipe's expert model and expert tensor parallel sizes, expert DP = world / (EP x ETP));
- weights are Megatron's CPU initialisation; each MoE layer's experts come from generators of
  their own per (seed, layer, EP rank), as under pretrain_gpt.py (megatron_patches.expert_init),
  so runs with the balancer on and off start from the same model and EP ranks do not share
  expert weights, as they would on the one global CPU generator.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import sys
import time

from .common import counting_batch, quiet_libraries


def _lr(args, step: int) -> float:
    warm = args.lr_warmup_iters or 0
    if step < warm:
        return args.lr * (step + 1) / warm
    span = max(1, args.train_iters - warm)
    frac = min(1.0, (step - warm) / span)
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * frac))


def _padded_vocab(args) -> int:
    multiple = args.make_vocab_size_divisible_by * args.tensor_model_parallel_size
    return int(math.ceil(args.vocab_size / multiple) * multiple)


def build_model(args, config):
    """GPTModel on the host with Megatron's decoder block spec (local modules; dense and MoE
    layers as --moe-layer-freq says) and the recipe's hybrid_ep options, balancer included."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    import megatron_patches.options as options

    for name in ("gradient_accumulation_fusion", "bias_activation_fusion", "masked_softmax_fusion",
                 "persist_layer_norm", "bias_dropout_fusion", "apply_rope_fusion"):
        if hasattr(config, name):
            setattr(config, name, False)
    config.use_cpu_initialization = True
    config.hybrid_ep_options = options.from_args(args)
    if args.num_experts:  # as pretrain_gpt.py's model provider: the block spec reads the layer pattern
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=args.normalization,
                                          qk_l2_norm=getattr(args, "qk_l2_norm", False))
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm, normalization=args.normalization,
                                        multi_latent_attention=args.multi_latent_attention)
    return GPTModel(config, spec, vocab_size=_padded_vocab(args), max_sequence_length=args.max_position_embeddings,
                    position_embedding_type=args.position_embedding_type,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)


def layer_kinds(model) -> str:
    """'layers 1-2 dense, 3-4 MoE': what each decoder layer's MLP is, in runs."""
    from megatron.core.transformer.moe.moe_layer import BaseMoELayer

    kinds = ["MoE" if isinstance(layer.mlp, BaseMoELayer) else "dense" for layer in model.decoder.layers]
    runs, start = [], 0
    for i in range(1, len(kinds) + 1):
        if i == len(kinds) or kinds[i] != kinds[start]:
            span = f"{start + 1}" if i - start == 1 else f"{start + 1}-{i}"
            runs.append(f"{span} {kinds[start]}")
            start = i
    return "layers " + ", ".join(runs)


def _show_balancer_log() -> None:
    """The balancer's log lines (one per rebalance, from its reporting rank) on stdout, as
    Megatron-LM's logging shows them."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    for name in ("hybrid_ep.balancer", "megatron_patches.balancer"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        logger.addHandler(handler)
        logger.propagate = False


def attach_balancer(model, optimizer, hybrid):
    """The expert balancer over the model's balanced MoE layers, wrapping `optimizer.step`
    (None when the model has none). Checked: the step the loop calls is the wrapped one."""
    from megatron_patches import balancer as mbalancer

    _show_balancer_log()
    balancer = mbalancer.attach(model, optimizer, options=hybrid, start_iteration=0, writers=[])
    if balancer is not None and getattr(optimizer, "hybrid_ep_balancer", None) is not balancer:
        raise RuntimeError("cpu_train: the expert balancer did not wrap the optimizer's step")
    return balancer


def describe_balancer(balancer) -> str:
    """One line: interval, slots, tolerance, move budget and report folder the balancer runs with."""
    from hybrid_ep.balancer.knobs import DEFAULT_TOLERANCE
    from hybrid_ep.wording import plural

    tolerance = DEFAULT_TOLERANCE if balancer.tolerance is None else balancer.tolerance
    budget = "no move budget" if balancer.move_budget is None else \
        f"move budget {balancer.move_budget:g} of a layer's slots"
    report = balancer.report_dir or "none (balancer.report_dir)"
    return (f"expert balancer every {plural(balancer.interval, 'step')}, {balancer.slots_per_rank} slots per rank "
            f"({balancer.num_slots} slots for {plural(balancer.num_experts, 'expert')}) on "
            f"{plural(len(balancer.layers), 'MoE layer')}, tolerance {tolerance:g}, {budget}, "
            f"report folder {report}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    quiet_libraries()
    import torch
    import torch.distributed as dist

    import megatron_patches
    from hybrid_ep.wording import plural

    from ..slurm.megatron_parse import parse

    megatron_patches.apply(cpu_compat=True)  # this trainer runs Megatron-Core on the CPU
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    with contextlib.redirect_stdout(io.StringIO()):  # validate_args prints every argument
        args, config = parse(argv, world, rank)
    for flag, value in (("parallelism.tp", args.tensor_model_parallel_size),
                        ("parallelism.pp", args.pipeline_model_parallel_size),
                        ("parallelism.cp", args.context_parallel_size)):
        if value != 1:
            print(f"cpu_train: {flag} must be 1 in the CPU trainer, got {value}", file=sys.stderr)
            return 2
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(expert_model_parallel_size=args.expert_model_parallel_size,
                                             expert_tensor_parallel_size=args.expert_tensor_parallel_size)
    model_parallel_cuda_manual_seed(args.seed)
    torch.manual_seed(args.seed)
    model = build_model(args, config)
    hybrid = config.hybrid_ep_options
    dp = parallel_state.get_data_parallel_world_size()
    dp_group = parallel_state.get_data_parallel_group()
    edp_group = parallel_state.get_expert_data_parallel_group()
    micro_batches = args.global_batch_size // (args.micro_batch_size * dp)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    # as pretrain_gpt.py's setup_model_and_optimizer hook: attach once the optimizer exists;
    # the loop's opt.step() is then the balancer's (replica sum, step, every K: rebalance)
    balancer = attach_balancer(model, opt, hybrid) if hybrid.balancer_enabled else None
    seq, mbs, vocab = args.seq_length, args.micro_batch_size, args.vocab_size
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    position_ids = torch.arange(seq)[None].expand(mbs, -1)
    if rank == 0:
        print(f"cpu_train: GPTModel {plural(args.num_layers, 'layer')}, hidden {args.hidden_size}, "
              f"{plural(args.num_experts, 'expert')} top-{args.moe_router_topk}, dispatcher "
              f"{args.moe_token_dispatcher_type}, world {world} (DP {dp}; experts: EP "
              f"{parallel_state.get_expert_model_parallel_world_size()} x ETP "
              f"{parallel_state.get_expert_tensor_parallel_world_size()} x EDP "
              f"{parallel_state.get_expert_data_parallel_world_size()}), "
              f"{micro_batches} micro-batch{'' if micro_batches == 1 else 'es'} of {mbs} x {seq} per rank per step",
              flush=True)
        print(f"cpu_train: {layer_kinds(model)}", flush=True)
        if balancer is not None:
            print(f"cpu_train: {describe_balancer(balancer)}", flush=True)
        elif hybrid.balancer_enabled:
            print(f"cpu_train: balancer.interval {hybrid.balancer_interval} but no MoE layer was built with "
                  "expert slots (the balancer runs inside the hybrid_ep dispatcher): it does not run", flush=True)
    losses = []
    for step in range(args.train_iters):
        t0 = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = _lr(args, step)
        opt.zero_grad(set_to_none=True)
        total = torch.zeros((), dtype=torch.float64)
        for micro in range(micro_batches):
            batch = counting_batch(step, rank, mbs, seq, vocab, args.seed, micro)
            tokens, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
            loss = model(tokens, position_ids, mask, labels=labels).float().mean() / micro_batches
            loss.backward()
            total += loss.detach().double()
        for p in model.parameters():
            if p.grad is None:
                continue
            expert = not getattr(p, "allreduce", True)
            group = edp_group if expert else dp_group
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(dp)
        opt.step()
        dist.all_reduce(total)
        mean = total.item() / world
        losses.append(mean)
        if rank == 0 and (step + 1) % max(1, args.log_interval) == 0:
            tok_s = world * micro_batches * mbs * seq / (time.perf_counter() - t0)
            print(f"cpu_train: step {step + 1:4d}/{args.train_iters}  loss {mean:.6f}  "
                  f"lr {_lr(args, step):.2e}  {tok_s:8.0f} tok/s", flush=True)
    dist.destroy_process_group()
    finite = all(math.isfinite(v) for v in losses)
    if rank == 0:
        print(f"cpu_train: done, {plural(len(losses), 'step')}, loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
        if balancer is not None:
            applied = [e for e in balancer.events if e["applied"]]
            print(f"cpu_train: expert balancer: {plural(len(balancer.events), 'rebalance')}, {len(applied)} applied, "
                  f"{plural(sum(e['slots_changed'] for e in applied), 'slot')} changed"
                  + (f"; report in {balancer.report_dir}" if balancer.report_dir else ""), flush=True)
    return 0 if finite else 1


if __name__ == "__main__":
    sys.exit(main())
