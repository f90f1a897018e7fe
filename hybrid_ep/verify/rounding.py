"""Correctly rounded float64 -> narrower float, and the fp32 sums of the combine hops as
intervals.

torch's float64 -> bfloat16 / float16 cast goes through float32 and so rounds twice
(1 + 2^-8 + 2^-30 becomes 1.0 instead of 1 + 2^-7); `round_to` rounds once, to nearest
even, as a cast from the exact value would. Monotone rounding lets an interval of possible
fp32 values be rounded end by end: whatever value the hardware held, its rounding lies
between the roundings of the ends.
"""

from __future__ import annotations

import dataclasses

import torch

# (stored mantissa bits, smallest normal exponent, largest finite value)
_FORMATS = {
    torch.float32: (23, -126, torch.finfo(torch.float32).max),
    torch.bfloat16: (7, -126, torch.finfo(torch.bfloat16).max),
    torch.float16: (10, -14, torch.finfo(torch.float16).max),
}
FP32_UNIT_ROUNDOFF = 2.0**-24


def _format(dtype: torch.dtype) -> tuple[int, int, float]:
    if dtype not in _FORMATS:
        raise ValueError(f"dtype must be one of {list(_FORMATS)}, got {dtype}")
    return _FORMATS[dtype]


def exponent_of(x64: torch.Tensor) -> torch.Tensor:
    """floor(log2|x|) of float64 values as int64, read from the bits (-1023 for 0 and the
    float64 subnormals, which every caller clamps above)."""
    return ((x64.to(torch.float64).view(torch.int64) >> 52) & 0x7FF) - 1023


def power_of_two(e: torch.Tensor) -> torch.Tensor:
    """2.0**e for int64 e in float64's normal range, built from the bits: exact on every
    device (CUDA's float64 pow(2, e) is not, and a bound one ulp of float64 off excludes the
    value it should admit)."""
    return ((e + 1023) << 52).view(torch.float64)


def quantum(x64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` values at |x| (its ulp; the subnormal spacing below the normals)."""
    mantissa, min_exp, _ = _format(dtype)
    return power_of_two(exponent_of(x64).clamp(min=min_exp) - mantissa)


def round_to(x64: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x64 rounded once to the nearest `dtype` value (ties to even), returned as float64."""
    _, _, largest = _format(dtype)
    x64 = x64.to(torch.float64)
    q = quantum(x64, dtype)
    out = torch.round(x64 / q) * q  # exact scalings by powers of two; torch.round ties to even
    return torch.where(out.abs() > largest, torch.copysign(torch.full_like(out, float("inf")), out), out)


def _granularity(x64: torch.Tensor) -> torch.Tensor:
    """The largest power of two an fp32 value is a multiple of (inf for 0)."""
    q = quantum(x64, torch.float32)
    significand = torch.round(x64.abs() / q).to(torch.int64)
    lowest_bit = (significand & -significand).to(torch.float64)
    return torch.where(significand > 0, q * lowest_bit, float("inf"))


@dataclasses.dataclass
class Interval:
    """Every value a quantity can take, per element, lo <= . <= hi, and `value`: the one it
    takes when every fp32 sum is exact (float64 tensors)."""

    lo: torch.Tensor
    hi: torch.Tensor
    value: torch.Tensor

    @staticmethod
    def point(x64: torch.Tensor) -> "Interval":
        return Interval(x64, x64, x64)

    def rounded(self, dtype: torch.dtype) -> "Interval":
        return Interval(round_to(self.lo, dtype), round_to(self.hi, dtype), round_to(self.value, dtype))


class Fp32Sum:
    """A sum of terms accumulated in fp32 in an unspecified order (any order, any tree).

    A term is either an fp32 number known to lie in an Interval with fp32 ends (a rounded
    partial) or an exact float64 value that fp32 arithmetic rounds first (a point, such as an
    expert output times its routing weight), present where its mask says. The result is
    exact when there is one fp32 term, or when every term is a known fp32 value and every
    partial sum is representable: all terms are multiples of the finest term's granularity q
    (the lowest set bit of its significand), so the sum is exact if sum |terms| <= 2^24 q
    (1 + 2^-8 is exact; 2^30 + 1 is not). Otherwise each of the n - 1 additions (and
    the fp32 rounding of a term that is not an fp32 value) adds at most one unit roundoff of
    sum |terms|: the bound (n + 1) u sum |terms| holds for every order.
    """

    def __init__(self, shape, device):
        f64 = dict(dtype=torch.float64, device=device)
        self.lo = torch.zeros(shape, **f64)
        self.hi = torch.zeros(shape, **f64)
        self.value = torch.zeros(shape, **f64)
        self.magnitude = torch.zeros(shape, **f64)
        self.finest = torch.full(shape, float("inf"), **f64)  # smallest granularity of a known term
        self.terms = torch.zeros(shape, dtype=torch.int64, device=device)
        self.fp32_ends = torch.ones(shape, dtype=torch.bool, device=device)
        self.known = torch.ones(shape, dtype=torch.bool, device=device)

    def add(self, term: Interval, present: torch.Tensor) -> None:
        """present: bool, broadcastable to the sum's shape."""
        present = present.expand_as(self.lo)
        zero = torch.zeros_like(self.lo)
        lo, hi = torch.where(present, term.lo, zero), torch.where(present, term.hi, zero)
        self.lo += lo
        self.hi += hi
        self.value += torch.where(present, term.value, zero)
        size = torch.maximum(lo.abs(), hi.abs())
        self.magnitude += size
        self.terms += present.to(torch.int64)
        fp32_ends = (round_to(lo, torch.float32) == lo) & (round_to(hi, torch.float32) == hi)
        self.fp32_ends &= fp32_ends
        self.known &= (lo == hi) & fp32_ends
        self.finest = torch.minimum(self.finest, torch.where(self.known, _granularity(lo), float("inf")))

    def result(self) -> Interval:
        exact = (self.fp32_ends & (self.terms <= 1)) | (self.known & (self.magnitude <= 2.0**24 * self.finest))
        slack = (self.terms + 1).to(torch.float64) * FP32_UNIT_ROUNDOFF * self.magnitude
        slack = torch.where(exact, torch.zeros_like(slack), slack)
        return Interval(self.lo - slack, self.hi + slack, self.value.clone())
