"""megatron_patches.expert_out: the mode that hands fc2 the combine's expert-out view, the hooks
around fc2's forward and the check token_combine makes, with a stand-in buffer and dispatcher
(the Megatron layer on the cuda backend: tests/megatron/test_dispatcher.py)."""

from __future__ import annotations

import types

import pytest
import torch

from megatron_patches.expert_out import ExpertOutInPlace, ExpertOutMode

pytestmark = pytest.mark.unit

R, H, F = 6, 16, 12  # rows of the dispatch, hidden (fc2's output width), fc2's input width


def _stack_depth() -> int:
    return torch._C._len_torch_function_stack()


def test_the_mode_hands_out_exactly_one_matching_empty():
    """The first torch.empty of the shape, dtype and device gets the view, given as ints, a
    list or a tuple; the next one, alike, is a new tensor; take() is asked once."""
    view = torch.full((R, H), 7.0)
    taken = []

    def take():
        taken.append(1)
        return view

    with ExpertOutMode((R, H), torch.float32, "cpu", take) as mode:
        first = torch.empty([R, H], dtype=torch.float32, device="cpu")
        second = torch.empty(R, H)
        third = torch.empty((R, H), device=torch.device("cpu"))
    assert first is view and mode.handed_out is view and taken == [1]
    assert second.data_ptr() != view.data_ptr() and third.data_ptr() != view.data_ptr()
    assert second.shape == third.shape == (R, H)
    assert torch.equal(view, torch.full((R, H), 7.0))  # nothing wrote into it


@pytest.mark.parametrize("call", [
    lambda: torch.empty(R, F),                                   # another shape
    lambda: torch.empty(R + 1, H),
    lambda: torch.empty(R * H),
    lambda: torch.empty(R, H, dtype=torch.float64),              # another dtype
    lambda: torch.empty(R, H, dtype=torch.bfloat16),
    lambda: torch.empty(R, H, device="meta"),                    # another device
    lambda: torch.empty(R, H, requires_grad=True),               # not a plain tensor
    lambda: torch.zeros(R, H),                                   # not torch.empty
    lambda: torch.empty_like(torch.ones(R, H)),
], ids=["shape", "rows", "flat", "float64", "bf16", "meta", "requires_grad", "zeros", "empty_like"])
def test_the_mode_passes_every_other_call_through(call):
    """Other shapes, dtypes, devices, a tensor that requires grad and other factories are made
    as without the mode, and leave the view for the matching call after them."""
    view = torch.full((R, H), 7.0)
    with ExpertOutMode((R, H), torch.float32, "cpu", lambda: view) as mode:
        other = call()
        assert mode.handed_out is None
        assert other.data_ptr() != view.data_ptr() or other.device.type == "meta"
        assert torch.empty(R, H) is view


def test_the_mode_takes_nothing_where_take_gives_nothing():
    """take() returning None (the view would not lie in peer memory): the call is passed
    through and nothing after it is intercepted."""
    with ExpertOutMode((R, H), torch.float32, "cpu", lambda: None) as mode:
        a, b = torch.empty(R, H), torch.empty(R, H)
    assert mode.handed_out is None and a.shape == b.shape == (R, H) and a.data_ptr() != b.data_ptr()


class _Block:
    """A stand-in HybridEPBuffer: its expert-out block, what lies in peer memory, its calls."""

    def __init__(self, in_peer: bool = True):
        self.block = torch.zeros(R * H * 4, dtype=torch.uint8)
        self.config = types.SimpleNamespace(hidden_dim=H)
        self.device = torch.device("cpu")
        self.in_peer = in_peer
        self.last_call = object()  # the dispatch's record
        self.views = 0

    def expert_out_view(self, handle, columns=None, dtype=None):
        self.views += 1
        if not self.in_peer:  # what a backend without an expert-out block gives
            return torch.empty(handle.num_rows, H, dtype=dtype)
        return self.block[:handle.num_rows * H * dtype.itemsize].view(dtype).view(handle.num_rows, H)

    def is_in_peer_memory(self, t):
        start, end = self.block.data_ptr(), self.block.data_ptr() + self.block.numel()
        return self.in_peer and start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= end


class _Dispatcher:
    """What ExpertOutInPlace reads of HybridEPManager after a dispatch."""

    def __init__(self, buf, data_path="direct"):
        self.handle = types.SimpleNamespace(num_rows=R, data_path=data_path)
        self._handle_buffer = buf
        self.last_dispatch_call = buf.last_call


class _Fc2(torch.nn.Module):
    """fc2 as Transformer Engine's GroupedLinear makes its output: one torch.empty written by the GEMM."""

    def __init__(self, fail: bool = False):
        super().__init__()
        self.register_buffer("weight", torch.randn(H, F))  # the GEMM writes into out=: no autograd here
        self.fail = fail

    def forward(self, x):
        out = torch.empty([x.shape[0], self.weight.shape[0]], dtype=x.dtype, device=x.device)
        torch.matmul(x, self.weight.t(), out=out)
        if self.fail:
            raise RuntimeError("the GEMM failed")
        return out


class _Experts(torch.nn.Module):
    def __init__(self, fail: bool = False):
        super().__init__()
        self.linear_fc2 = _Fc2(fail)

    def forward(self, x):
        return self.linear_fc2(x)


