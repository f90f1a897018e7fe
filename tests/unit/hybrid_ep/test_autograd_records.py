"""What hybrid_ep.dispatch / combine leave to autograd: nothing where no input needs a gradient
(the buffer's call, without a Function), and with gradients a graph that frees itself (no
reference cycle) and reaches every input that asks for a gradient."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import hybrid_ep as hep
from hybrid_ep import autograd

pytestmark = pytest.mark.unit

H, E, T = 32, 4, 6


@pytest.fixture
def buf(single_rank_group):
    return hep.HybridEPBuffer(single_rank_group, H, 16, E, backend="reference")


def _inputs():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=gen)
    idx = torch.tensor([[0, 1], [2, 3], [1, -1], [3, 0], [2, 1], [0, 3]], dtype=torch.int64)
    w = torch.rand(T, 2, generator=gen) + 0.5
    return x, idx, w


def _no_function(monkeypatch):
    def refuse(*args):
        raise AssertionError("an autograd Function ran for a call without gradients")

    monkeypatch.setattr(autograd._Dispatch, "apply", refuse)
    monkeypatch.setattr(autograd._Combine, "apply", refuse)


@pytest.mark.parametrize("grad_mode", ["inputs without gradients", "no_grad"])
def test_without_gradients_the_result_is_the_buffers(buf, monkeypatch, grad_mode):
    x, idx, w = _inputs()
    want = buf.dispatch(x, idx, w, num_out_tokens=16)
    want_y = buf.combine(want.tokens * 2, want.handle, apply_probs=True)
    _no_function(monkeypatch)
    if grad_mode == "no_grad":  # inputs that would want gradients, under no_grad
        x, w = x.requires_grad_(), w.requires_grad_()
    with torch.set_grad_enabled(grad_mode != "no_grad"):
        got = hep.dispatch(buf, x, idx, w, num_out_tokens=16)
        y = hep.combine(buf, got.tokens * 2, got.handle, apply_probs=True)
        again = hep.dispatch(buf, x, handle=got.handle)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.probs, want.probs)
    assert got.probs is got.handle.probs_R and torch.equal(got.tokens_per_expert, want.tokens_per_expert)
    assert torch.equal(y, want_y) and float(y.abs().sum()) > 0
    assert not (got.tokens.requires_grad or got.probs.requires_grad or y.requires_grad)
    # a reused handle is handed back as given, with its probs, as the Function hands it
    assert again.handle is got.handle and again.probs is got.probs and torch.equal(again.tokens, got.tokens)


@pytest.mark.parametrize("x_grad", [True, False], ids=["x-and-weights", "weights-only"])
@pytest.mark.parametrize("probs_in_expert", [True, False], ids=["probs-in-expert", "apply-probs"])
def test_the_routing_weights_get_their_gradient(buf, x_grad, probs_in_expert):
    """y[t] = sum over t's routes k of w[t, k] * 2 x[t], so d sum(y) / d w[t, k] = 2 sum(x[t])
    where routed and 0 where not, whether or not x asks for its gradient."""
    x, idx, w = _inputs()
    x = x.clone().requires_grad_(x_grad)
    w = w.clone().requires_grad_()
    res = hep.dispatch(buf, x, idx, w, num_out_tokens=16)
    assert res.probs.requires_grad and res.probs is res.handle.probs_R
    rows = res.tokens * 2 if x_grad else res.tokens.detach() * 2  # then only the probs carry a graph
    if probs_in_expert:
        y = hep.combine(buf, rows * res.probs[:, None], res.handle)
    else:
        y = hep.combine(buf, rows, res.handle, apply_probs=True)
    y.sum().backward()
    want = torch.where(idx >= 0, 2 * x.detach().sum(dim=1, keepdim=True), 0.0)
    torch.testing.assert_close(w.grad, want, rtol=1e-5, atol=1e-5)
    if x_grad:  # d sum(y) / d x[t, h] = 2 sum of t's routed weights
        torch.testing.assert_close(x.grad, (2 * torch.where(idx >= 0, w.detach(), 0.0).sum(dim=1))[:, None]
                                   .expand(T, H), rtol=1e-5, atol=1e-5)
    else:
        assert x.grad is None


def test_a_dispatch_with_gradients_leaves_no_reference_cycle(buf):
    """The probs dispatch returns carry the graph; the handle its node keeps must not hold that
    same tensor (node -> handle -> probs -> node), or every call's graph, handle and tables
    would wait for the garbage collector."""
    x, idx, w = _inputs()
    x, w = x.requires_grad_(), w.requires_grad_()
    gc.disable()  # what is freed now is freed by reference counts; other objects' garbage does not count
    try:
        res = hep.dispatch(buf, x, idx, w, num_out_tokens=16)
        y = hep.combine(buf, res.tokens * res.probs[:, None], res.handle)
        y.sum().backward()
        handle, probs, node = weakref.ref(res.handle), weakref.ref(res.probs), weakref.ref(res.probs.grad_fn)
        del res, y
        assert (handle(), probs(), node()) == (None, None, None)
    finally:
        gc.enable()
    assert w.grad is not None


def test_each_call_applies_one_function_on_its_tensors_and_one_tuple(buf, monkeypatch):
    """Function.apply's host time grows with its arguments, so each call applies one Function
    to the tensors that may need a gradient and one tuple of everything else."""
    applied = []
    for fn in (autograd._Dispatch, autograd._Combine):
        apply = fn.apply
        monkeypatch.setattr(fn, "apply", lambda *args, _apply=apply, _fn=fn: applied.append(
            (_fn.__name__, len(args), type(args[-1]))) or _apply(*args))
    x, idx, w = _inputs()
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    res = hep.dispatch(buf, x, idx, w, num_out_tokens=16)
    rows = res.tokens.detach().requires_grad_()
    y = hep.combine(buf, rows, res.handle, apply_probs=True)
    assert applied == [("_Dispatch", 3, tuple), ("_Combine", 3, tuple)]
    assert [edge[0] is not None for edge in y.grad_fn.next_functions] == [True, True]  # rows and probs
    y.sum().backward()
    want = torch.where(idx >= 0, x.detach().sum(dim=1, keepdim=True), 0.0)  # d sum(y) / d w: routed x summed
    torch.testing.assert_close(w.grad, want, rtol=1e-5, atol=1e-5)
