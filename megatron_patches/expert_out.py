"""The experts' output in place: the forward combine reads the experts' output where they wrote it.

On the cuda backend's direct path with one process per GPU, a combine reads each expert
host's expert_out through peer memory, so an expert_out that lies outside peer memory is
first copied into the rank's expert-out block (Engine._into_expert_out_block).
`HybridEPBuffer.expert_out_view(handle)` is an uninitialised [rows, H] tensor in that block,
which the combine reads in place. The experts are given that view to write into, by one of
two paths, whichever the experts MoELayer built run on:

- Transformer Engine's op fuser (TEGroupedMLP with `_with_fused_impl`, Megatron-Core 0.19 and
  main, TE 2.18 and later): Megatron's own seam. `MoELayer.routed_experts_compute` asks the
  dispatcher for `get_expert_zero_copy_buffers()`; the flex dispatcher reads its manager's
  `_zc_fwd_token_buf`, which `ExpertOutInPlace.output_buffer` answers with the view, and
  TEGroupedMLP hands it to TE's fused ops as fc2's output buffer (`OUTPUT_BUFFER_KEY`; TE checks
  its shape, dtype, device and contiguity). The fp8 input hand-off (te_grouped_rows) runs alike.
- TE's GroupedLinear module (TEGroupedMLP without the op fuser): Megatron's wrapper calls TE's
  forward as `(x, m_splits)` only (0.19.x and main), so TE's own `out=` (TE 2.18 on) cannot be
  reached without replacing Megatron's function; TE allocates fc2's output in Python inside the
  GroupedLinear Function's forward, `out = torch.empty([sum(m_splits), N], dtype=activation_dtype,
  device=...)`, and the grouped GEMM writes into it. So while fc2's forward runs, `ExpertOutMode`
  (a TorchFunctionMode) answers the first `torch.empty` of exactly [rows, H] of the current
  dispatch, in the view's dtype and on its device, with the view; every other call passes
  through unchanged.

`install_reason` says where it is installed, and why not elsewhere: on the op fuser where TE
takes an output buffer; on the module path only where fc2 allocates its output with torch.empty
(not TorchGroupedLinear, which allocates inside torch._grouped_mm) and takes rows of another
width than it returns (so no input-side tensor has the output's shape), without fc2 bias
(added into a new tensor); never under the EP-overlap schedule (other calls on the buffer run
between a layer's experts and its combine). Per forward (`ExpertOutInPlace`), the view is
handed out only when the dispatch took the direct path, no other call ran on the buffer since,
no CUDA graph is being captured, zero_token_safe is not running the experts on padded kernel
rows (its output is then a new tensor: grouped_gemm.KERNEL_ROWS) and the view lies in peer
memory (`HybridEPBuffer.is_in_peer_memory`): the receive path, the reference backend and ranks
in one process get no view, and nothing is intercepted there. A view handed out whose tensor is
not what reaches the combine, or a call on the buffer in between, raises a RuntimeError
(`check_combine`) rather than let the combine copy over a tensor still in use.

The backward still copies: the dispatched rows' gradient and the routing weights' gradient
are made inside autograd (the experts' backward, hybrid_ep's own), which takes no buffer.
`--no-hybrid-ep-expert-out-in-place` (HybridEPOptions(expert_out_in_place=False)) turns it off.
"""

from __future__ import annotations

import logging
import weakref

import torch
from torch.overrides import TorchFunctionMode

from .grouped_gemm import KERNEL_ROWS

OFF_FLAG = "--no-hybrid-ep-expert-out-in-place (HybridEPOptions(expert_out_in_place=False))"

_log = logging.getLogger(__name__)


def _device(device) -> torch.device:
    """A device with its index (None: the default device; cuda without one: the current)."""
    if device is None:
        device = torch.get_default_device()
    elif isinstance(device, int):
        device = torch.device("cuda", device)
    else:
        device = torch.device(device)
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device() if device.type == "cuda" else 0)
    return device


def _size(args, kwargs) -> tuple[int, ...] | None:
    """torch.empty's size, given as ints, one sequence or size=; None where it is none of those."""
    size = kwargs.get("size", args[0] if len(args) == 1 and isinstance(args[0], (tuple, list)) else args)
    try:
        return tuple(int(n) for n in size)
    except (TypeError, ValueError):
        return None


