"""megatron_patches.expert_out on Megatron's TEGroupedMLP: where the in-place path is installed
(install_reason), a TEGroupedMLP on the Transformer-Engine-like grouped linear writing its
output into the view, except where zero_token_safe runs it on padded kernel rows, and on TE's
op fuser (TE stood in) through Megatron's output_buffer. The layer on
the cuda backend, end to end: tests/megatron/test_dispatcher.py."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core")

from harness.megatron import te_stand_in  # noqa: E402
from megatron_patches import grouped_gemm as gg  # noqa: E402
from megatron_patches.expert_out import ExpertOutInPlace, install_reason  # noqa: E402
from megatron_patches.options import HybridEPOptions  # noqa: E402

pytestmark = pytest.mark.megatron

H, FFN, L = 16, 24, 2


def _config(**fields):
    from megatron.core.transformer.transformer_config import TransformerConfig

    values = dict(num_layers=1, hidden_size=H, num_attention_heads=1, num_moe_experts=L, moe_ffn_hidden_size=FFN,
                  ffn_hidden_size=FFN, moe_grouped_gemm=True, use_cpu_initialization=True, add_bias_linear=False,
                  activation_func=F.gelu, bias_dropout_fusion=False, params_dtype=torch.float32)
    values.update(fields)
    return TransformerConfig(**values)


def _experts(group, linears: str = "te_like", **fields):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    from harness.megatron.te_like import te_like_grouped_mlp_submodules

    submodules = te_like_grouped_mlp_submodules() if linears == "te_like" else gg.torch_grouped_mlp_submodules()
    pgs = ProcessGroupCollection(ep=group, expt_tp=group, expt_dp=group)
    torch.manual_seed(1)
    return TEGroupedMLP(L, _config(**fields), submodules, pg_collection=pgs)


def test_where_the_in_place_path_is_installed(single_rank_group):
    """Only on a TEGroupedMLP whose fc2 allocates its output with torch.empty, takes rows of
    another width than it returns and adds no bias, outside the EP-overlap schedule and the op
    fuser, with the option on; each refusal says why."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    on = HybridEPOptions()
    te_like = _experts(single_rank_group)
    assert install_reason(te_like, te_like.config, on) is None
    assert install_reason(te_like, te_like.config, HybridEPOptions(expert_out_in_place=False)) == \
        "turned off (--no-hybrid-ep-expert-out-in-place)"
    assert install_reason(None, te_like.config, on) == "experts not built yet"
    sequential = object.__new__(SequentialMLP)
    assert install_reason(sequential, te_like.config, on) == "SequentialMLP: its output is not one projection's"
    grouped = _experts(single_rank_group, "grouped")
    assert install_reason(grouped, grouped.config, on) == "TorchGroupedLinear allocates its output outside Python"
    square = _experts(single_rank_group, moe_ffn_hidden_size=H, ffn_hidden_size=H)
    assert install_reason(square, square.config, on) == f"fc2 takes rows of its output's width ({H})"
    overlap = dataclasses.replace(te_like.config)
    overlap.overlap_moe_expert_parallel_comm = True  # set after validation (it needs bf16 and EP > 1)
    assert install_reason(te_like, overlap, on).startswith("the EP-overlap schedule runs other calls")
    biased = types.SimpleNamespace(**vars(te_like.config))
    biased.add_bias_linear = True
    assert install_reason(te_like, biased, on) == "fc2's bias is added into a new tensor"
    te_like._with_fused_impl = True  # Megatron's experts module without TE: no output buffer key
    assert install_reason(te_like, te_like.config, on) == \
        "Transformer Engine's op fuser takes an output buffer from TE 2.18 on"


def _op_fuser_experts(group, **fields):
    """TEGroupedMLP on Transformer Engine's op fuser (its _fused_forward), TE stood in, with the
    config a hybrid_ep layer runs with (Megatron's flex dispatcher with hybrid_ep's backend: the
    experts skip their padding copy, the dispatcher aligned the rows)."""
    from megatron.core.activations import squared_relu
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    from megatron_patches.selection import HYBRID_EP_BACKEND

    config = _config(use_transformer_engine_op_fuser=True, activation_func=squared_relu,
                     use_fused_weighted_squared_relu=True)
    fields = dict(moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend=HYBRID_EP_BACKEND, **fields)
    for name, value in fields.items():
        setattr(config, name, value)
    pgs = ProcessGroupCollection(ep=group, expt_tp=group, expt_dp=group)
    torch.manual_seed(1)
    return TEGroupedMLP(L, config, te_stand_in.grouped_mlp_submodules(), pg_collection=pgs)


