"""Grouped-GEMM zero-token fix: experts without tokens get exact-zero weight gradients.

Why it is needed. Grouped GEMM kernels are fast because they run every expert's matmul in
one launch, but they misbehave when a group is empty or when rows lie past the last group:

- the weight-gradient GEMM of an empty group has a contraction length of 0; CUTLASS grouped
  kernels have hung on it (torch._grouped_mm in bf16), and on Blackwell it has returned
  non-zero gradients for zero-size groups;
- torch._grouped_mm allocates its output, and the input gradient inside autograd, without
  initialising it and writes only rows below offs[-1]; rows past it hold whatever the
  allocator recycled (NaN included) and poison anything that reads them, since 0 * NaN = NaN;
- Transformer Engine's grouped GEMM leaves the weight gradient of a group without inputs
  untouched instead of zeroing it (wrong with fused weight-gradient accumulation), and a rank
  whose experts get no token at all used to skip the expert linears, so its autograd graph
  differed from its peers' and the next collective hung.

The fix, at the two depths where it belongs:

1. A hybrid_ep buffer can give every local expert at least `align` rows, a multiple of
   `align` (HybridEPBuffer(min_rows_per_expert=align, pad_multiple=align)); the extra rows
   are zero with routing weight 0. Then no group is ever empty and nothing has to be copied.
   Megatron counts such rows against the expert capacity, so its hybrid_ep dispatcher pads
   only what the built experts need (megatron_patches.expert_rows) and leaves empty groups
   to the expert side.
2. At the expert, `install()` wraps Megatron-Core's grouped expert module (TEGroupedMLP):
   groups that are still empty get `align` zero rows with weight 0, and rows past
   the last group never reach the kernel and come back as exact zeros. The expert linears
   always run, on every rank. `TorchGroupedLinear` lets TEGroupedMLP run on torch._grouped_mm
   where Transformer Engine is not installed, through the same zero-safe `grouped_mm`.

Why a padded empty group gives exact zeros: its input rows are 0 and its output rows are
dropped, so their gradient is 0; dW = X^T dY sums products that each have a zero factor.

Legend: R rows (tokens routed to this rank's experts), G groups (local experts), K input
features, N output features, P rows handed to the kernel (R plus padding).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch

# Rows per group that grouped GEMM kernels need, by the precision of the expert GEMMs. The
# group boundaries lie on the token dimension, which is the contraction dimension of the
# weight-gradient GEMM (dW = X^T dY): TMA loads need 16-byte aligned offsets there, i.e.
# 8 rows of bf16/fp16 and 16 rows of fp8; MXFP8 shares one scale per 32 elements along the
# contraction dimension, so a scale block must not straddle two groups: 32 rows.
# For fp8, fp4 and the op fuser, Megatron's get_align_size_for_quantization decides (the
# dispatcher pads the other groups with it); these values are the fallback without it.
ALIGNMENT_ROWS = {"bf16": 8, "fp8": 16, "mxfp8": 32}
# FP4 (NVFP4 / MXFP4): 16 bytes are 32 four-bit values, but Megatron-Core 0.19 aligns fp4
# groups to 128 rows (its grouped NVFP4 quantization needs no host-side scale padding then).
FP4_ALIGNMENT_ROWS = 128
# Transformer Engine's fused grouped MLP (op fuser) requires 256-row groups.
OP_FUSER_ALIGNMENT_ROWS = 256

_PATCHED = "_hybrid_ep_zero_token_safe"
# Set on the experts module while zero_token_safe runs it on kernel rows (padded groups): its
# output then reaches the caller as a new tensor (from_kernel_rows), not as fc2's output, and
# megatron_patches.expert_out hands out no expert-out view in that forward.
KERNEL_ROWS = "_hybrid_ep_on_kernel_rows"


def _recipe_name(recipe) -> str:
    return str(getattr(recipe, "value", recipe) or "").lower()


class _FieldsOrNone:
    """A config whose missing fields read as None (Megatron's function reads them directly)."""

    def __init__(self, config):
        self._config = config

    def __getattr__(self, name):
        return getattr(self._config, name, None)


def _megatron_alignment(config) -> int | None:
    """Megatron-Core's own rows per group for quantized experts (0: no quantization), or None
    where the installed version (or no Megatron at all) lacks get_align_size_for_quantization."""
    try:
        from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization
    except ImportError:
        return None
    return int(get_align_size_for_quantization(_FieldsOrNone(config)))


def alignment_for_config(config) -> int:
    """Rows per expert group for a Megatron TransformerConfig (fields fp8, fp8_recipe, fp4,
    use_transformer_engine_op_fuser).

    The number of zero rows `install()` gives an empty group (and, for a hybrid_ep buffer
    used outside Megatron, the value for both min_rows_per_expert and pad_multiple). For
    quantized GEMMs and the op fuser it is Megatron's get_align_size_for_quantization, the
    size every other group is padded to, so an empty group never breaks the alignment.
    """
    quantized = getattr(config, "fp8", None) or getattr(config, "fp4", None)
    op_fuser = getattr(config, "use_transformer_engine_op_fuser", False)
    if quantized or op_fuser:
        megatron = _megatron_alignment(config)
        if megatron:
            return megatron
    if op_fuser:
        return OP_FUSER_ALIGNMENT_ROWS
    if getattr(config, "fp4", None):
        return FP4_ALIGNMENT_ROWS
    if getattr(config, "fp8", None):
        return ALIGNMENT_ROWS["mxfp8" if _recipe_name(getattr(config, "fp8_recipe", None)) == "mxfp8" else "fp8"]
    return ALIGNMENT_ROWS["bf16"]


# -- the zero-safe groups ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GemmGroups:
    """How R caller rows map onto the rows a grouped kernel sees (every group non-empty).

    Group g's n_g real rows (consecutive, in order) land at the start of a block of
    roundup(n_g, multiple) kernel rows, or roundup(empty_rows, multiple) when n_g = 0; the
    rest of the block is zero.
    Caller rows past sum(n) belong to no group: they are not given to the kernel and come
    back as zeros.
    """

    counts: tuple[int, ...]  # real rows per group
    kernel_counts: tuple[int, ...]  # rows per group the kernel sees
    num_rows: int  # R
    kernel_pos: torch.Tensor | None  # [sum(counts)] int64 kernel row of each real row; None: identity

    @property
    def identity(self) -> bool:
        return self.kernel_pos is None

    @property
    def num_real_rows(self) -> int:
        return sum(self.counts)


def plan_groups(counts, num_rows: int, empty_rows: int, multiple: int = 1,
                device: torch.device | str = "cpu") -> GemmGroups:
    """The kernel rows of groups of `counts` rows (list or tensor) within a tensor of num_rows rows."""
    counts = tuple(int(c) for c in (counts.tolist() if isinstance(counts, torch.Tensor) else counts))
    if any(c < 0 for c in counts):
        raise ValueError(f"tokens_per_expert must be >= 0, got {list(counts)}")
    if sum(counts) > num_rows:
        raise ValueError(f"tokens_per_expert sums to {sum(counts)} but there are only {num_rows} rows")
    if empty_rows < 1 or multiple < 1:
        raise ValueError(f"empty_rows and multiple must be >= 1, got {empty_rows} and {multiple}")
    kernel = tuple(math.ceil((c or empty_rows) / multiple) * multiple for c in counts)
    if kernel == counts and sum(counts) == num_rows:
        return GemmGroups(counts, kernel, num_rows, None)
    n = torch.tensor(counts, dtype=torch.int64, device=device)
    k = torch.tensor(kernel, dtype=torch.int64, device=device)
    group = torch.repeat_interleave(torch.arange(len(counts), device=device), n)
    shift = (k.cumsum(0) - k) - (n.cumsum(0) - n)  # kernel start - real start, per group
    pos = torch.arange(int(n.sum()), device=device) + shift[group]
    return GemmGroups(counts, kernel, num_rows, pos)


def to_kernel_rows(x: torch.Tensor, groups: GemmGroups) -> torch.Tensor:
    """[R, ...] caller rows -> [P, ...] kernel rows (padding zero). Differentiable."""
    if groups.identity:
        return x
    real = x[: groups.num_real_rows]
    out = x.new_zeros((sum(groups.kernel_counts),) + tuple(x.shape[1:]))
    return out.index_copy(0, groups.kernel_pos, real)


def from_kernel_rows(y: torch.Tensor, groups: GemmGroups) -> torch.Tensor:
    """[P, ...] kernel rows -> [R, ...] caller rows; rows past the last group are zero."""
    if groups.identity:
        return y
    real = y.index_select(0, groups.kernel_pos)
    tail = y.new_zeros((groups.num_rows - groups.num_real_rows,) + tuple(y.shape[1:]))
    return torch.cat([real, tail])


def default_alignment(dtype: torch.dtype) -> int:
    """Rows that make 16 bytes of one column: 8 for bf16, 4 for fp32, 16 for fp8."""
    return max(1, 16 // torch.empty((), dtype=dtype).element_size())


def _check_feature_strides(x_RK: torch.Tensor, w_GKN: torch.Tensor) -> None:
    """torch._grouped_mm needs 16-byte aligned strides (else its bare "strides should be
    multiple of 16 bytes"): K always (the row stride of x), and N where w is row-major (its
    row stride); a transposed w ([G, N, K] viewed as [G, K, N]) has row stride K."""
    multiple = default_alignment(x_RK.dtype)
    K, N = w_GKN.shape[1], w_GKN.shape[2]
    bad = [f"K={K} (input features)"] if K % multiple else []
    if w_GKN.stride(-1) == 1 and N % multiple:
        bad.append(f"N={N} (output features)")
    if bad:
        raise ValueError(
            f"grouped_mm in {x_RK.dtype}: torch._grouped_mm needs 16-byte aligned strides, so "
            f"{' and '.join(bad)} must be a multiple of {multiple}"
        )


def grouped_mm(x_RK: torch.Tensor, w_GKN: torch.Tensor, counts, align: int | None = None) -> torch.Tensor:
    """out[rows of group g] = x[rows of g] @ w[g], through torch._grouped_mm, zero-safe.

    counts: rows per group (host list or tensor; rows past their sum are ignored and their
    output rows are 0). Every group reaches the kernel with a multiple of `align` rows
    (default: 16 bytes of the dtype), an empty one with `align` zero rows, and nothing past
    the last group is passed on, so
    empty groups neither hang nor return garbage, and their weight gradients are exact zeros.
    """
    _check_feature_strides(x_RK, w_GKN)
    if align is None:
        align = default_alignment(x_RK.dtype)
    groups = plan_groups(counts, x_RK.shape[0], align, align, x_RK.device)
    if len(groups.counts) != w_GKN.shape[0]:
        raise ValueError(f"{len(groups.counts)} group sizes for {w_GKN.shape[0]} weight groups")
    offs = torch.tensor(groups.kernel_counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(x_RK.device)
    y = torch._grouped_mm(to_kernel_rows(x_RK, groups), w_GKN, offs=offs)
    return from_kernel_rows(y, groups)


# -- Megatron-Core: grouped linear on torch._grouped_mm -------------------------------------


class TorchGroupedLinear(torch.nn.Module):
    """G per-expert linears run as one torch._grouped_mm; a drop-in linear_fc1/linear_fc2.

    Same constructor and forward as Megatron's TE grouped linears (GroupedMLPSubmodules), and
    the same parameter names (weight0.., bias0.., each [out, in] / [out]), so TEGroupedMLP
    runs without Transformer Engine. Expert tensor parallelism, delayed weight gradients and
    distributed checkpoints are not supported and raise.

    Unlike Transformer Engine's GroupedLinear, its output is allocated inside torch._grouped_mm
    (C++), never by a torch.empty in Python, so megatron_patches.expert_out cannot place it in
    the combine's expert-out block (OUTPUT_FROM_TORCH_EMPTY); a subclass whose forward
    allocates its output with torch.empty([rows, out_features]) sets it True.
    """

    OUTPUT_FROM_TORCH_EMPTY = False

    def __init__(self, num_local_experts: int, input_size: int, output_size: int, *, config, init_method,
                 bias: bool, skip_bias_add: bool, is_expert: bool = True, tp_comm_buffer_name=None,
                 pg_collection=None, name=None, **_ignored):
        super().__init__()
        tp = getattr(pg_collection, "expt_tp", None) if pg_collection is not None else None
        if getattr(config, "expert_tensor_parallel_size", 1) not in (None, 1) or (tp is not None and tp.size() > 1):
            raise ValueError("TorchGroupedLinear supports expert_tensor_parallel_size=1 only")
        if getattr(config, "delay_wgrad_compute", False):
            raise ValueError("TorchGroupedLinear does not support delay_wgrad_compute")
        self.config = config
        self.num_gemms = num_local_experts
        self.skip_bias_add = skip_bias_add
        self.use_bias = bias
        on_gpu = torch.cuda.is_available() and not getattr(config, "use_cpu_initialization", False)
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        dtype = getattr(config, "params_dtype", torch.float32)
        # Expert weights are reduced over the expert data-parallel group, not all of DP.
        allreduce = not (is_expert and getattr(config, "expert_model_parallel_size", 1) > 1)
        for i in range(num_local_experts):
            w = torch.nn.Parameter(torch.empty(output_size, input_size, device=device, dtype=dtype))
            if getattr(config, "perform_initialization", True):
                with torch.no_grad():
                    init_method(w)
            w.allreduce = allreduce
            self.register_parameter(f"weight{i}", w)
            if bias:
                b = torch.nn.Parameter(torch.zeros(output_size, device=device, dtype=dtype))
                b.allreduce = allreduce
                self.register_parameter(f"bias{i}", b)

    def _weights(self):
        return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]

    def _biases(self):
        return [getattr(self, f"bias{i}") for i in range(self.num_gemms)]

    def forward(self, x_RK: torch.Tensor, m_splits):
        """x [R, K], m_splits rows per expert -> ([R, N], per-expert biases if skip_bias_add)."""
        self._check_input_features(x_RK)
        counts = [int(c) for c in (m_splits.tolist() if isinstance(m_splits, torch.Tensor) else m_splits)]
        w_GKN = torch.stack(self._weights()).transpose(1, 2)
        y = grouped_mm(x_RK, w_GKN.to(x_RK.dtype), counts)
        if not self.use_bias:
            return y, None
        if self.skip_bias_add:
            return y, self._biases()
        group = torch.repeat_interleave(torch.arange(self.num_gemms, device=y.device),
                                        torch.tensor(counts, device=y.device))
        bias_rows = torch.stack(self._biases()).to(y.dtype)[group]
        return y + torch.cat([bias_rows, bias_rows.new_zeros(y.shape[0] - bias_rows.shape[0], y.shape[1])]), None

    def _check_input_features(self, x_RK: torch.Tensor) -> None:
        """The weights are used transposed, so only the input features K need 16-byte rows
        (grouped_mm); refused naming the config sizes that break that, before the call."""
        K = x_RK.shape[-1]
        multiple = default_alignment(x_RK.dtype)
        if K % multiple == 0:
            return
        sizes = {name: getattr(self.config, name, None)
                 for name in ("hidden_size", "moe_ffn_hidden_size", "moe_latent_size")}
        named = [f"{name}={size}" for name, size in sizes.items() if isinstance(size, int) and size % multiple]
        raise ValueError(
            f"TorchGroupedLinear in {x_RK.dtype} needs feature sizes that are multiples of {multiple} "
            f"(torch._grouped_mm: 16-byte aligned rows), got {K} input features"
            + (f"; not a multiple of {multiple}: {', '.join(named)}" if named else "")
        )

    def backward_dw(self) -> None:
        """Weight gradients are computed in the ordinary backward; nothing is delayed."""

    def sharded_state_dict(self, *args, **kwargs):
        raise NotImplementedError("TorchGroupedLinear has no distributed checkpoint format; use torch.save")


def torch_grouped_mlp_submodules():
    """Submodules that make Megatron's TEGroupedMLP run on torch._grouped_mm (no TE needed)."""
    from megatron.core.transformer.moe import experts

    submodules_cls = getattr(experts, "GroupedMLPSubmodules", None)
    if submodules_cls is None:  # older Megatron-Core: TEGroupedMLP takes MLPSubmodules
        from megatron.core.transformer.mlp import MLPSubmodules as submodules_cls
    return submodules_cls(linear_fc1=TorchGroupedLinear, linear_fc2=TorchGroupedLinear)


# -- Megatron-Core: the patch ----------------------------------------------------------------


def zero_token_safe(forward):
    """Wrap an experts forward(hidden [R, H], tokens_per_expert [G], probs [R], ...).

    Empty groups get alignment_for_config(config) zero rows with prob 0, rows past the last
    group are not passed on and come back as zeros; when neither happens (the dispatcher
    already padded) the original forward runs on the caller's tensors unchanged. The fused
    Transformer Engine path (op fuser, 256-row groups, no host sync) is passed through.
    """
    if getattr(forward, _PATCHED, False):
        return forward

    @functools.wraps(forward)
    def safe_forward(self, hidden, tokens_per_expert, probs, *args, **kwargs):
        if getattr(self, "_with_fused_impl", False):
            return forward(self, hidden, tokens_per_expert, probs, *args, **kwargs)
        align = alignment_for_config(self.config)
        groups = plan_groups(tokens_per_expert, hidden.shape[0], align, 1, hidden.device)
        if groups.identity:
            return forward(self, hidden, tokens_per_expert, probs, *args, **kwargs)
        if isinstance(tokens_per_expert, torch.Tensor):
            kernel_counts = torch.tensor(groups.kernel_counts, dtype=tokens_per_expert.dtype,
                                         device=tokens_per_expert.device)
        else:
            kernel_counts = list(groups.kernel_counts)
        setattr(self, KERNEL_ROWS, True)  # for the duration of the call (expert_out.py)
        try:
            out, bias = forward(self, to_kernel_rows(hidden, groups), kernel_counts,
                                to_kernel_rows(probs, groups), *args, **kwargs)
        finally:
            setattr(self, KERNEL_ROWS, False)
        return from_kernel_rows(out, groups), bias

    setattr(safe_forward, _PATCHED, True)
    return safe_forward


def install() -> list[str]:
    """Make Megatron-Core's grouped expert module (TEGroupedMLP: Transformer Engine grouped
    linears, or TorchGroupedLinear without TE) safe with zero-token experts. Idempotent.
    Returns the names of the classes that are now patched (patches.py lists the patch)."""
    from megatron.core.transformer.moe import experts

    experts.TEGroupedMLP.forward = zero_token_safe(experts.TEGroupedMLP.forward)
    return ["TEGroupedMLP"]


def is_installed() -> bool:
    from megatron.core.transformer.moe import experts

    cls = getattr(experts, "TEGroupedMLP", None)
    return cls is not None and getattr(cls.forward, _PATCHED, False)
