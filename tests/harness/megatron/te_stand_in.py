"""Transformer Engine stood in where it cannot be installed: what the fp8 hand-off
(megatron_patches.te_grouped_rows) and Megatron's op-fuser experts (`TEGroupedMLP._fused_forward`)
touch, as TE defines it at release_v2.19 (b447576) and main (d0067d0), read from TE's source:

- tensor/grouped_tensor.py and tensor/storage/grouped_tensor_storage.py: GroupedTensor's
  constructor keywords (no others), the attributes it keeps them under (`rowwise_data`,
  `scale_inv`, `first_dims`, `tensor_offsets`, `logical_shape`, `_with_gemm_swizzled_scales`, ...),
  `copy()`, and its `__torch_dispatch__`: detach and alias pass; expand and expand_as to its own
  shape pass; view(-1) gives the raw rowwise bytes; view to any other shape and the shape ops in
  BANNED_SHAPE_OPS raise RuntimeError; every other op raises NotImplementedError where the groups
  differ in size (TE computes on stacked members only when all have one shape);
- tensor/mxfp8_tensor.py, quantized_tensor.py: MXFP8Quantizer(fp8_dtype, *, rowwise, columnwise,
  with_2d_quantization) and the usage flags it keeps;
- pytorch/csrc/extensions/cast.cpp: the checks of `group_requantize_inplace`;
- ops/basic/grouped_linear.py and ops/_common.py: the path predicate
  (`is_op_fuser_grouped_tensor_path_supported`), which input each path takes (a GroupedTensor
  only with quantized compute on the graph-safe path; without quantized compute
  `maybe_dequantize(x).reshape(-1, in_features)`, which a GroupedTensor refuses; the
  split-quantize path refuses it by name), the same for the output gradient, the op's constructor
  keywords, and `validate_or_alloc_output` for the caller's output buffer (OUTPUT_BUFFER_KEY);
- ops/basic/swiglu.py, ops/basic/activation.py, ops/sequential.py: ScaledSwiGLU's and
  ScaledSReLU's keywords, Sequential's `op_kwargs`;
- quantization.py, common/recipe: FP8GlobalStateManager, `autocast` / `fp8_autocast`, the MXFP8
  recipe; module/grouped_linear.py: the GroupedLinear module's constructor keywords and `out=`;
  module/fp8_padding.py: Fp8Padding and Fp8Unpadding (the experts' own padding copy).

The arithmetic is plain PyTorch on the host: a matmul per group, SwiGLU or squared ReLU, the
routing weights.
TE's quantized GEMMs are not modelled: an op computes on the values its input holds (a
GroupedTensor's rows dequantized, which TE's requantize of MXFP8 rows keeps exactly), so a run
whose experts get the rows as a GroupedTensor must equal, bit for bit, the run whose experts get
them dequantized. `MegatronGroupedLinear` stands in for Megatron's own TE wrapper
(`TEColumnParallelGroupedLinear`, defined by Megatron only where TE imports).

`installed(capability=...)` puts the stand-in where `import transformer_engine` and Megatron's
experts module find it, for the duration of a block: TE as on a GPU of that compute capability.
Legend: R rows, K input features, N output features, G groups.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import itertools
import os
import sys
import types

import torch

from hybrid_ep.fp8 import FP8_DTYPE, MX_BLOCK, dequantize_rows

VERSION = "2.19.0"
aten = torch.ops.aten

# The device TE believes it runs on (installed() sets it): compute capability and cuBLASLt.
_DEVICE = {"capability": (10, 0), "cublaslt": 130600}
# What the fused ops were given, for the tests to read: fc1's inputs and fc2's output gradients.
SEEN: dict[str, list] = {"inputs": [], "grads": []}


class DType(enum.Enum):
    """transformer_engine_torch.DType (the members the stand-in uses)."""

    kFloat8E4M3 = 7
    kFloat8E5M2 = 8
    kBFloat16 = 6
    kFloat32 = 4


# -- recipes and the autocast state (common/recipe, pytorch/quantization.py) -----------------


class Format(enum.Enum):
    E4M3 = "E4M3"
    HYBRID = "HYBRID"


class Recipe:
    def mxfp8(self) -> bool:
        return False

    def custom(self) -> bool:
        return False

    def float8_current_scaling(self) -> bool:
        return False

    def float8_block_scaling(self) -> bool:
        return False

    def nvfp4(self) -> bool:
        return False


@dataclasses.dataclass
class MXFP8BlockScaling(Recipe):
    margin: int = 0
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = None
    enable_2d_quantization: bool = False

    def mxfp8(self) -> bool:
        return True


@dataclasses.dataclass
class Float8BlockScaling(Recipe):
    fp8_format: Format = Format.E4M3

    def float8_block_scaling(self) -> bool:
        return True


class FP8GlobalStateManager:
    """Whether TE's fp8 autocast is on, and with which recipe (TE keeps a stack of regions)."""

    _stack: list = []

    @classmethod
    def is_fp8_enabled(cls) -> bool:
        return bool(cls._stack) and cls._stack[-1][0]

    @classmethod
    def get_fp8_recipe(cls) -> Recipe:
        return cls._stack[-1][1] if cls._stack and cls._stack[-1][1] is not None else MXFP8BlockScaling()


