"""What one benchmark run measures: a typed configuration, validated once.

The CLI resolves device-dependent defaults, builds one `BenchSpec` and sends it unchanged to
every rank. Field names are the CLI flags with '_' for '-'; every validation error names
the flag and the rule.

Legend: W ranks = N nodes x G ranks per node, E experts (L = E / W per rank), K routes per
token, T tokens per rank, H hidden size.
"""

from __future__ import annotations

import dataclasses

import torch

from ..backends import BACKENDS
from ..config import FP8_BLOCK
from ..dtypes import DISPATCH_BY_NAME as DTYPES
from ..dtypes import combine_dtype_for
from ..rows import row_bytes_rule
from ..synthetic import ROUTINGS, default_group_limit, seed_problem

# Baselines: other libraries timed beside hybrid-ep's backends (bench/deepep.py), not backends of a buffer.
BASELINES = ("deepep",)
BENCH_BACKENDS = (*BACKENDS, *BASELINES)  # every implementation ("auto" is none of its own), then the baselines
# Backends built on torch.distributed collectives have no SM count to set: run them once.
BACKENDS_WITHOUT_SMS = frozenset({"reference"})
# Evict L2 before each timed GPU call by writing this many bytes (docs/benchmarks/README.md).
L2_FLUSH_BYTES = 256 * 1024 * 1024
# Medians of at least this many timed calls (docs/benchmarks/README.md).
MIN_RECOMMENDED_ITERS = 20


class BenchArgError(ValueError):
    """A bad flag value; the message starts with the flag."""

    def __init__(self, flag: str, message: str):
        self.flag = flag
        super().__init__(f"argument {flag}: {message}")


@dataclasses.dataclass(frozen=True)
class BenchSpec:
    world_size: int
    ranks_per_node: int
    hidden: int
    tokens: int  # per rank
    topk: int
    experts: int
    dtype: str  # key of DTYPES
    routing: str  # one of synthetic.ROUTINGS
    sms: tuple[int, ...]  # SM counts to sweep; empty: the backend's default
    backends: tuple[str, ...]  # empty: every backend available on the group
    warmup: int
    iters: int
    seed: int
    device: str  # "cpu" (gloo) or "cuda" (nccl, one GPU per rank; gloo where ranks share GPUs)
    zipf_exponent: float = 1.2
    group_limit: int | None = None  # None: synthetic.default_group_limit(nodes)
    # More ranks than GPUs (device "cuda"): processes share each GPU and their group is gloo
    # (NCCL takes one rank per GPU); kernels that wait on their peers need the MPS daemon.
    shared_gpu: bool = False

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def experts_per_rank(self) -> int:
        return self.experts // self.world_size

    @property
    def topk_groups(self) -> int:
        return self.group_limit if self.group_limit is not None else default_group_limit(self.num_nodes)

    @property
    def transport(self) -> str:
        return "nccl" if self.device == "cuda" and not self.shared_gpu else "gloo"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def combine_dtype(self) -> torch.dtype:
        return combine_dtype_for(self.torch_dtype)

    def sms_for(self, backend: str) -> list[int | None]:
        """SM counts to run `backend` with; [None] = the backend's default (or it has none)."""
        if backend in BACKENDS_WITHOUT_SMS or not self.sms:
            return [None]
        return list(self.sms)

    def validate(self) -> "BenchSpec":
        # E before K: K's default is min(8, E), so E = 0 is the flag to name.
        for field, minimum in (("world_size", 1), ("ranks_per_node", 1), ("hidden", 1), ("tokens", 1),
                               ("experts", 1), ("topk", 1), ("warmup", 0), ("iters", 1)):
            value = getattr(self, field)
            if value < minimum:
                raise BenchArgError(_flag(field), f"must be >= {minimum}, got {value}")
        W, G, E = self.world_size, self.ranks_per_node, self.experts
        if W % G != 0:
            raise BenchArgError("--ranks-per-node", f"{G} must divide --world-size {W}")
        if E % W != 0:
            raise BenchArgError("--experts", f"{E} must be divisible by --world-size {W}")
        if self.topk > E:
            raise BenchArgError("--topk", f"{self.topk} must be <= --experts {E}")
        if self.dtype not in DTYPES:
            raise BenchArgError("--dtype", f"must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.dtype == "fp8" and self.hidden % FP8_BLOCK != 0:
            raise BenchArgError("--hidden", f"{self.hidden} must be a multiple of {FP8_BLOCK} with --dtype fp8")
        for dtype in dict.fromkeys((self.torch_dtype, self.combine_dtype)):
            rule = row_bytes_rule(self.hidden, dtype)
            if rule:
                raise BenchArgError("--hidden", f"{self.hidden} with --dtype {self.dtype}: {rule}")
        if self.routing not in ROUTINGS:
            raise BenchArgError("--routing", f"must be one of {', '.join(ROUTINGS)}, got {self.routing!r}")
        if not self.zipf_exponent >= 0 or self.zipf_exponent == float("inf"):
            raise BenchArgError("--zipf-exponent", f"must be a finite number >= 0, got {self.zipf_exponent}")
        if self.group_limit is not None and not 1 <= self.group_limit <= self.num_nodes:
            raise BenchArgError("--group-limit", f"must be in [1, nodes = {self.num_nodes}], got {self.group_limit}")
        per_node = E // self.num_nodes
        if self.routing == "group-limited" and self.topk > self.topk_groups * per_node:
            raise BenchArgError(
                "--topk", f"{self.topk} exceeds the experts in {self.topk_groups} nodes "
                          f"({self.topk_groups} x {per_node}) that --routing group-limited allows")
        for n in self.sms:
            if n < 1:
                raise BenchArgError("--sms", f"SM counts must be >= 1, got {n}")
        for name in self.backends:
            if name not in BENCH_BACKENDS:
                raise BenchArgError("--backends", f"must be among {', '.join(BENCH_BACKENDS)}, got {name!r}")
        problem = seed_problem(self.seed)
        if problem:
            raise BenchArgError("--seed", problem)
        if self.device not in ("cpu", "cuda"):
            raise BenchArgError("--device", f"must be cpu or cuda once resolved, got {self.device!r}")
        if self.shared_gpu and self.device != "cuda":
            raise BenchArgError("--device", "ranks share GPUs only with cuda")
        return self


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")
