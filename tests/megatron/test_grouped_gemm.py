"""The grouped-GEMM zero-token fix on CPU (torch._grouped_mm runs on CPU in torch >= 2.9).

A grouped expert forward/backward through the fixed path must equal a per-expert loop, give
experts without tokens weight gradients that are exactly zero, and never let the rows past
the last group (filled with NaN here, as recycled memory can be) leak into anything.
"""

from __future__ import annotations

import re
import types

import pytest
import torch
import torch.nn.functional as F

from megatron_patches import grouped_gemm as gg

pytestmark = pytest.mark.megatron

H, FFN = 16, 24  # multiples of 4 fp32 elements: torch._grouped_mm needs 16-byte strides


def _random_splits(gen: torch.Generator, num_groups: int) -> list[int]:
    counts = torch.randint(1, 9, (num_groups,), generator=gen)
    counts[torch.rand(num_groups, generator=gen) < 0.4] = 0
    return counts.tolist()


def _splits():
    gen = torch.Generator().manual_seed(0)
    fixed = [
        [0, 5, 3, 2], [4, 3, 0, 0], [3, 0, 0, 6], [0, 0, 0, 0], [0], [7], [0, 0, 9, 0],
        [1, 0, 1, 0, 1, 0, 1], [0, 0, 0, 0, 0, 0, 0, 13],
    ]
    randoms = [_random_splits(gen, int(torch.randint(1, 9, (1,), generator=gen))) for _ in range(50)]
    return fixed + randoms


SPLITS = _splits()


def grouped_mlp(x, counts, probs, w1, w2, align=None):
    """Expert MLP through the fixed path: grouped fc1, silu * prob, grouped fc2."""
    h = gg.grouped_mm(x, w1, counts, align)
    return gg.grouped_mm(F.silu(h) * probs[:, None], w2, counts, align)


def loop_mlp(x, counts, probs, w1, w2):
    """The same expert MLP, one expert at a time; rows past the last group are 0."""
    outs, start = [], 0
    for g, n in enumerate(counts):
        xs, ps = x[start:start + n], probs[start:start + n]
        outs.append((F.silu(xs @ w1[g]) * ps[:, None]) @ w2[g])
        start += n
    tail = x.new_zeros(x.shape[0] - start, w2.shape[2])
    return torch.cat(outs + [tail])


def _inputs(counts, extra_rows, seed):
    gen = torch.Generator().manual_seed(seed)
    G, n = len(counts), sum(counts)
    x = torch.randn(n + extra_rows, H, generator=gen)
    probs = torch.rand(n + extra_rows, generator=gen)
    x[n:] = float("nan")  # garbage past the last group must not leak
    probs[n:] = float("nan")
    w1 = torch.randn(G, H, FFN, generator=gen) / H**0.5
    w2 = torch.randn(G, FFN, H, generator=gen) / FFN**0.5
    grad = torch.randn(n + extra_rows, H, generator=gen)
    return x, probs, w1, w2, grad


def _run(fn, x, counts, probs, w1, w2, grad):
    leaves = [t.clone().requires_grad_(True) for t in (x, probs, w1, w2)]
    y = fn(leaves[0], counts, leaves[1], leaves[2], leaves[3])
    (y * grad).sum().backward()
    return y.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("counts", SPLITS, ids=[str(c) for c in SPLITS])
def test_grouped_mlp_matches_loop(counts):
    extra = (sum(counts) + len(counts)) % 3  # 0, 1 or 2 rows past the last group
    x, probs, w1, w2, grad = _inputs(counts, extra, seed=len(counts) * 100 + sum(counts))
    n = sum(counts)
    want_y, want_g = _run(loop_mlp, x, counts, probs, w1, w2, grad)
    got_y, got_g = _run(grouped_mlp, x, counts, probs, w1, w2, grad)

    assert bool(torch.isfinite(got_y).all()) and bool((got_y[n:] == 0).all())
    torch.testing.assert_close(got_y, want_y, rtol=1e-5, atol=1e-6)
    for name, got, want in zip(("x", "probs", "w1", "w2"), got_g, want_g):
        assert got is not None and bool(torch.isfinite(got).all()), f"grad {name} not finite"
        if name in ("x", "probs"):
            assert bool((got[n:] == 0).all()), f"grad {name}: rows past the last group must be 0"
            torch.testing.assert_close(got[:n], want[:n], rtol=1e-5, atol=1e-6, msg=f"grad {name}")
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"grad {name}")
    for g, c in enumerate(counts):
        if c == 0:  # exact zeros, not approximately
            assert bool((got_g[2][g] == 0).all()) and bool((got_g[3][g] == 0).all()), f"expert {g}"
        else:
            assert float(got_g[2][g].abs().sum()) > 0 and float(got_g[3][g].abs().sum()) > 0


