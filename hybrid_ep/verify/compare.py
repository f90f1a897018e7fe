"""Assertions shared by every backend's tests: bitwise dispatch, rounding-bounded combine."""

from __future__ import annotations

import sys

import torch

from ..rows import as_byte_rows
from .oracle import CombineBounds, OracleDispatch
from .rounding import exponent_of, power_of_two, round_to

_EPS = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}  # unit roundoff
_MANTISSA = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}
_MIN_EXP = {torch.float32: -126, torch.bfloat16: -126, torch.float16: -14}  # smallest normal exponent: below
# it the spacing stays 2**(min - mantissa), so rounding there is absolute, not relative


def _bytes(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Raw bytes of t on the device of `like` (the oracle's): comparisons run where it ran."""
    return as_byte_rows(t.to(like.device))


def refuse_payload_free() -> None:
    """Results of the CPU model in payload-free mode (hybrid_ep._model.set_payload(False), for
    timing runs) are not the kernels' results: its bulk copies moved no bytes. Checking them
    would fail by chance or pass by chance, so every check here refuses them."""
    model = sys.modules.get("hybrid_ep._model")
    if model is not None and hasattr(model, "payload") and not model.payload():
        raise RuntimeError("the CPU model runs payload-free (hybrid_ep._model.set_payload(False)): its bulk copies "
                           "move no bytes, so its outputs are not results to check; set_payload(True) first")


def assert_dispatch_matches(got: dict, want: OracleDispatch, where: str = "") -> None:
    """got: tokens, scales, probs, tokens_per_expert, num_dropped of one rank."""
    refuse_payload_free()
    tag = f"{where}: " if where else ""
    tokens = got["tokens"]
    assert tokens.dtype == want.tokens.dtype, f"{tag}tokens dtype {tokens.dtype} != {want.tokens.dtype}"
    assert tuple(tokens.shape) == tuple(want.tokens.shape), (
        f"{tag}tokens shape {tuple(tokens.shape)} != {tuple(want.tokens.shape)}"
    )
    got_bytes, want_bytes = _bytes(tokens, want.tokens), _bytes(want.tokens, want.tokens)
    if not torch.equal(got_bytes, want_bytes):
        bad = (got_bytes != want_bytes).any(dim=1).nonzero()[:, 0]
        raise AssertionError(f"{tag}dispatch rows differ from the oracle at rows {bad[:10].tolist()}")
    if want.scales is None:
        assert got["scales"] is None, f"{tag}scales should be None"
    else:
        scales = got["scales"]
        form = (want.scales.dtype, tuple(want.scales.shape))
        assert scales is not None and (scales.dtype, tuple(scales.shape)) == form, (
            f"{tag}scales {None if scales is None else (scales.dtype, tuple(scales.shape))} are not in the "
            f"oracle's format {form}")
        assert torch.equal(_bytes(scales, want.scales), _bytes(want.scales, want.scales)), (
            f"{tag}scales differ from the oracle")
    assert torch.equal(got["probs"].to(want.probs.device), want.probs), f"{tag}probs differ from the oracle"
    assert torch.equal(got["tokens_per_expert"].to(want.tokens_per_expert.device), want.tokens_per_expert), (
        f"{tag}tokens_per_expert {got['tokens_per_expert'].tolist()} != {want.tokens_per_expert.tolist()}"
    )
    assert int(got["num_dropped"]) == want.num_dropped, (
        f"{tag}num_dropped {int(got['num_dropped'])} != {want.num_dropped}"
    )


def combine_tolerance(want64: torch.Tensor, magnitude64: torch.Tensor, dtype: torch.dtype,
                      num_terms: int, wire_dtype: torch.dtype | None = None, hops: int = 1) -> torch.Tensor:
    """Allowed |error| against the exact float64 sum: fp32 accumulation of num_terms terms,
    the rounding of every partial sum to the wire dtype on each of `hops` hops (None: the
    output dtype; 1 on one node, 2 across nodes: rank partial, then node partial), then one
    rounding to dtype.

    On every hop each partial is rounded at most half an ulp of itself, and the partials'
    magnitudes add up to at most `magnitude64` (times 1 + eps(wire) after a rounding), so
    each hop adds eps(wire) x magnitude (nothing for an fp32 wire, which the accumulation
    bound covers). The final rounding is one ulp of the float64 result for bf16 and fp16,
    half an ulp for fp32. `assert_combine_within` checks the hops exactly instead.
    """
    wire = dtype if wire_dtype is None else wire_dtype
    accumulate = (num_terms + 1) * 2.0**-24 * magnitude64
    eps = 0.0 if wire == torch.float32 else _EPS[wire]
    rounding = ((1 + eps) ** hops - 1) * magnitude64
    if wire != torch.float32:  # a subnormal partial rounds by up to half the subnormal spacing
        rounding = rounding + hops * 2.0 ** (_MIN_EXP[wire] - _MANTISSA[wire] - 1)
    ulp = power_of_two(exponent_of(want64).clamp(min=_MIN_EXP[dtype]) - _MANTISSA[dtype])
    return accumulate + rounding + ulp + 1e-300


def assert_combine_close(got: torch.Tensor, want64: torch.Tensor, magnitude64: torch.Tensor,
                         num_terms: int, where: str = "", wire_dtype: torch.dtype | None = None,
                         hops: int = 1) -> None:
    refuse_payload_free()
    tag = f"{where}: " if where else ""
    assert tuple(got.shape) == tuple(want64.shape), f"{tag}combine shape {tuple(got.shape)} != {tuple(want64.shape)}"
    err = (got.detach().to(want64.device).double() - want64).abs()
    tol = combine_tolerance(want64, magnitude64, got.dtype, num_terms, wire_dtype, hops)
    if bool((err > tol).any()):
        i = int((err - tol).argmax())
        t, h = divmod(i, max(want64.shape[1], 1))
        raise AssertionError(
            f"{tag}combine differs from the float64 oracle at token {t}, column {h}: got "
            f"{got.flatten()[i].item()!r}, want {want64.flatten()[i].item()!r}, tolerance {tol.flatten()[i].item():.3g}"
        )


def combine_output_range(bounds: CombineBounds, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The output values a combine may return: its fp32 sum's range cast to dtype."""
    return round_to(bounds.lo, dtype), round_to(bounds.hi, dtype)


def assert_combine_within(got: torch.Tensor, bounds: CombineBounds, where: str = "") -> None:
    """got (the combine output, any float dtype) against the hop model: every rounding to the
    wire is reproduced, so only the fp32 summation order is left open; most elements have
    one admissible value."""
    refuse_payload_free()
    tag = f"{where}: " if where else ""
    assert tuple(got.shape) == tuple(bounds.value.shape), (
        f"{tag}combine shape {tuple(got.shape)} != {tuple(bounds.value.shape)}")
    lo, hi = combine_output_range(bounds, got.dtype)
    g = got.detach().to(lo.device).double()
    bad = ~((lo <= g) & (g <= hi))
    if bool(bad.any()):
        i = int(bad.flatten().nonzero()[0, 0])
        t, h = divmod(i, max(g.shape[1], 1))
        raise AssertionError(
            f"{tag}combine differs from the hop model at token {t}, column {h} ({int(bounds.hops[t])} hops): got "
            f"{g.flatten()[i].item()!r}, want {lo.flatten()[i].item()!r} to {hi.flatten()[i].item()!r} "
            f"(exact-sum model {bounds.value.flatten()[i].item()!r}); {int(bad.sum())} elements outside"
        )
