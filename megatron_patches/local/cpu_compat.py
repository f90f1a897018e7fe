"""Run Megatron-Core on a machine without a GPU (tests, the CPU demo). Never used on a GPU.

Megatron-Core assumes CUDA in a few places even when the model lives on the CPU:

- the router moves its weight (and creates its bias buffers) on `torch.cuda.current_device()`;
  `mappings.py` allocates gather outputs there too;
- the alltoall dispatcher creates a `torch.cuda.Stream` for device-to-host copies and
  enters `torch.cuda.stream(...)` / records events on it;
- the RNG tracker (`tensor_parallel.random`) forks the CUDA generator around dropout and
  expert initialisation;
- the alltoall dispatcher turns its split sizes into host lists only for CUDA tensors
  (`maybe_move_tensor_to_cpu(..., as_numpy=True)`); CPU tensors stay tensors, which
  `all_to_all_single` rejects;
- Megatron's optimizers (`optimizer.py`, `clip_grads.py`, `grad_scaler.py`, and the multi-tensor
  fallbacks in `utils.py`) create their
  scale / found-inf / norm scalars with `device='cuda'`, and the mixed-precision optimizer
  and the gradient clipper tell parameter kinds apart by `param.type()` names such as
  'torch.cuda.BFloat16Tensor' (the distributed optimizer and the parameter buffers too);
  Megatron-LM's params norm (`megatron.training.utils.common_utils`, --log-params-norm)
  sums in `device='cuda'` scalars too;
  those modules get a `torch` whose factories put
  `device='cuda'` tensors on the CPU, and the two type checks see CUDA names for CPU tensors;
- with expert tensor parallelism the alltoall dispatcher all-gathers pieces of unequal size
  and reduce-scatters a list (tensor_parallel.mappings); gloo has neither, so that module
  gets a `torch.distributed` that does the same with equal-size all_gather and all_reduce;
- the pipeline schedules count tokens in a `device='cuda'` scalar, and the EP-overlap
  schedule (`overlap_moe_expert_parallel_comm`, combined 1F1B) creates streams with a
  priority and calls `record_stream` on activations (allocator lifetimes only); the
  schedules module gets the CPU factories and `record_stream` is a no-op for CPU tensors;
- gradient-accumulation fusion (`gradient_accumulation_fusion`, Megatron-LM's default) calls
  Apex's `fused_weight_gradient_mlp_cuda` to add each linear's weight gradient straight into
  its `main_grad` (a GEMM with fp32 compute and beta 1, so bf16 runs never round the weight
  gradient to bf16); tensor_parallel.layers gets a host version of the same arithmetic;
- Megatron-Core 0.16's router gating calls `te_general_gemm`, a name that is left undefined
  when Transformer Engine is not installed (NameError); it is defined as None, which selects
  the torch matmul path the code already has.

`enable()` replaces exactly these with CPU equivalents, and only when
`torch.cuda.is_available()` is false: `current_device()` answers the CPU device, streams
and events are no-ops (CPU work is synchronous), and the RNG tracker forks the CPU
generator. `enable()` is idempotent; `enabled()` says whether it patched anything.

Nothing enables them by default: `megatron_patches.apply(cpu_compat=True)` or
HYBRID_EP_CPU_COMPAT=1 asks for them (`requested`), as the local demo, the launcher's CPU
trainer and the tests do (through `local.common.init_megatron`). The Megatron functions they
replace are listed in megatron_patches/patches.py with the others.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

_ENABLED = False


class _NullEvent:
    """A CUDA event stand-in: CPU work is complete when the call returns."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        return None

    def synchronize(self):
        return None

    def wait(self, *args, **kwargs):
        return None

    def query(self):
        return True