@pytest.mark.parametrize("align", [1, 8, 16, 32])
def test_alignment_padding_does_not_change_results(align):
    counts = [0, 3, 0, 17, 1, 0]
    x, probs, w1, w2, grad = _inputs(counts, 2, seed=align)
    want_y, want_g = _run(loop_mlp, x, counts, probs, w1, w2, grad)
    got_y, got_g = _run(lambda *a: grouped_mlp(*a, align=align), x, counts, probs, w1, w2, grad)
    torch.testing.assert_close(got_y, want_y, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_g[2], want_g[2], rtol=1e-5, atol=1e-6)
    assert bool((got_g[2][[0, 2, 5]] == 0).all()) and bool((got_g[3][[0, 2, 5]] == 0).all())


def test_bf16_grouped_mm_zero_groups():
    counts = [0, 9, 0, 4]
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(15, 32, generator=gen).bfloat16()
    x[13:] = float("nan")
    w = (torch.randn(4, 32, 16, generator=gen) / 6).bfloat16().requires_grad_(True)
    y = gg.grouped_mm(x, w, counts)
    (y.float() * torch.randn(15, 16, generator=gen)).sum().backward()
    assert bool((y[13:] == 0).all()) and bool(torch.isfinite(y.float()).all())
    assert bool((w.grad[0] == 0).all()) and bool((w.grad[2] == 0).all())
    ref = torch.cat([x[:9].float() @ w[1].float(), x[9:13].float() @ w[3].float()])
    torch.testing.assert_close(y[:13].float(), ref, rtol=2e-2, atol=2e-2)


def test_plan_groups():
    groups = gg.plan_groups([0, 3, 0, 9], 14, 8, 8)
    assert groups.kernel_counts == (8, 8, 8, 16)
    assert groups.kernel_pos.tolist() == [8, 9, 10] + list(range(24, 33))
    assert gg.plan_groups([8, 16], 24, 8, 8).identity
    assert not gg.plan_groups([8, 16], 25, 8, 8).identity  # a row past the last group
    assert gg.plan_groups([3, 5], 8, 1, 1).identity
    x = torch.arange(14.0)[:, None]
    back = gg.from_kernel_rows(gg.to_kernel_rows(x, groups), groups)
    assert back[:12, 0].tolist() == list(range(12)) and back[12:].eq(0).all()
    with pytest.raises(ValueError, match="sums to 13"):
        gg.plan_groups([4, 9], 12, 1)


def test_alignment_table_and_config():
    assert gg.ALIGNMENT_ROWS == {"bf16": 8, "fp8": 16, "mxfp8": 32}
    cfg = types.SimpleNamespace
    assert gg.alignment_for_config(cfg(fp8=None, fp4=None)) == 8
    assert gg.alignment_for_config(cfg(fp8="e4m3", fp8_recipe="tensorwise")) == 16
    assert gg.alignment_for_config(cfg(fp8="hybrid", fp8_recipe="delayed")) == 16
    assert gg.alignment_for_config(cfg(fp8="e4m3", fp8_recipe="mxfp8")) == 32
    assert gg.alignment_for_config(cfg(fp8="e4m3", fp8_recipe="mxfp8", use_transformer_engine_op_fuser=True)) == 256


@pytest.mark.parametrize("dtype, K, N, needle", [
    (torch.bfloat16, 12, 16, "K=12 (input features) must be a multiple of 8"),
    (torch.bfloat16, 16, 12, "N=12 (output features) must be a multiple of 8"),
    (torch.float32, 6, 16, "K=6 (input features) must be a multiple of 4"),
])
def test_grouped_mm_refuses_unaligned_features_by_name(dtype, K, N, needle):
    """torch._grouped_mm needs 16-byte strides; refused before the call, naming the size
    and the multiple for the dtype (not torch's bare "strides should be multiple of 16 bytes")."""
    x, w = torch.randn(8, K, dtype=dtype), torch.randn(2, K, N, dtype=dtype)
    with pytest.raises(ValueError, match=re.escape(needle)):
        gg.grouped_mm(x, w, [3, 5])


def test_grouped_mm_transposed_weights_need_only_k_aligned():
    """A transposed w (TorchGroupedLinear's layout) has row stride K, so N=12 in bf16 runs."""
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    w = torch.randn(2, 12, 16, dtype=torch.bfloat16).transpose(1, 2)
    y = gg.grouped_mm(x, w, [3, 5])
    want = torch.cat([x[:3].float() @ w[0].float(), x[3:].float() @ w[1].float()])
    torch.testing.assert_close(y.float(), want, rtol=2e-2, atol=5e-2)


# -- Megatron-Core ---------------------------------------------------------------------------

megatron = pytest.importorskip("megatron.core")