@contextlib.contextmanager
def autocast(enabled: bool = True, calibrating: bool = False, recipe: Recipe | None = None,
             amax_reduction_group=None, _graph: bool = False):
    FP8GlobalStateManager._stack.append((enabled, recipe))
    try:
        yield
    finally:
        FP8GlobalStateManager._stack.pop()


def fp8_autocast(enabled: bool = True, calibrating: bool = False, fp8_recipe: Recipe | None = None,
                 fp8_group=None, _graph: bool = False):
    return autocast(enabled, calibrating, fp8_recipe, fp8_group, _graph)


# -- quantizers (quantized_tensor.py, tensor/mxfp8_tensor.py) --------------------------------


class Quantizer:
    def __init__(self, *, rowwise: bool, columnwise: bool) -> None:
        self.rowwise_usage = rowwise
        self.columnwise_usage = columnwise
        self.internal = False
        self.optimize_for_gemm = False

    def set_usage(self, *, rowwise: bool | None = None, columnwise: bool | None = None) -> None:
        if rowwise is not None:
            self.rowwise_usage = rowwise
        if columnwise is not None:
            self.columnwise_usage = columnwise


class MXFP8Quantizer(Quantizer):
    def __init__(self, fp8_dtype, *, rowwise: bool = True, columnwise: bool = True,
                 with_2d_quantization: bool = False) -> None:
        super().__init__(rowwise=rowwise, columnwise=columnwise)
        self.dtype = DType(fp8_dtype)
        self.with_2d_quantization = with_2d_quantization


def _quantizer_for(recipe: Recipe, *, forward: bool) -> Quantizer:
    """The quantizer an op of the fuser builds from the autocast recipe (forward: e4m3; the
    gradients under Format.HYBRID: e5m2)."""
    if not recipe.mxfp8():
        raise NotImplementedError(f"the stand-in models TE's MXFP8 recipe only, got {type(recipe).__name__}")
    hybrid = getattr(recipe, "fp8_format", Format.E4M3) == Format.HYBRID
    return MXFP8Quantizer(DType.kFloat8E5M2 if hybrid and not forward else DType.kFloat8E4M3)


# -- GroupedTensor (tensor/grouped_tensor.py, tensor/storage/grouped_tensor_storage.py) -------

BANNED_SHAPE_OPS = {
    aten.reshape.default, aten._reshape_alias.default, aten.flatten.using_ints, aten.unflatten.int,
    aten.squeeze.dim, aten.squeeze.dims, aten.unsqueeze.default, aten.transpose.int, aten.permute.default,
    aten.movedim.int, aten.t.default, aten.slice.Tensor, aten.narrow.default, aten.select.int,
    aten.split.Tensor, aten.chunk.default, aten.cat.default, aten.stack.default,
}

_STORAGE_FIELDS = (
    "num_tensors", "quantizer", "tensor_shapes", "fake_dtype", "rowwise_data", "columnwise_data", "scale_inv",
    "columnwise_scale_inv", "amax", "columnwise_amax", "scale", "first_dims", "last_dims", "tensor_offsets",
    "offsets", "scale_inv_offsets", "columnwise_scale_inv_offsets", "logical_shape", "quantized_tensors",
    "_with_gemm_swizzled_scales", "row_scaled_nvfp4", "nvfp4_use_4over6", "nvfp4_e4m3_max",
)


def _init_storage(obj, shape, dtype, *, num_tensors, shapes=None, quantizer=None, data=None, columnwise_data=None,
                  scale_inv=None, columnwise_scale_inv=None, amax=None, columnwise_amax=None, scale=None,
                  first_dims=None, last_dims=None, tensor_offsets=None, offsets=None, scale_inv_offsets=None,
                  columnwise_scale_inv_offsets=None, requires_grad=False, stride=None,
                  with_gemm_swizzled_scales=False, row_scaled_nvfp4=False, nvfp4_use_4over6=False,
                  nvfp4_e4m3_max=448) -> None:
    """GroupedTensorStorage._initialize_storage_fields: TE's keywords, kept under TE's names."""
    obj.num_tensors, obj.quantizer, obj.tensor_shapes, obj.fake_dtype = num_tensors, quantizer, shapes, dtype
    obj.rowwise_data, obj.columnwise_data = data, columnwise_data
    obj.scale_inv, obj.columnwise_scale_inv = scale_inv, columnwise_scale_inv
    obj.amax, obj.columnwise_amax, obj.scale = amax, columnwise_amax, scale
    obj.scale_inv_offsets, obj.columnwise_scale_inv_offsets = scale_inv_offsets, columnwise_scale_inv_offsets
    obj.first_dims, obj.last_dims, obj.tensor_offsets, obj.offsets = first_dims, last_dims, tensor_offsets, offsets
    obj.logical_shape = shape
    obj.quantized_tensors = None
    obj._with_gemm_swizzled_scales = with_gemm_swizzled_scales
    obj.row_scaled_nvfp4, obj.nvfp4_use_4over6 = row_scaled_nvfp4, nvfp4_use_4over6
    obj.nvfp4_e4m3_max = nvfp4_e4m3_max if nvfp4_use_4over6 else 448