def test_on_the_op_fuser_the_output_goes_through_megatrons_output_buffer(single_rank_group):
    """On TE's op fuser the view reaches fc2 as Megatron's output_buffer (TEGroupedMLP._fused_forward
    hands it to TE, which checks it): the output is the view, equal to the output TE allocates
    itself; the combine takes it. Nothing is installed on fc2 (no hooks, no torch.empty mode),
    and the fp8 input hand-off serves the same experts (the two no longer exclude each other)."""
    from megatron_patches import te_grouped_rows

    rows = 8
    with te_stand_in.installed():
        experts = _op_fuser_experts(single_rank_group)
        assert install_reason(experts, experts.config, HybridEPOptions()) is None
        mxfp8 = dataclasses.replace(experts.config)
        mxfp8.fp8, mxfp8.fp8_recipe, mxfp8.params_dtype = "e4m3", "mxfp8", torch.bfloat16
        assert te_grouped_rows.handoff_reason(experts, mxfp8, 256, te_grouped_rows.te_api()) is None
        assert install_reason(experts, mxfp8, HybridEPOptions()) is None
        x, probs, tokens = torch.randn(rows, H, requires_grad=True), torch.rand(rows), torch.tensor([3, 5])
        want, _ = experts(x, tokens, probs)
        buf = _Buffer(rows)
        dispatcher = _Dispatcher(buf, rows)
        hook = ExpertOutInPlace(dispatcher, experts)
        assert not experts.linear_fc2._forward_pre_hooks and not experts.linear_fc2._forward_hooks
        view = hook.output_buffer()
        assert view is not None and not view.requires_grad and hook.views == 1
        got, _ = experts(x, tokens, probs, output_buffer=view)
        assert got.data_ptr() == buf.block.data_ptr()
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        hook.check_combine(got, buf)
        got.sum().backward()
        assert x.grad is not None and torch.isfinite(x.grad).all()
        # the receive path, or another call on the buffer since the dispatch: no buffer handed out
        dispatcher.handle.data_path = "receive"
        assert hook.output_buffer() is None
        dispatcher.handle.data_path, buf.last_call = "direct", object()
        assert hook.output_buffer() is None and hook.views == 1


class _Buffer:
    """A stand-in HybridEPBuffer whose expert-out block lies in peer memory."""

    def __init__(self, rows):
        self.block = torch.zeros(rows * H * 4, dtype=torch.uint8)
        self.config = types.SimpleNamespace(hidden_dim=H)
        self.device = torch.device("cpu")
        self.last_call = object()

    def expert_out_view(self, handle, columns=None, dtype=None):
        return self.block[:handle.num_rows * H * dtype.itemsize].view(dtype).view(handle.num_rows, H)

    def is_in_peer_memory(self, t):
        return self.block.data_ptr() <= t.data_ptr() < self.block.data_ptr() + self.block.numel()


class _Dispatcher:
    def __init__(self, buf, rows):
        self.handle = types.SimpleNamespace(num_rows=rows, data_path="direct")
        self._handle_buffer, self.last_dispatch_call = buf, buf.last_call


@pytest.mark.parametrize("counts, in_place", [([3, 5], True), ([8, 0], False), ([3, 4], False)],
                         ids=["every_row_in_a_group", "empty_group_padded", "row_past_the_groups"])
def test_te_grouped_mlp_writes_its_output_into_the_view(single_rank_group, counts, in_place):
    """TEGroupedMLP (zero_token_safe installed) on the TE-like linears: with every group non-empty
    and every row in one, fc2's output is the view and the values are those of the module
    without the hook; where zero_token_safe pads the groups its output is a new tensor, and no
    view is handed out in that forward."""
    gg.install()
    rows = 8
    experts = _experts(single_rank_group)
    x = torch.randn(rows, H, requires_grad=True)
    probs = torch.rand(rows)
    tokens = torch.tensor(counts)
    want, _ = experts(x, tokens, probs)
    buf = _Buffer(rows)
    dispatcher = _Dispatcher(buf, rows)  # the hooks keep only a weak reference, as to the layer's
    hook = ExpertOutInPlace(dispatcher, experts)
    got, _ = experts(x, tokens, probs)
    assert hook.views == (1 if in_place else 0)
    assert (got.data_ptr() == buf.block.data_ptr()) == in_place
    assert not getattr(experts, gg.KERNEL_ROWS, False)  # the wrapper's flag lasts only for its call
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    hook.check_combine(got, buf)
    got.sum().backward()  # the backward reads nothing of the output
    assert x.grad is not None and torch.isfinite(x.grad).all()