def test_alignment_for_megatron_config():
    from megatron.core.enums import Fp8Recipe

    cfg = types.SimpleNamespace(fp8="e4m3", fp8_recipe=Fp8Recipe.mxfp8, fp4=None)
    assert gg.alignment_for_config(cfg) == 32
    cfg.fp8_recipe = Fp8Recipe.blockwise
    assert gg.alignment_for_config(cfg) == 16


def _quantized(**fields):
    """A validated TransformerConfig with quantization fields set after validation (fp8/fp4
    validation needs Transformer Engine)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=1, num_moe_experts=4,
                               moe_router_topk=2, ffn_hidden_size=FFN, moe_ffn_hidden_size=FFN,
                               use_cpu_initialization=True)
    for name, value in fields.items():
        setattr(config, name, value)
    return config


def _quantized_cases():
    from megatron.core.enums import Fp4Recipe, Fp8Recipe

    cases = [dict(fp8="e4m3", fp8_recipe=r) for r in Fp8Recipe if r is not Fp8Recipe.custom]
    cases += [dict(fp4="e2m1", fp4_recipe=Fp4Recipe.nvfp4)]
    cases += [dict(c, use_transformer_engine_op_fuser=True) for c in (cases[0], cases[-1])]
    return cases


@pytest.mark.parametrize("fields", _quantized_cases(),
                         ids=lambda f: "-".join(str(getattr(v, "value", v)) for v in f.values()))
def test_alignment_is_megatrons_for_quantized_recipes(fields):
    """The rows an empty group gets equal the alignment Megatron pads every other group to
    (fp4 is 128 in Megatron-Core 0.19, not the 32 of 16 bytes of 4-bit values)."""
    from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization

    config = _quantized(**fields)
    assert gg.alignment_for_config(config) == get_align_size_for_quantization(config)
    if fields.get("fp4") and not fields.get("use_transformer_engine_op_fuser"):
        assert gg.alignment_for_config(config) == 128


def test_fp4_empty_group_gets_megatrons_alignment():
    """The zero-token wrapper keeps an fp4 batch 128-aligned: an empty group gets 128 rows."""
    seen = {}

    def forward(self, hidden, tokens_per_expert, probs):
        seen["counts"] = tokens_per_expert.tolist()
        return hidden, None

    me = types.SimpleNamespace(config=_quantized(fp4="e2m1"), _with_fused_impl=False)
    gg.zero_token_safe(forward)(me, torch.zeros(384, 4), torch.tensor([128, 0, 256]), torch.zeros(384))
    assert seen["counts"] == [128, 128, 256]


def test_alignment_fallback_without_megatrons_function(monkeypatch):
    monkeypatch.setattr(gg, "_megatron_alignment", lambda config: None)
    assert gg.alignment_for_config(types.SimpleNamespace(fp4="e2m1")) == gg.FP4_ALIGNMENT_ROWS == 128
    assert gg.alignment_for_config(types.SimpleNamespace(fp8="e4m3", fp8_recipe="mxfp8")) == 32
    assert gg.alignment_for_config(types.SimpleNamespace(use_transformer_engine_op_fuser=True)) == 256


def test_torch_grouped_linear_names_the_unaligned_config_size(single_rank_group):
    """bf16 TEGroupedMLP on TorchGroupedLinear with moe_ffn_hidden_size=12: fc2's input rows are
    24 bytes, refused naming the config field and the multiple, before torch._grouped_mm."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.experts import TEGroupedMLP
    from megatron.core.transformer.transformer_config import TransformerConfig

    gg.install()
    config = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=1, num_moe_experts=2, moe_ffn_hidden_size=12,
        ffn_hidden_size=12, moe_grouped_gemm=True, use_cpu_initialization=True, add_bias_linear=False,
        bf16=True, params_dtype=torch.bfloat16,
    )
    pgs = ProcessGroupCollection(ep=single_rank_group, expt_tp=single_rank_group, expt_dp=single_rank_group)
    module = TEGroupedMLP(2, config, gg.torch_grouped_mlp_submodules(), pg_collection=pgs)
    x = torch.randn(8, H, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"multiples of 8 .* not a multiple of 8: moe_ffn_hidden_size=12$"):
        module(x, torch.tensor([3, 5]), torch.ones(8, dtype=torch.bfloat16))


def _experts(group, L, gated, bias):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.experts import TEGroupedMLP
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=1, num_moe_experts=L, moe_ffn_hidden_size=FFN,
        ffn_hidden_size=FFN, moe_grouped_gemm=True, use_cpu_initialization=True, gated_linear_unit=gated,
        activation_func=F.silu if gated else F.gelu, add_bias_linear=bias, bias_dropout_fusion=False,
        params_dtype=torch.float32,
    )
    pgs = ProcessGroupCollection(ep=group, expt_tp=group, expt_dp=group)
    torch.manual_seed(1)
    return TEGroupedMLP(L, config, gg.torch_grouped_mlp_submodules(), pg_collection=pgs)