class _StorageMethods:
    def all_same_shape(self) -> bool:
        return self.first_dims is None and self.last_dims is None

    def copy(self) -> "GroupedTensorStorage":
        """A storage sharing every buffer (TE: GroupedTensorStorage.copy)."""
        out = object.__new__(GroupedTensorStorage)
        for name in _STORAGE_FIELDS:
            setattr(out, name, getattr(self, name))
        return out

    def rows(self) -> torch.Tensor:
        """The values a rowwise MXFP8 grouped tensor with compact scales holds, [R, H] in its dtype
        (what TE's group_dequantize gives)."""
        R, H = self.logical_shape
        q = self.rowwise_data.view(FP8_DTYPE).view(R, H)
        return dequantize_rows(q, self.scale_inv.view(torch.uint8).view(R, H // MX_BLOCK), self.fake_dtype)


class GroupedTensorStorage(_StorageMethods):
    def __init__(self, shape, dtype, **fields):
        _init_storage(self, shape, dtype, **fields)


class _GroupedIdentityFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor):
        ctx.input_dtype = tensor.dtype
        return tensor.detach()

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output if grad_output.dtype == ctx.input_dtype else grad_output.to(ctx.input_dtype)


class GroupedTensor(_StorageMethods, torch.Tensor):
    """TE's GroupedTensor: a wrapper tensor of the logical shape whose buffers are attributes."""

    @staticmethod
    def __new__(cls, shape, dtype, *, num_tensors, shapes=None, quantizer=None, data=None, columnwise_data=None,
                scale_inv=None, columnwise_scale_inv=None, amax=None, columnwise_amax=None, scale=None,
                first_dims=None, last_dims=None, tensor_offsets=None, offsets=None, scale_inv_offsets=None,
                columnwise_scale_inv_offsets=None, requires_grad=False, stride=None,
                with_gemm_swizzled_scales=False, row_scaled_nvfp4=False, nvfp4_use_4over6=False,
                nvfp4_e4m3_max=448):
        fields = dict(num_tensors=num_tensors, shapes=shapes, quantizer=quantizer, data=data,
                      columnwise_data=columnwise_data, scale_inv=scale_inv, columnwise_scale_inv=columnwise_scale_inv,
                      amax=amax, columnwise_amax=columnwise_amax, scale=scale, first_dims=first_dims,
                      last_dims=last_dims, tensor_offsets=tensor_offsets, offsets=offsets,
                      scale_inv_offsets=scale_inv_offsets, columnwise_scale_inv_offsets=columnwise_scale_inv_offsets,
                      with_gemm_swizzled_scales=with_gemm_swizzled_scales, row_scaled_nvfp4=row_scaled_nvfp4,
                      nvfp4_use_4over6=nvfp4_use_4over6, nvfp4_e4m3_max=nvfp4_e4m3_max)
        tensors = (data, columnwise_data, scale_inv, columnwise_scale_inv, amax, columnwise_amax, scale, first_dims,
                   last_dims, tensor_offsets)
        device = next((t.device for t in tensors if t is not None), torch.device("cuda"))
        strides = torch.empty(tuple(shape), device="meta").stride() if stride is None else tuple(stride)
        t = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), strides=strides, storage_offset=0, dtype=dtype,
                                                layout=torch.strided, requires_grad=requires_grad, device=device)
        _init_storage(t, shape, dtype, **fields)
        return t

    def _like(self, requires_grad: bool) -> "GroupedTensor":
        out = torch.Tensor._make_wrapper_subclass(type(self), tuple(self.shape), strides=tuple(self.stride()),
                                                  storage_offset=self.storage_offset(), dtype=self.dtype,
                                                  layout=self.layout, requires_grad=requires_grad, device=self.device)
        for name in _STORAGE_FIELDS:
            setattr(out, name, getattr(self, name))
        return out

    @classmethod
    def __torch_dispatch__(cls, func, types_, args=(), kwargs=None):
        src = args[0] if args else None
        if func in (aten.detach.default, aten.alias.default):
            return src._like(requires_grad=False if func == aten.detach.default else src.requires_grad)
        if func == aten.expand.default and isinstance(src, GroupedTensor):
            shape = tuple(src.shape[i] if d == -1 else d for i, d in enumerate(args[1]))
            if len(args[1]) == src.dim() and shape == tuple(src.shape):
                return src._like(requires_grad=src.requires_grad)
        if func == aten.expand_as.default and isinstance(src, GroupedTensor):
            if tuple(args[1].shape) == tuple(src.shape):
                return src._like(requires_grad=src.requires_grad)
        if func in (aten.view.default, aten._unsafe_view.default) and isinstance(src, GroupedTensor):
            if tuple(args[1]) in ((-1,), (src.numel(),)):
                if src.rowwise_data is None:
                    raise RuntimeError(f"{cls.__name__} view(-1) requires rowwise_data to be initialized")
                return src.rowwise_data.view(-1)
            raise RuntimeError(f"{cls.__name__} only supports view(-1) for distributed optimizer flattening")
        if func in BANNED_SHAPE_OPS:
            raise RuntimeError(f"{cls.__name__} forbids shape-manipulation op: {func} ")
        for arg in itertools.chain(args, (kwargs or {}).values()):
            if isinstance(arg, GroupedTensor) and not arg.all_same_shape():
                raise NotImplementedError(
                    "GroupedTensor __torch_dispatch__ currently supports only uniform member shapes")
        raise NotImplementedError(f"the stand-in does not model {func} on a GroupedTensor of uniform groups")

    @classmethod
    def __torch_function__(cls, func, types_, args=(), kwargs=None):
        return torch._C._disabled_torch_function_impl(func, types_, args, kwargs or {})

    def expand_as(self, other):
        if other is self:
            return _GroupedIdentityFunc.apply(self)
        return super().expand_as(other)