class _NullStream:
    """A CUDA stream stand-in; every operation is already ordered on the CPU."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        return None

    def wait_event(self, *args, **kwargs):
        return None

    def record_event(self, event=None):
        return event if event is not None else _NullEvent()

    def synchronize(self):
        return None

    def query(self):
        return True

    @staticmethod
    def priority_range():
        return (0, 0)

    def __eq__(self, other):
        return isinstance(other, _NullStream)

    def __hash__(self):
        return 0


_NULL_STREAM = _NullStream()


def _cpu_current_device():
    return torch.device("cpu")


def _null_stream_context(stream=None):
    return contextlib.nullcontext()


class _CPURNGStatesTracker:
    """Megatron's CudaRNGStatesTracker contract (add / fork / get_states / set_states /
    reset), keeping named states of the CPU generator instead of the CUDA one."""

    def __init__(self, *args, **kwargs):
        self.reset()

    def is_initialized(self):
        return self._is_initialized

    def reset(self):
        self._is_initialized = False
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self):
        return dict(self.states_)

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = states

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


def _install_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.CudaRNGStatesTracker = _CPURNGStatesTracker
    mrandom._CUDA_RNG_STATE_TRACKER = _CPURNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # model_parallel_cuda_manual_seed re-creates the tracker unless told it exists.
    original = mrandom.initialize_rng_tracker

    @functools.wraps(original)
    def initialize_rng_tracker(*args, **kwargs):
        if not isinstance(mrandom._CUDA_RNG_STATE_TRACKER, _CPURNGStatesTracker):
            original(*args, **kwargs)
            mrandom._CUDA_RNG_STATE_TRACKER = _CPURNGStatesTracker()
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True

    initialize_rng_tracker._hybrid_ep_cpu = True
    if not getattr(original, "_hybrid_ep_cpu", False):
        mrandom.initialize_rng_tracker = initialize_rng_tracker


def _install_host_splits() -> None:
    from megatron.core.transformer.moe import token_dispatcher

    original = token_dispatcher.maybe_move_tensor_to_cpu
    if getattr(original, "_hybrid_ep_cpu", False):
        return

    @functools.wraps(original)
    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        tensor = original(tensor, as_numpy=as_numpy, record_stream=record_stream)
        if as_numpy and torch.is_tensor(tensor):
            return tensor.numpy()
        return tensor

    maybe_move_tensor_to_cpu._hybrid_ep_cpu = True
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


class _CpuFactoryTorch:
    """`torch` as seen by one Megatron module: factories asked for 'cuda' build on the CPU."""

    _FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "zeros_like", "ones_like", "empty_like")

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        attr = getattr(self._real, name)
        if name not in self._FACTORIES:
            return attr

        def factory(*args, **kwargs):
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == "cuda":
                kwargs["device"] = "cpu"
            return attr(*args, **kwargs)

        return factory


@contextlib.contextmanager
def _cuda_type_names():
    """Within the block, CPU tensors report `type()` names of their CUDA counterparts."""
    original = torch.Tensor.type

    def type_(self, *args, **kwargs):
        if args or kwargs:
            return original(self, *args, **kwargs)
        name = original(self)
        return name if self.is_cuda or not name.startswith("torch.") else name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = original


def _wrap_with_cuda_type_names(owner, name):
    original = getattr(owner, name)
    if getattr(original, "_hybrid_ep_cpu", False):
        return

    @functools.wraps(original)
    def wrapped(*args, **kwargs):
        with _cuda_type_names():
            return original(*args, **kwargs)

    wrapped._hybrid_ep_cpu = True
    setattr(owner, name, wrapped)


def _install_cpu_optimizer() -> None:
    import importlib

    for name in ("megatron.core.optimizer.optimizer", "megatron.core.optimizer.clip_grads",
                 "megatron.core.optimizer.grad_scaler", "megatron.core.utils",
                 "megatron.core.optimizer.distrib_optimizer", "megatron.core.distributed.param_and_grad_buffer"):
        module = importlib.import_module(name)
        if not isinstance(module.torch, _CpuFactoryTorch):
            module.torch = _CpuFactoryTorch(module.torch)
    from megatron.core.optimizer import clip_grads, optimizer

    _wrap_with_cuda_type_names(optimizer.Float16OptimizerWithFloat16Params, "__init__")
    from megatron.core.optimizer import distrib_optimizer

    _wrap_with_cuda_type_names(distrib_optimizer.DistributedOptimizer, "__init__")
    _wrap_with_cuda_type_names(clip_grads, "clip_grad_by_total_norm_fp32")
    if hasattr(optimizer, "clip_grad_by_total_norm_fp32"):
        _wrap_with_cuda_type_names(optimizer, "clip_grad_by_total_norm_fp32")
    try:  # Megatron-LM's params norm (--log-params-norm) sums in device='cuda' scalars
        common_utils = importlib.import_module("megatron.training.utils.common_utils")
    except ImportError:
        return
    if not isinstance(common_utils.torch, _CpuFactoryTorch):
        common_utils.torch = _CpuFactoryTorch(common_utils.torch)


class _GlooDistributed:
    """`torch.distributed` as seen by Megatron's tensor_parallel.mappings on gloo, which has
    no all_gather of unequal sizes and no list reduce_scatter (the alltoall dispatcher uses
    both with expert tensor parallelism). The same results from collectives gloo has:
    all_gather pads every piece to the largest and trims; reduce_scatter all-reduces the
    concatenated pieces and keeps this rank's."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def all_gather(self, tensor_list, tensor, group=None, async_op=False):
        sizes = [t.shape[0] for t in tensor_list]
        if len(set(sizes)) == 1 and tensor.shape[0] == sizes[0]:
            return self._real.all_gather(tensor_list, tensor, group=group, async_op=async_op)
        longest = max(sizes)
        padded = tensor.new_zeros((longest,) + tuple(tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        pieces = [torch.empty_like(padded) for _ in tensor_list]
        self._real.all_gather(pieces, padded, group=group)
        for out, piece, n in zip(tensor_list, pieces, sizes):
            out.copy_(piece[:n])
        return None

    def reduce_scatter(self, output, input_list, op=None, group=None, async_op=False):
        total = torch.cat([t.reshape(t.shape[0], -1) for t in input_list]).contiguous()
        self._real.all_reduce(total, group=group)
        rank = self._real.get_rank(group)
        start = sum(t.shape[0] for t in input_list[:rank])
        output.copy_(total[start : start + output.shape[0]].view_as(output))
        return None


class _TorchWithGlooCollectives:
    """`torch` for one Megatron module, with `distributed` replaced by _GlooDistributed."""

    def __init__(self, real):
        self._real = real
        self.distributed = _GlooDistributed(real.distributed)

    def __getattr__(self, name):
        return getattr(self._real, name)


def _install_gloo_collectives() -> None:
    from megatron.core.tensor_parallel import mappings

    if not isinstance(mappings.torch, _TorchWithGlooCollectives):
        mappings.torch = _TorchWithGlooCollectives(mappings.torch)


def _install_cpu_schedules() -> None:
    """The pipeline schedules count tokens in a device='cuda' scalar; the EP-overlap
    schedule (combined 1F1B) calls record_stream on activations, which on the CPU only
    affects allocator lifetimes; it becomes a no-op for CPU tensors."""
    import importlib

    module = importlib.import_module("megatron.core.pipeline_parallel.schedules")
    if not isinstance(module.torch, _CpuFactoryTorch):
        module.torch = _CpuFactoryTorch(module.torch)
    original = torch.Tensor.record_stream
    if getattr(original, "_hybrid_ep_cpu", False):
        return

    def record_stream(self, stream):
        if self.is_cuda:
            return original(self, stream)
        return None

    record_stream._hybrid_ep_cpu = True
    torch.Tensor.record_stream = record_stream


class _HostWgradAccumulation:
    """Apex's fused_weight_gradient_mlp_cuda on the host: main_grad += grad_output^T @ input,
    products and sums in fp32 whatever the inputs' dtype, rounded once to main_grad's dtype."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input, grad_output, main_grad):
        main_grad.addmm_(grad_output.t().float(), total_input.float())

    @staticmethod
    def wgrad_gemm_accum_fp16(total_input, grad_output, main_grad):
        main_grad.copy_(torch.addmm(main_grad.float(), grad_output.t().float(), total_input.float()))


def _install_host_wgrad_accumulation() -> None:
    from megatron.core.tensor_parallel import layers

    layers.fused_weight_gradient_mlp_cuda = _HostWgradAccumulation
    layers._grad_accum_fusion_available = True


def _define_missing_te_gemm() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


ENV = "HYBRID_EP_CPU_COMPAT"
_ENV_VALUES = {"1": True, "0": False, "": False}


def requested(explicit: bool | None = None) -> bool:
    """Whether the stand-ins are asked for: `explicit` when given, else HYBRID_EP_CPU_COMPAT
    (1: yes; 0 or unset: no; anything else is refused by name)."""
    if explicit is not None:
        if not isinstance(explicit, bool):
            raise TypeError(f"cpu_compat must be True, False or None, got {explicit!r}")
        return explicit
    value = os.environ.get(ENV, "").strip()
    if value not in _ENV_VALUES:
        raise ValueError(f"{ENV} must be 1 (CPU stand-ins on) or 0, got {value!r}")
    return _ENV_VALUES[value]


def enabled() -> bool:
    return _ENABLED


def enable() -> bool:
    """Install the CPU stand-ins when no GPU is visible; returns whether they are active (never
    on a machine with a GPU, where Megatron's own CUDA calls work)."""
    global _ENABLED
    if _ENABLED:
        return True
    if torch.cuda.is_available():
        return False
    torch.cuda.current_device = _cpu_current_device
    torch.cuda.Stream = _NullStream
    torch.cuda.Event = _NullEvent
    torch.cuda.current_stream = lambda device=None: _NULL_STREAM
    torch.cuda.default_stream = lambda device=None: _NULL_STREAM
    torch.cuda.stream = _null_stream_context
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.manual_seed = lambda seed: None
    torch.cuda.manual_seed_all = lambda seed: None
    try:
        _install_rng_tracker()
        _install_host_splits()
        _install_gloo_collectives()
        _install_cpu_schedules()
        _define_missing_te_gemm()
        _install_host_wgrad_accumulation()
        _install_cpu_optimizer()
    except ImportError:
        pass  # Megatron not installed: the torch stand-ins are all there is to do
    try:
        from . import cpu_training

        cpu_training.enable(_CpuFactoryTorch)
    except ImportError:
        pass  # Megatron-Core without megatron.training
    _ENABLED = True
    return True
