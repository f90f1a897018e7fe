"""DeepEP's intranode (normal-mode) dispatch and combine as a benchmark backend: the baseline users
compare hybrid-ep with, in the same table and results.json (`hybrid-ep-bench --backends deepep`).

Each rank times `deep_ep.Buffer` at the bench's shape with the bench's own inputs (inputs.make_inputs:
the same routing, x, fp8 scales and weights as hybrid-ep's backends get) and the same byte
accounting (hybrid_ep.traffic: one row per token and destination rank, fp8 rows with their
scales; combine sends the rows back at bf16), so algbw means the same for both. A timed dispatch
is DeepEP's count kernel plus its dispatch (HybridEPBuffer.dispatch also starts from topk_idx);
a timed combine is its combine of the dispatched rows (bf16; fp8 dequantised first, as
worker.run_backend does). DeepEP is no dependency: where `deep_ep` does not import, the backend is
unavailable and the probe says why (scripts/build_deepep_wheel.sh builds it for the GPU run).

What DeepEP's intranode kernels take (its own checks, named here by the bench's flags): 2, 4 or 8
ranks on one node, SM counts in pairs (a channel is a sending and a receiving SM), bf16 or fp8.
"""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from ..fp8 import dequantize_fp8
from ..traffic import combine_row_bytes, dispatch_row_bytes, rank_traffic, routing_row_counts
from .inputs import Progress, make_inputs, rank_routings, traffic_fields
from .spec import BenchArgError, BenchSpec

NAME = "deepep"
WORLD_SIZES = (2, 4, 8)  # the rank counts DeepEP's intranode kernels are instantiated for
DTYPES = ("bf16", "fp8")  # its dispatch takes bf16 rows, or fp8 rows with float32 scales per 128
DEFAULT_SMS = 20  # deep_ep.Buffer.num_sms before set_num_sms


def unavailable_reason(device: str) -> str | None:
    """Why this process cannot run DeepEP on `device` ("cpu" or "cuda"), or None when it can."""
    try:
        importlib.import_module("deep_ep")
    except ImportError as err:
        return f"deep_ep does not import ({err}); scripts/build_deepep_wheel.sh builds DeepEP's intranode kernels"
    if device != "cuda":
        return "DeepEP runs on CUDA devices only (--device cuda)"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    return None


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def check_spec(spec: BenchSpec) -> None:
    """Raise BenchArgError for a run DeepEP's intranode kernels cannot make."""
    if spec.world_size not in WORLD_SIZES:
        raise BenchArgError("--world-size", f"{spec.world_size} with --backends {NAME}: DeepEP's intranode kernels "
                                            f"run {', '.join(map(str, WORLD_SIZES))} ranks")
    if spec.num_nodes != 1:
        raise BenchArgError("--ranks-per-node", f"{spec.ranks_per_node} makes {spec.num_nodes} nodes; --backends "
                                                f"{NAME} runs DeepEP's intranode kernels, one node")
    if spec.dtype not in DTYPES:
        raise BenchArgError("--dtype", f"{spec.dtype} with --backends {NAME}: DeepEP dispatches {' or '.join(DTYPES)}")
    odd = [n for n in spec.sms if n % 2]
    if odd:
        raise BenchArgError("--sms", f"{', '.join(map(str, odd))} with --backends {NAME}: DeepEP runs SMs in pairs "
                                     "(a channel is a sending and a receiving SM), even counts only")


def traffic(spec: BenchSpec, rank: int) -> dict[str, dict]:
    """The bytes `rank` moves in a dispatch and in a combine, as worker.run_backend reports
    HybridEPBuffer's: from every rank's routing, which each rank draws alike (the seed)."""
    from ..config import BufferConfig

    config = BufferConfig(hidden_dim=spec.hidden, max_tokens_per_rank=spec.tokens, num_experts=spec.experts,
                          world_size=spec.world_size, ranks_per_node=spec.ranks_per_node).validate()
    counts = routing_row_counts(rank_routings(spec, spec.world_size), config)
    return {"dispatch": traffic_fields(rank_traffic("dispatch", rank, counts,
                                                    dispatch_row_bytes(spec.hidden, spec.torch_dtype))),
            "combine": traffic_fields(rank_traffic("combine", rank, counts,
                                                   combine_row_bytes(spec.hidden, spec.combine_dtype)))}


def run_backend(spec: BenchSpec) -> list[dict]:
    """One deep_ep.Buffer sized for the largest SM count; per SM count: warm-up, then timed
    dispatch and combine pairs. The same result layout as worker.run_backend."""
    import deep_ep

    from .timing import make_timer

    group = dist.group.WORLD
    rank, W = dist.get_rank(group), spec.world_size
    device = _device()
    x, scales, topk_idx, topk_weights = make_inputs(spec, rank, device)
    x_in = (x, scales.float()) if scales is not None else x
    sms = spec.sms_for(NAME)

    def configs(num_sms: int | None):
        deep_ep.Buffer.set_num_sms(num_sms or DEFAULT_SMS)
        return deep_ep.Buffer.get_dispatch_config(W), deep_ep.Buffer.get_combine_config(W)

    hidden_bytes = spec.hidden * max(x.element_size(), 2)  # its buffer holds bf16 rows at most
    nvl_bytes = max(c.get_nvl_buffer_size_hint(hidden_bytes, W) for n in sms for c in configs(n))
    buf = deep_ep.Buffer(group, nvl_bytes, 0)
    timer = make_timer(group, device)
    moved = traffic(spec, rank)
    results = []
    for num_sms in sms:
        dispatch_config, combine_config = configs(num_sms)
        progress = Progress(rank == 0, f"{NAME} ({num_sms or DEFAULT_SMS} SMs)", spec.iters)
        keys = (f"dispatch/{num_sms}", f"combine/{num_sms}")
        state: dict = {}

        def dispatch():
            per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, spec.experts)
            out = buf.dispatch(x_in, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                               num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights,
                               config=dispatch_config)
            state["recv"], state["weights"], state["handle"] = out[0], out[2], out[4]

        for phase, n in (("warm-up", spec.warmup), ("timed", spec.iters)):
            for i in range(n):
                timer.call(keys[0], dispatch, record=phase == "timed")
                if "rows" not in state:  # the routing is fixed: the combine input is made once
                    recv = state["recv"]
                    state["rows"] = (dequantize_fp8(recv[0], recv[1], spec.combine_dtype) if isinstance(recv, tuple)
                                     else recv.to(spec.combine_dtype))
                timer.call(keys[1], lambda: buf.combine(state["rows"], state["handle"], state["weights"],
                                                        config=combine_config), record=phase == "timed")
                progress.update(phase, i + 1, n)
        results.append({
            "rank": rank, "num_sms": num_sms, "timing": timer.method,
            "dispatch": {"samples_ms": timer.samples_ms(keys[0]), "traffic": moved["dispatch"]},
            "combine": {"samples_ms": timer.samples_ms(keys[1]), "traffic": moved["combine"]},
        })
    return results