# -- transformer_engine_torch: group_requantize_inplace (csrc/extensions/cast.cpp) ------------


def group_requantize_inplace(grouped_x, quantizer, num_tensors, first_dims, otype, tensor_offsets=None,
                             return_dequantized=False):
    """TE's checks of a pre-quantized grouped input; then it holds what the GEMMs read (the
    stand-in's GEMMs read the rowwise values, so nothing is built). Returns the dequantized rows
    when asked, as TE does."""
    if grouped_x.rowwise_data is None or grouped_x.scale_inv is None:
        raise RuntimeError("Grouped input has no rowwise data and scales for the GEMM to consume.")
    if grouped_x.quantizer is None:
        raise RuntimeError("Grouped input has no quantizer.")
    if type(grouped_x.quantizer) is not type(quantizer):
        raise RuntimeError("Grouped input and the op disagree on quantization format.")
    if grouped_x.quantizer.dtype != quantizer.dtype:
        raise RuntimeError("Grouped input and the quantizer disagree on the FP8 dtype.")
    if grouped_x._with_gemm_swizzled_scales:
        raise NotImplementedError("the stand-in models compact (unswizzled) input scales only")
    if grouped_x.columnwise_data is not None:
        raise RuntimeError("Grouped input already has columnwise data but unswizzled scales; requantizing "
                           "from it is not supported.")
    if not isinstance(quantizer, MXFP8Quantizer):
        raise RuntimeError("Requantizing a grouped input is only supported for MXFP8.")
    tokens, hidden = grouped_x.logical_shape
    if tokens % 128 or hidden % 128:
        raise RuntimeError(f"Requantizing a grouped input requires dims that are multiples of 128, but got "
                           f"({tokens}, {hidden}).")
    return grouped_x.rows() if return_dequantized else None


def get_cublasLt_version() -> int:
    return _DEVICE["cublaslt"]


# -- the op fuser (ops/basic/grouped_linear.py, ops/basic/swiglu.py, ops/sequential.py) -------

OUTPUT_BUFFER_KEY = "output"
GRAD_INPUT_BUFFER_KEY = "grad_input"


def is_op_fuser_grouped_tensor_path_supported(recipe: Recipe | None, dtype: torch.dtype) -> bool:
    """TE's predicate of its graph-safe grouped path (ops/basic/grouped_linear.py)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return False
    capability, cublaslt = _DEVICE["capability"], _DEVICE["cublaslt"]
    if not (9, 0) <= capability <= (11, 0) or cublaslt < 130300:
        return False
    if capability < (10, 0) and cublaslt < 130400:
        return False
    if recipe is None:
        return True
    if recipe.custom():
        return False
    if recipe.float8_block_scaling():
        return capability < (10, 0) and cublaslt >= 130600
    if recipe.mxfp8():
        return capability >= (10, 0)
    return False


def validate_or_alloc_output(buffer, shape, dtype, device):
    """ops/_common.py: the caller's output buffer, checked, or a new tensor."""
    shape = tuple(shape)
    if buffer is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(buffer.shape) != shape:
        raise ValueError(f"Output buffer shape {tuple(buffer.shape)} does not match {shape}.")
    if buffer.dtype != dtype:
        raise ValueError(f"Output buffer dtype {buffer.dtype} does not match {dtype}.")
    if buffer.device != device:
        raise ValueError(f"Output buffer device {buffer.device} does not match {device}.")
    if not buffer.is_contiguous():
        raise ValueError("Output buffer must be contiguous.")
    if buffer.requires_grad:
        raise ValueError("Output buffer must not require gradient.")
    return buffer


def maybe_dequantize(tensor, dtype=None):
    """ops/_common.py: a GroupedTensor is no QuantizedTensorStorage, so it comes back as it is."""
    if dtype is not None and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return tensor


class BasicOperation(torch.nn.Module):
    num_extra_inputs = 0


