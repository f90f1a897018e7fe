"""The initial model does not depend on the balancer's slot count (megatron_patches.expert_init):
Megatron's GPTModel built from its decoder block spec, after Megatron-LM's own seeding, has
the same expert weights in its first E / EP slots, and the same other weights, with spare slots,
without them, and under Megatron's alltoall dispatcher; on both of Megatron's init paths (the
RNG tracker's expert-parallel stream, and the CPU generator of --use-cpu-initialization)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.megatron

W = 2  # EP ranks
EXPERTS = 4
LAYERS = 3


def _initial_weights(dispatcher: str, slots_per_rank: int | None, cpu_init: bool) -> dict:
    """One EP rank's GPTModel as Megatron builds it: {"experts": [per MoE layer, its first E / EP
    slots' (fc1, fc2)], "other": every other parameter by name}."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.training.initialize import _set_random_seed

    from megatron_patches import HybridEPOptions
    from megatron_patches.local.common import PLAIN_FP32_CONFIG, init_megatron

    init_megatron(W)
    _set_random_seed(1234)  # Megatron-LM's initialisation: torch.manual_seed(seed + 100 x PP rank)
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, moe_ffn_hidden_size=16,
        num_moe_experts=EXPERTS, moe_router_topk=2, moe_token_dispatcher_type=dispatcher,
        expert_model_parallel_size=W, **dict(PLAIN_FP32_CONFIG, use_cpu_initialization=cpu_init),
        masked_softmax_fusion=False, bias_dropout_fusion=False, persist_layer_norm=False)
    if dispatcher == "hybrid_ep":
        config.hybrid_ep_options = HybridEPOptions(balancer_interval=5 if slots_per_rank else 0,
                                                   balancer_slots_per_rank=slots_per_rank)
    model = GPTModel(config, get_gpt_decoder_block_spec(config, use_transformer_engine=False), vocab_size=64,
                     max_sequence_length=8)
    experts = []
    for layer in model.decoder.layers:
        local = layer.mlp.experts.local_experts[:EXPERTS // W]
        experts.append([(e.linear_fc1.weight.detach().clone(), e.linear_fc2.weight.detach().clone()) for e in local])
    other = {name: p.detach().clone() for name, p in model.named_parameters() if ".experts." not in name}
    return {"experts": experts, "other": other}


def _same(a: dict, b: dict) -> list[str]:
    """Where two ranks' initial weights differ."""
    diffs = [f"layer {i + 1} slot {j}" for i, (la, lb) in enumerate(zip(a["experts"], b["experts"]))
             for j, (ea, eb) in enumerate(zip(la, lb)) if not all(torch.equal(x, y) for x, y in zip(ea, eb))]
    assert a["other"].keys() == b["other"].keys()
    return diffs + [name for name in a["other"] if not torch.equal(a["other"][name], b["other"][name])]


@pytest.mark.parametrize("cpu_init", [False, True], ids=["rng_tracker", "cpu_initialization"])
def test_spare_slots_do_not_change_the_initial_model(pool_for, cpu_init):
    pytest.importorskip("megatron.training.initialize")
    pool = pool_for(W)
    runs = {key: pool.run(_initial_weights, [(*key, cpu_init)] * W, timeout_s=600)
            for key in (("hybrid_ep", None), ("hybrid_ep", EXPERTS // W + 1), ("hybrid_ep", EXPERTS // W + 2),
                        ("alltoall", None))}
    plain = runs["hybrid_ep", None]
    for key, run in runs.items():
        for rank in range(W):
            assert _same(plain[rank], run[rank]) == [], (key, rank)
    # each EP rank and each layer has experts of its own
    first = [plain[r]["experts"][i][0][0] for r in range(W) for i in range(LAYERS)]
    assert all(not torch.equal(x, y) for k, x in enumerate(first) for y in first[k + 1:])


def test_derived_seeds_differ_by_every_part():
    from megatron_patches.expert_init import derived_seed

    seeds = {derived_seed(base, layer, ep) for base in (1, 2) for layer in (1, 2, 3) for ep in (0, 1)}
    assert len(seeds) == 12 and all(0 <= s < 2 ** 63 for s in seeds)
    assert derived_seed(1234, 1, 0) == derived_seed(1234, 1, 0) != derived_seed(1234, 1, 1, 0)