class ExpertOutMode(TorchFunctionMode):
    """While active: the first torch.empty of `shape`, `dtype` on `device` (a plain contiguous
    tensor: no out=, requires_grad, pinned memory or other layout) returns `take()`, where that
    gives a tensor; every other call, and everything after that first one, passes through.
    `handed_out`: what was returned instead of a new tensor (None: nothing)."""

    def __init__(self, shape, dtype: torch.dtype, device, take):
        super().__init__()
        self.shape, self.dtype, self.device = tuple(shape), dtype, _device(device)
        self._take = take
        self.handed_out: torch.Tensor | None = None
        self.matched = False  # a torch.empty matched (take() was asked, whatever it gave)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.empty and self._take is not None and self._matches(args, kwargs):
            take, self._take = self._take, None  # at most once
            self.matched = True
            view = take()
            if view is not None:
                self.handed_out = view
                return view
        return func(*args, **kwargs)

    def _matches(self, args, kwargs) -> bool:
        if (kwargs.get("out") is not None or kwargs.get("requires_grad") or kwargs.get("pin_memory")
                or kwargs.get("names") is not None
                or kwargs.get("layout") not in (None, torch.strided)
                or kwargs.get("memory_format") not in (None, torch.contiguous_format)):
            return False
        dtype = kwargs.get("dtype") or torch.get_default_dtype()
        return (dtype == self.dtype and _size(args, kwargs) == self.shape
                and _device(kwargs.get("device")) == self.device)


def _features(linear) -> tuple[int | None, int | None]:
    """(input, output) features of a grouped linear: TE's attributes, else weight0 [out, in]."""
    w = getattr(linear, "weight0", None)
    in_f = getattr(linear, "in_features", None) or (w.shape[1] if w is not None else None)
    out_f = getattr(linear, "out_features", None) or (w.shape[0] if w is not None else None)
    return in_f, out_f