class GroupedLinear(BasicOperation):
    """te.ops.GroupedLinear: G linears y_g = x_g W_g^T on the groups of the input's rows."""

    num_extra_inputs = 1  # the split sizes

    def __init__(self, num_groups: int, in_features: int, out_features: int, *, bias: bool = True,
                 device=None, dtype=None, rng_state_tracker_function=None, accumulate_into_main_grad: bool = False,
                 single_grouped_weight: bool = False, single_grouped_bias: bool = False,
                 delay_wgrad_compute: bool = False, scale_bias: bool = False) -> None:
        super().__init__()
        if single_grouped_weight or single_grouped_bias or bias or accumulate_into_main_grad:
            raise NotImplementedError("the stand-in models per-group weights without bias, into .grad, only")
        self.num_groups, self.in_features, self.out_features = num_groups, in_features, out_features
        self.use_bias, self.single_grouped_weight, self.single_grouped_bias = bias, False, False
        self._accumulate_into_main_grad = accumulate_into_main_grad
        self.delay_wgrad_compute = delay_wgrad_compute
        self._delayed: list = []  # weight gradients kept for backward_dw()
        for g in range(num_groups):
            self.register_parameter(f"weight{g}", torch.nn.Parameter(
                torch.empty(out_features, in_features, device=device, dtype=dtype)))

    def take_input(self, input_, quantized: bool, recipe, dtype, *, grad: bool = False):
        """What the op computes on for `input_` (its forward input, or with grad its output
        gradient), as TE's path for it: a GroupedTensor only quantized on the graph-safe path."""
        features = self.out_features if grad else self.in_features
        if not is_op_fuser_grouped_tensor_path_supported(recipe, dtype):
            if isinstance(input_, GroupedTensor):
                raise NotImplementedError("Pre-quantized GroupedTensor input is only supported on the "
                                          "graph-safe grouped-tensor path.")
            return maybe_dequantize(input_, dtype)
        if quantized and isinstance(input_, GroupedTensor):
            if input_.dim() != 2 or input_.size(-1) != features:
                raise ValueError(f"GroupedTensor input must have shape (total_tokens, {features}), "
                                 f"but got {tuple(input_.size())}.")
            grouped = input_.copy()
            quantizer = _quantizer_for(recipe, forward=not grad)
            group_requantize_inplace(grouped, quantizer, self.num_groups, None, DType.kBFloat16)
            return grouped.rows().to(dtype)
        return maybe_dequantize(input_, dtype).reshape(-1, features)

    def compute(self, x_RK: torch.Tensor, splits: list[int], weights: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([x @ w.to(x.dtype).t() for x, w in zip(torch.split(x_RK, splits), weights)])

    def backward_dw(self) -> None:
        """The weight gradients of the last backward, when delay_wgrad_compute kept them."""
        for fn in self._delayed:
            fn()
        self._delayed = []


class ScaledSwiGLU(BasicOperation):
    """te.ops.ScaledSwiGLU: silu(x1) * x2 times a per-row scale (the routing weight)."""

    num_extra_inputs = 1  # the scales

    def __init__(self, glu_interleave_size: int | None = None, *, activation_recompute_in_mlp: bool = False):
        super().__init__()
        if activation_recompute_in_mlp:
            raise ValueError("ScaledSwiGLU does not support activation recomputation in the fused grouped MLP")
        if glu_interleave_size is not None:
            raise NotImplementedError("the stand-in models the plain GLU layout only")
        self.glu_interleave_size = glu_interleave_size
        self.activation_recompute_in_mlp = activation_recompute_in_mlp

    def compute(self, x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        gate, linear = torch.chunk(x, 2, dim=-1)
        return torch.nn.functional.silu(gate) * linear * scales.unsqueeze(-1).to(x.dtype)


class ScaledSReLU(BasicOperation):
    """te.ops.ScaledSReLU (ops/basic/activation.py): relu(x)^2 times a per-row scale."""

    num_extra_inputs = 1  # the scales

    def __init__(self, *, activation_recompute_in_mlp: bool = False) -> None:
        super().__init__()
        self.activation_recompute_in_mlp = activation_recompute_in_mlp

    def compute(self, x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return torch.relu(x).square() * scales.unsqueeze(-1).to(x.dtype)


class _FusedMLP(torch.autograd.Function):
    """fc1, activation and fc2 of a Sequential: TE's checks of the input and of the output
    gradient, the caller's output buffer, and the arithmetic in plain PyTorch."""

    @staticmethod
    def forward(ctx, ops, op_kwargs, n_extra, input_, *rest):
        fc1, act, fc2 = ops
        splits1, scales, splits2 = rest[:n_extra]
        params = rest[n_extra:]
        quantized = FP8GlobalStateManager.is_fp8_enabled()
        recipe = FP8GlobalStateManager.get_fp8_recipe() if quantized else None
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else fc1.weight0.dtype
        SEEN["inputs"].append(input_)
        x = fc1.take_input(input_, quantized, recipe, dtype)
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(grad) for t, grad in
                      zip((x, scales, *params), (input_.requires_grad, scales.requires_grad,
                                                 *(p.requires_grad for p in params)))]
            x_leaf, scales_leaf = leaves[:2]
            w1, w2 = leaves[2:2 + fc1.num_groups], leaves[2 + fc1.num_groups:]
            h = fc1.compute(x_leaf, [int(n) for n in splits1.tolist()], w1)
            y = fc2.compute(act.compute(h, scales_leaf), [int(n) for n in splits2.tolist()], w2)
        out = validate_or_alloc_output(op_kwargs[-1].get(OUTPUT_BUFFER_KEY), y.shape, dtype, input_.device)
        out.copy_(y.detach())
        ctx.ops, ctx.y, ctx.leaves, ctx.n_params = ops, y, leaves, len(params)
        ctx.quantized, ctx.recipe, ctx.dtype = quantized, recipe, dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        fc1, _, fc2 = ctx.ops
        SEEN["grads"].append(grad_out)
        dy = fc2.take_input(grad_out, ctx.quantized, ctx.recipe, ctx.dtype, grad=True)
        wanted = [t for t in ctx.leaves if t.requires_grad]
        grads = iter(torch.autograd.grad(ctx.y, wanted, dy, allow_unused=True))
        grads = [next(grads) if t.requires_grad else None for t in ctx.leaves]
        grad_x, grad_scales, grad_params = grads[0], grads[1], grads[2:]
        delayed = [op for op in (fc1, fc2) if op.delay_wgrad_compute]
        if delayed:  # TE keeps the weight gradients for backward_dw()
            params = [p for op in ctx.ops for p in op.parameters()]
            for param, grad in zip(params, grad_params):
                op = fc1 if any(param is p for p in fc1.parameters()) else fc2
                if op in delayed and grad is not None:
                    op._delayed.append(lambda param=param, grad=grad: _accumulate(param, grad))
            grad_params = [None] * len(grad_params)
        return None, None, None, grad_x, None, grad_scales, None, *grad_params


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    param.grad = grad if param.grad is None else param.grad + grad


class Sequential(torch.nn.Module):
    """te.ops.Sequential of fc1 (GroupedLinear), ScaledSwiGLU or ScaledSReLU, and fc2 (GroupedLinear)."""

    def __init__(self, *modules) -> None:
        super().__init__()
        for module in modules:
            self.append(module)

    def append(self, module) -> None:
        self.add_module(str(len(self._modules)), module)

    def __getitem__(self, idx):
        return list(self._modules.values())[idx]

    def _resolve_op_kwargs(self, op_kwargs) -> list[dict]:
        ops = list(self._modules.values())
        resolved = [{} for _ in ops]
        for key, kwargs in (op_kwargs or {}).items():
            module = self[key] if isinstance(key, int) else key
            if not isinstance(module, BasicOperation):
                raise ValueError(f"Attempted to provide forward kwargs to {type(module).__name__}, but "
                                 "Sequential only allows providing forward kwargs to a BasicOperation.")
            if not any(module is op for op in ops):
                raise ValueError("op_kwargs contains keys that are not in this Sequential")
            resolved[next(i for i, op in enumerate(ops) if op is module)] = kwargs
        for kwargs in resolved:
            unknown = set(kwargs) - {OUTPUT_BUFFER_KEY, GRAD_INPUT_BUFFER_KEY}
            if unknown:
                raise TypeError(f"unexpected op kwargs {sorted(unknown)}")
        return resolved

    def forward(self, input, *extra_inputs, op_kwargs=None):  # noqa: A002 (TE's name)
        ops = list(self._modules.values())
        if len(ops) != 3 or not (isinstance(ops[0], GroupedLinear) and isinstance(ops[1], (ScaledSwiGLU, ScaledSReLU))
                                 and isinstance(ops[2], GroupedLinear)):
            raise NotImplementedError("the stand-in models Sequential(GroupedLinear, a scaled activation, "
                                      "GroupedLinear)")
        kwargs = self._resolve_op_kwargs(op_kwargs)
        if kwargs[0].get(OUTPUT_BUFFER_KEY) is not None or any(k.get(GRAD_INPUT_BUFFER_KEY) is not None
                                                              for k in kwargs):
            raise NotImplementedError("the stand-in models the output buffer of the last op only")
        n_extra = sum(op.num_extra_inputs for op in ops)
        if len(extra_inputs) != n_extra:
            raise ValueError(f"expected {n_extra} extra inputs, got {len(extra_inputs)}")
        params = [p for op in ops for p in op.parameters()]
        return _FusedMLP.apply(ops, kwargs, n_extra, input, *extra_inputs, *params)


# -- the GroupedLinear module (module/grouped_linear.py) and Megatron's wrapper of it ---------


class GroupedLinearModule(torch.nn.Module):
    """te.pytorch.GroupedLinear (the module): its constructor keywords, weight{g} [out, in]."""

    def __init__(self, num_gemms: int, in_features: int, out_features: int, sequence_parallel: bool = False,
                 fuse_wgrad_accumulation: bool = False, tp_group=None, tp_size: int = 1, get_rng_state_tracker=None,
                 rng_tracker_name: str | None = None, init_method=None, bias: bool = True, return_bias: bool = False,
                 params_dtype: torch.dtype | None = None, parallel_mode: str | None = None, device="cuda",
                 ub_overlap_rs: bool = False, ub_overlap_ag: bool = False, ub_name: str | None = None,
                 delay_wgrad_compute: bool = False, save_original_input: bool = False,
                 single_grouped_weight: bool = False, single_grouped_bias: bool = False, name: str | None = None,
                 use_grouped_tensor: bool | None = None) -> None:
        super().__init__()
        if bias or single_grouped_weight or single_grouped_bias:
            raise NotImplementedError("the stand-in models per-group weights without bias only")
        self.params_dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.fuse_wgrad_accumulation, self.use_bias, self.return_bias = fuse_wgrad_accumulation, bias, return_bias
        self.single_grouped_weight, self.single_grouped_bias = single_grouped_weight, single_grouped_bias
        self.wgrad_accumulation_and_reduce_hooks: list = []
        for g in range(num_gemms):
            weight = torch.nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=self.params_dtype))
            if init_method is not None:
                with torch.no_grad():
                    init_method(weight)
            self.register_parameter(f"weight{g}", weight)

    def forward(self, inp, m_splits, is_first_microbatch=None, out=None, dgrad_out=None):
        if dgrad_out is not None:
            raise NotImplementedError("the stand-in models out= only")
        weights = [getattr(self, f"weight{g}") for g in range(self.num_gemms)]
        y = torch.cat([x @ w.to(x.dtype).t() for x, w in zip(torch.split(inp, [int(n) for n in m_splits]), weights)])
        if out is not None:
            out = validate_or_alloc_output(out, y.shape, y.dtype, y.device)
            out.copy_(y.detach())
            y = _Into.apply(y, out)
        return (y, None) if self.return_bias else y

    def _trigger_wgrad_accumulation_and_reduce_hooks(self) -> None:
        for hook in self.wgrad_accumulation_and_reduce_hooks:
            hook()