def _installed(in_peer=True, data_path="direct", fail=False):
    buf = _Block(in_peer)
    dispatcher = _Dispatcher(buf, data_path)
    experts = _Experts(fail)
    return buf, dispatcher, experts, ExpertOutInPlace(dispatcher, experts)


def test_fc2_writes_its_output_into_the_view_and_the_combine_takes_it():
    buf, _, experts, hook = _installed()
    x = torch.randn(R, F)
    out = experts(x)
    assert out.data_ptr() == buf.block.data_ptr() and hook.handed_out is out and hook.views == 1
    assert torch.equal(out, x @ experts.linear_fc2.weight.t())
    assert _stack_depth() == 0  # the mode is active only during fc2's forward
    hook.check_combine(out, buf)  # the tensor handed out: nothing to refuse
    assert hook.handed_out is None
    hook.remove()
    assert experts(x).data_ptr() != buf.block.data_ptr()


def test_nothing_is_handed_out_where_the_view_is_not_in_peer_memory():
    """A backend without an expert-out block gives a plain tensor: fc2 allocates its own output."""
    buf, _, experts, hook = _installed(in_peer=False)
    out = experts(torch.randn(R, F))
    assert buf.views == 1 and hook.handed_out is None and hook.views == 0
    hook.check_combine(out.clone(), buf)  # nothing was handed out: any tensor may be combined


class _Fc2Elsewhere(_Fc2):
    """fc2 that makes its output inside an op (as torch._grouped_mm does), not with torch.empty."""

    def forward(self, x):
        return x @ self.weight.t()


def test_an_fc2_that_makes_no_matching_empty_is_said_once(caplog):
    """Installed on the direct path, yet fc2 made its output another way: the combine copies
    it, and one warning says so (not one per forward)."""
    buf, _, experts, hook = _installed()
    experts.linear_fc2 = _Fc2Elsewhere()
    hook.remove()
    dispatcher = _Dispatcher(buf)  # held: the hooks keep weak references
    hook = ExpertOutInPlace(dispatcher, experts)
    with caplog.at_level("WARNING", logger="megatron_patches.expert_out"):
        for _ in range(3):
            out = experts(torch.randn(R, F))
    assert out.data_ptr() != buf.block.data_ptr() and hook.views == 0 and hook.unmatched == 3
    warned = [r.getMessage() for r in caplog.records if "made its output without a torch.empty" in r.getMessage()]
    assert len(warned) == 1 and f"[{R}, {H}] torch.float32" in warned[0], warned
    # a matching fc2 warns nothing
    caplog.clear()
    buf, _, experts, hook = _installed()
    experts(torch.randn(R, F))
    assert hook.unmatched == 0 and not caplog.records


def test_nothing_is_intercepted_on_the_receive_path():
    buf, _, experts, hook = _installed(data_path="receive")
    experts(torch.randn(R, F))
    assert buf.views == 0 and hook.views == 0


def test_nothing_is_handed_out_after_another_call_on_the_buffer():
    buf, _, experts, hook = _installed()
    buf.last_call = object()  # e.g. another micro-batch's backward combine
    experts(torch.randn(R, F))
    assert buf.views == 0 and hook.views == 0


def test_nothing_is_handed_out_while_the_experts_run_on_padded_kernel_rows():
    """zero_token_safe's padded groups: the experts' output is then a new tensor (from_kernel_rows)."""
    from megatron_patches.grouped_gemm import KERNEL_ROWS

    buf, _, experts, hook = _installed()
    setattr(experts, KERNEL_ROWS, True)
    experts(torch.randn(R, F))
    assert buf.views == 0 and hook.views == 0
    setattr(experts, KERNEL_ROWS, False)
    experts(torch.randn(R, F))
    assert hook.views == 1


def test_the_mode_is_left_when_the_forward_raises():
    _, _, experts, hook = _installed(fail=True)
    with pytest.raises(RuntimeError, match="the GEMM failed"):
        experts(torch.randn(R, F))
    assert _stack_depth() == 0
    assert torch.empty(R, H).data_ptr() != experts.linear_fc2.weight.data_ptr()


def test_token_combine_refuses_another_tensor_than_the_view_handed_out():
    """The experts made a new tensor from fc2's output (a bias, a copy): combining it would copy it
    over fc2's output in the expert-out block. The manager's combine raises, naming the option."""
    from megatron_patches.manager import HybridEPManager

    buf, dispatcher, experts, hook = _installed()
    out = experts(torch.randn(R, F))
    fake = types.SimpleNamespace(handle=dispatcher.handle, _handle_buffer=buf, expert_out=hook)
    with pytest.raises(RuntimeError, match=r"token_combine got another tensor .* --no-hybrid-ep-expert-out-in-place"):
        HybridEPManager.combine(fake, out + 1)
    # a call on the buffer between the experts and the combine is refused as well
    out = experts(torch.randn(R, F))
    buf.last_call = object()
    with pytest.raises(RuntimeError, match=r"another dispatch or combine ran on the buffer .* --no-hybrid-ep-expert"):
        hook.check_combine(out, buf)