def install_reason(experts, config, options) -> str | None:
    """None where the in-place path can serve the experts MoELayer built, else why not."""
    if not options.expert_out_in_place:
        return "turned off (--no-hybrid-ep-expert-out-in-place)"
    if experts is None:
        return "experts not built yet"
    from megatron.core.transformer.moe import experts as experts_module

    if not isinstance(experts, getattr(experts_module, "TEGroupedMLP", ())):
        return f"{type(experts).__name__}: its output is not one projection's"
    if getattr(config, "overlap_moe_expert_parallel_comm", False):
        return "the EP-overlap schedule runs other calls on the buffer between the experts and the combine"
    if getattr(experts, "_with_fused_impl", False):
        if getattr(experts_module, "OUTPUT_BUFFER_KEY", None) is None:
            return "Transformer Engine's op fuser takes an output buffer from TE 2.18 on"
        return None
    fc2 = getattr(experts, "linear_fc2", None)
    if fc2 is None:
        return "no linear_fc2"
    if not getattr(fc2, "OUTPUT_FROM_TORCH_EMPTY", True):
        return f"{type(fc2).__name__} allocates its output outside Python"
    if getattr(config, "add_bias_linear", False) or getattr(fc2, "use_bias", False):
        return "fc2's bias is added into a new tensor"
    in_f, out_f = _features(fc2)
    if in_f is None or in_f == out_f:
        return f"fc2 takes rows of its output's width ({in_f})"
    if getattr(config, "fp8", None) or getattr(config, "fp4", None):
        skip = getattr(experts_module, "skip_routed_expert_padding", None)
        if skip is None or not skip(config):
            return "TEGroupedMLP unpads its quantized rows' output into a new tensor"
    return None


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _output_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a grouped linear gives its output for input x (Transformer Engine: the
    autocast dtype where autocast is on, else the input's)."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


def _fused_output_dtype(experts, device: torch.device) -> torch.dtype:
    """The dtype TE's op fuser gives fc2's output: the autocast dtype where autocast is on, else
    its weights' (ops/basic/grouped_linear.py)."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    fc2 = experts.linear_fc2
    return (fc2.weight if getattr(fc2, "single_grouped_weight", False) else fc2.weight0).dtype


class ExpertOutInPlace:
    """The in-place path of one dispatcher's experts: on the op fuser, `output_buffer` (what the
    manager gives Megatron as the experts' output_buffer); on the module path, hooks around
    fc2's forward that enter an ExpertOutMode for the current dispatch (pre-hook) and leave it
    (forward hook, also when the forward raises); on both, the check the combine makes. `views`:
    forwards whose output was handed the view; `unmatched`: module-path forwards whose fc2 made
    no matching torch.empty (the first one logs a warning)."""

    def __init__(self, dispatcher, experts):
        self._dispatcher = weakref.ref(dispatcher)
        self._experts = weakref.ref(experts)
        self._mode: ExpertOutMode | None = None
        self.handed_out: torch.Tensor | None = None  # the view fc2's output lies in, until token_combine
        self._handed_for = None  # the forward dispatch's CallRecord it belongs to
        self.views = 0
        self.unmatched = 0  # forwards on the direct path whose fc2 made no matching torch.empty
        self.fused = bool(getattr(experts, "_with_fused_impl", False))
        fc2 = experts.linear_fc2
        self._hooks = [] if self.fused else [fc2.register_forward_pre_hook(self._enter),
                                             fc2.register_forward_hook(self._exit, always_call=True)]

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def forget(self) -> None:
        """A new dispatch: nothing handed out for it yet."""
        self.handed_out = self._handed_for = None

    def _direct_call(self):
        """(dispatcher, experts, handle, buffer) of the current forward dispatch where a view can
        be handed out for it (module docstring), else None."""
        dispatcher, experts = self._dispatcher(), self._experts()
        if dispatcher is None or experts is None or getattr(experts, KERNEL_ROWS, False):
            return None
        handle, buf = dispatcher.handle, dispatcher._handle_buffer
        if handle is None or buf is None or handle.data_path != "direct" or _capturing(buf.device):
            return None
        if buf.last_call is not dispatcher.last_dispatch_call:
            return None  # another call on the buffer since this layer's dispatch
        return dispatcher, experts, handle, buf

    def output_buffer(self) -> torch.Tensor | None:
        """The op fuser's path: the view fc2's output goes to for the current dispatch (detached,
        as Megatron's flex dispatcher hands its buffers on), or None; asked once per forward,
        by MoELayer through get_expert_zero_copy_buffers."""
        self.forget()
        call = self._direct_call() if self.fused else None
        if call is None:
            return None
        dispatcher, experts, handle, buf = call
        view = buf.expert_out_view(handle, dtype=_fused_output_dtype(experts, buf.device))
        if not buf.is_in_peer_memory(view):
            return None
        self.handed_out, self._handed_for = view, dispatcher.last_dispatch_call
        self.views += 1
        return view.detach()

    def _enter(self, module, args) -> None:
        if self._mode is not None:
            return  # re-entered: the outer forward holds the mode
        self.forget()
        call = self._direct_call()
        if call is None or not args or not isinstance(args[0], torch.Tensor):
            return
        dispatcher, _, handle, buf = call
        record = dispatcher.last_dispatch_call
        dtype = _output_dtype(args[0])

        def take():
            view = buf.expert_out_view(handle, dtype=dtype)
            return view if buf.is_in_peer_memory(view) else None

        mode = ExpertOutMode((handle.num_rows, buf.config.hidden_dim), dtype, buf.device, take)
        mode.__enter__()
        self._mode, self._handed_for = mode, record

    def _exit(self, module, args, output) -> None:
        mode, self._mode = self._mode, None
        if mode is None:
            return
        mode.__exit__(None, None, None)
        if mode.handed_out is not None:
            self.handed_out = mode.handed_out
            self.views += 1
            return
        self._handed_for = None
        if not mode.matched and output is not None and not self.unmatched:
            # Installed, on the direct path, yet fc2 made its output another way than the
            # torch.empty install_reason counts on (another Transformer Engine version?): the
            # combine copies it, though the startup line says in place. Said once.
            _log.warning("hybrid_ep dispatcher: the experts' fc2 made its output without a torch.empty of "
                         "[%d, %d] %s: the combine copies it into the expert-out block (the startup line's "
                         "'expert output in place' does not hold for this run)", *mode.shape, mode.dtype)
        self.unmatched += 1

    def check_combine(self, hidden_states: torch.Tensor, buf) -> None:
        """Before token_combine's combine: where fc2 was handed the view, what reaches the
        combine must be that tensor and no other call may have run on the buffer since the
        dispatch (either would let the combine copy over, or read, a block in use)."""
        view, record = self.handed_out, self._handed_for
        self.forget()
        if view is None:
            return
        if (hidden_states.data_ptr() != view.data_ptr() or hidden_states.shape != view.shape
                or hidden_states.dtype != view.dtype):
            raise RuntimeError(
                f"hybrid_ep dispatcher: the experts' fc2 wrote its output into the combine's expert-out block "
                f"(in place: {view.dtype} {list(view.shape)}), but token_combine got another tensor "
                f"({hidden_states.dtype} {list(hidden_states.shape)}): something between fc2 and the combine made "
                f"a new one, and the combine would copy it over fc2's output while it may still be in use; turn "
                f"the in-place path off with {OFF_FLAG}"
            )
        if buf.last_call is not record:
            raise RuntimeError(
                "hybrid_ep dispatcher: the experts' fc2 wrote its output into the combine's expert-out block (in "
                "place), but another dispatch or combine ran on the buffer before this layer's combine and may "
                f"have replaced or overwritten the block; turn the in-place path off with {OFF_FLAG}"
            )