class _Into(torch.autograd.Function):
    """y's values, returned as the caller's buffer they were written into."""

    @staticmethod
    def forward(ctx, y, out):
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class MegatronGroupedLinear(GroupedLinearModule):
    """Megatron's TEColumnParallelGroupedLinear / TERowParallelGroupedLinear (expert-parallel,
    no tensor parallelism): Megatron's constructor keywords over the module's, forward(x, m_splits)
    -> (out, None)."""

    def __init__(self, num_gemms: int, input_size: int, output_size: int, *, config, init_method, bias: bool,
                 skip_bias_add: bool, is_expert: bool = False, tp_comm_buffer_name: str | None = None,
                 pg_collection=None, name: str | None = None) -> None:
        self.config = config
        self.te_return_bias = skip_bias_add and bias
        self.delay_wgrad_compute = bool(config.delay_wgrad_compute
                                        or config.overlap_dispatch_backward_with_experts_wgrad)
        super().__init__(num_gemms, input_size, output_size,
                         fuse_wgrad_accumulation=config.gradient_accumulation_fusion,
                         init_method=init_method if config.perform_initialization else None, bias=bias,
                         return_bias=self.te_return_bias, params_dtype=config.params_dtype, device="cpu",
                         delay_wgrad_compute=self.delay_wgrad_compute, name=name)

    def forward(self, x, m_splits):
        out = super().forward(x, m_splits)
        return out if self.te_return_bias else (out, None)