def _expert_loop(module, x, counts, probs):
    """Per-expert reference with detached copies of the module's weights."""
    cfg, L = module.config, module.num_local_experts
    params = {n: p.detach().clone().requires_grad_(True) for n, p in module.named_parameters()}
    outs, start = [], 0
    for j in range(L):
        xs, ps = x[start:start + counts[j]], probs[start:start + counts[j], None]
        h = xs @ params[f"linear_fc1.weight{j}"].t()
        if cfg.add_bias_linear:
            h = h + params[f"linear_fc1.bias{j}"]
        if cfg.gated_linear_unit:
            a, b = torch.chunk(h, 2, dim=-1)
            h = cfg.activation_func(a) * b
        else:
            h = cfg.activation_func(h)
        y = (h * ps) @ params[f"linear_fc2.weight{j}"].t()
        if cfg.add_bias_linear:
            y = y + params[f"linear_fc2.bias{j}"] * ps
        outs.append(y)
        start += counts[j]
    return torch.cat(outs + [x.new_zeros(x.shape[0] - start, H)]), params


@pytest.mark.parametrize("counts,extra,gated,bias", [
    ([0, 5, 3, 0], 0, True, False),
    ([4, 0, 0, 2], 3, False, True),
    ([0, 0, 0, 7], 1, True, True),
    ([0, 0, 0, 0], 0, False, False),  # a rank whose experts get no token at all
    ([0, 0, 0, 0], 2, True, False),
])
def test_megatron_grouped_experts_after_install(single_rank_group, counts, extra, gated, bias):
    assert "TEGroupedMLP" in gg.install()
    assert gg.install() == gg.install() and gg.is_installed()  # idempotent: wrapped once
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    assert not getattr(TEGroupedMLP.forward.__wrapped__, "__wrapped__", None)
    module = _experts(single_rank_group, len(counts), gated, bias)
    gen = torch.Generator().manual_seed(sum(counts) + extra)
    n = sum(counts)
    x = torch.randn(n + extra, H, generator=gen)
    probs = torch.rand(n + extra, generator=gen)
    x[n:], probs[n:] = float("nan"), float("nan")
    grad = torch.randn(n + extra, H, generator=gen)
    want, ref_params = _expert_loop(module, x, counts, probs)
    (want * grad).sum().backward()

    xg = x.clone().requires_grad_(True)
    out, _ = module(xg, torch.tensor(counts), probs)
    (out * grad).sum().backward()

    assert out.shape == (n + extra, H) and bool((out[n:] == 0).all())
    torch.testing.assert_close(out, want.detach(), rtol=1e-5, atol=1e-6)
    assert bool(torch.isfinite(xg.grad).all()) and bool((xg.grad[n:] == 0).all())
    for name, p in module.named_parameters():
        j = int(re.search(r"(\d+)$", name).group(1))
        assert p.grad is not None, f"{name}: the expert linears must run even without tokens"
        if counts[j] == 0:
            assert bool((p.grad == 0).all()), f"{name}: expert {j} got no token, its gradient must be 0"
        else:
            torch.testing.assert_close(p.grad, ref_params[name].grad, rtol=1e-5, atol=1e-6, msg=name)


def test_wrapper_keeps_empty_groups_from_the_kernel():
    """What the wrapped forward hands on: no empty group, nothing past the last group."""
    seen = {}

    class Experts:
        config = types.SimpleNamespace(fp8="e4m3", fp8_recipe="tensorwise")

        def forward(self, hidden, tokens_per_expert, probs):
            seen.update(hidden=hidden, counts=tokens_per_expert.tolist(), probs=probs)
            return hidden * 2, None

    Experts.forward = gg.zero_token_safe(Experts.forward)
    x = torch.arange(1.0, 8.0)[:, None].repeat(1, 4)
    x[6] = float("nan")
    out, _ = Experts().forward(x, torch.tensor([0, 4, 0, 2]), torch.ones(7))
    assert seen["counts"] == [16, 4, 16, 2]  # fp8: empty groups get 16 rows, the others stay
    assert seen["hidden"].shape[0] == 38 and bool(torch.isfinite(seen["hidden"]).all())
    assert seen["hidden"][:16].eq(0).all() and seen["hidden"][16:20].equal(x[:4])
    assert seen["probs"][:16].eq(0).all() and seen["probs"][16:20].eq(1).all()
    assert out[:6].equal(x[:6] * 2) and out[6].eq(0).all()

    seen.clear()
    aligned = torch.randn(32, 4)
    out, _ = Experts().forward(aligned, torch.tensor([16, 16]), torch.ones(32))
    assert seen["hidden"] is aligned and out.equal(aligned * 2)  # padded by the dispatcher: no copy