class Fp8Padding(torch.nn.Module):
    """te.pytorch.Fp8Padding (module/fp8_padding.py): each group's rows padded with zero rows to
    a multiple of align_size (None: the autocast recipe's, 32 for MXFP8, 16 otherwise)."""

    def __init__(self, num_gemms: int, align_size: int | None = None) -> None:
        super().__init__()
        self.num_gemms, self.align_size = num_gemms, align_size

    def _align(self) -> int:
        if self.align_size is None:
            self.align_size = 32 if FP8GlobalStateManager.get_fp8_recipe().mxfp8() else 16
        return self.align_size

    def forward(self, inp: torch.Tensor, m_splits: list[int]):
        assert len(m_splits) == self.num_gemms, "Number of splits should match number of GEMMs."
        align = self._align()
        padded = [(m + align - 1) // align * align for m in m_splits]
        if padded == list(m_splits):
            return inp, m_splits
        pieces = []
        for rows, m, p in zip(torch.split(inp, list(m_splits)), m_splits, padded):
            pieces += [rows, rows.new_zeros((p - m,) + tuple(rows.shape[1:]))]
        return torch.cat(pieces), padded


class Fp8Unpadding(Fp8Padding):
    """te.pytorch.Fp8Unpadding: the rows Fp8Padding added, taken out again."""

    def forward(self, inp: torch.Tensor, m_splits: list[int]) -> torch.Tensor:
        assert len(m_splits) == self.num_gemms, "Number of splits should match number of GEMMs."
        align = self._align()
        padded = [(m + align - 1) // align * align for m in m_splits]
        if padded == list(m_splits):
            return inp
        return torch.cat([rows[:m] for rows, m in zip(torch.split(inp, padded), m_splits)])


def grouped_mlp_submodules():
    """TEGroupedMLP's submodules on the stand-in's grouped linears."""
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules

    return GroupedMLPSubmodules(linear_fc1=MegatronGroupedLinear, linear_fc2=MegatronGroupedLinear)


# LayerCase fields for TEGroupedMLP on Transformer Engine's op fuser, TE stood in (inside installed())
OP_FUSER_CASE = {"experts": f"{__name__}:grouped_mlp_submodules", "op_fuser": True}


# -- installing it ------------------------------------------------------------------------------


def _module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


def _modules() -> dict[str, types.ModuleType]:
    """sys.modules entries: the TE packages the hand-off and Megatron's experts import."""
    tensor_mod = _module("transformer_engine.pytorch.tensor", GroupedTensor=GroupedTensor,
                         GroupedTensorStorage=GroupedTensorStorage, MXFP8Quantizer=MXFP8Quantizer)
    mxfp8 = _module("transformer_engine.pytorch.tensor.mxfp8_tensor", MXFP8Quantizer=MXFP8Quantizer)
    grouped_linear = _module("transformer_engine.pytorch.ops.basic.grouped_linear", GroupedLinear=GroupedLinear,
                             OUTPUT_BUFFER_KEY=OUTPUT_BUFFER_KEY, GRAD_INPUT_BUFFER_KEY=GRAD_INPUT_BUFFER_KEY,
                             is_op_fuser_grouped_tensor_path_supported=is_op_fuser_grouped_tensor_path_supported)
    basic = _module("transformer_engine.pytorch.ops.basic", grouped_linear=grouped_linear,
                    GroupedLinear=GroupedLinear, ScaledSwiGLU=ScaledSwiGLU)
    ops = _module("transformer_engine.pytorch.ops", basic=basic, Sequential=Sequential, GroupedLinear=GroupedLinear,
                  ScaledSwiGLU=ScaledSwiGLU, ScaledSReLU=ScaledSReLU)
    cpu_offload = _module("transformer_engine.pytorch.cpu_offload", CPUOffloadEnabled=False)
    quantization = _module("transformer_engine.pytorch.quantization", FP8GlobalStateManager=FP8GlobalStateManager,
                           autocast=autocast, fp8_autocast=fp8_autocast)
    pytorch = _module("transformer_engine.pytorch", ops=ops, tensor=tensor_mod, quantization=quantization,
                      cpu_offload=cpu_offload, Fp8Padding=Fp8Padding, Fp8Unpadding=Fp8Unpadding,
                      GroupedLinear=GroupedLinearModule, autocast=autocast, fp8_autocast=fp8_autocast)
    recipe = _module("transformer_engine.common.recipe", MXFP8BlockScaling=MXFP8BlockScaling,
                     Float8BlockScaling=Float8BlockScaling, Format=Format, Recipe=Recipe)
    common = _module("transformer_engine.common", recipe=recipe)
    root = _module("transformer_engine", pytorch=pytorch, common=common, __version__=VERSION)
    tex = _module("transformer_engine_torch", DType=DType, group_requantize_inplace=group_requantize_inplace,
                  get_cublasLt_version=get_cublasLt_version)
    return {m.__name__: m for m in (root, pytorch, ops, basic, grouped_linear, tensor_mod, mxfp8, quantization,
                                    cpu_offload, common, recipe, tex)}


@contextlib.contextmanager
def installed(capability: tuple[int, int] = (10, 0), megatron: bool = True):
    """Within the block: `import transformer_engine` gives the stand-in, TE believes it runs on a
    GPU of `capability`, and (megatron) Megatron's experts module sees TE (HAVE_TE, te, the buffer
    keys, Fp8Padding), its TE extension TE's cpu_offload flag, and the TE version Megatron caches
    is read again; everything is restored after."""
    modules = _modules()
    saved_modules = {name: sys.modules.get(name) for name in modules}
    names = ("HAVE_TE", "te", "OUTPUT_BUFFER_KEY", "GRAD_INPUT_BUFFER_KEY", "Fp8Padding", "Fp8Unpadding")
    experts = mcore_utils = None
    saved_experts, saved_version = {}, None
    if megatron:
        from megatron.core import utils as mcore_utils
        from megatron.core.extensions import transformer_engine as te_extension
        from megatron.core.transformer.moe import experts

        saved_experts = {name: getattr(experts, name, None) for name in names}
        saved_version, saved_offload = mcore_utils._te_version, getattr(te_extension, "cpu_offload", None)
    saved_device = dict(_DEVICE)
    saved_env = os.environ.get("NVTE_CUTEDSL_FUSED_GROUPED_MLP")
    sys.modules.update(modules)
    if megatron:
        for name, value in zip(names, (True, modules["transformer_engine"], OUTPUT_BUFFER_KEY, GRAD_INPUT_BUFFER_KEY,
                                       Fp8Padding, Fp8Unpadding)):
            setattr(experts, name, value)
        mcore_utils._te_version = None
        te_extension.cpu_offload = modules["transformer_engine.pytorch.cpu_offload"]
    _DEVICE["capability"] = tuple(capability)
    os.environ["NVTE_CUTEDSL_FUSED_GROUPED_MLP"] = "1"  # Megatron's SwiGLU fusion asks for TE's fused MLP
    try:
        yield modules
    finally:
        for name, module in saved_modules.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        for name, value in saved_experts.items():
            setattr(experts, name, value)
        if megatron:
            mcore_utils._te_version, te_extension.cpu_offload = saved_version, saved_offload
        _DEVICE.update(saved_device)
        if saved_env is None:
            os.environ.pop("NVTE_CUTEDSL_FUSED_GROUPED_MLP", None)
        else:
            os.environ["NVTE_CUTEDSL_FUSED_GROUPED_MLP"] = saved_env
