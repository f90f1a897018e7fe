"""What every rank runs: module-level functions, so ProcessGroupPool can send them by name.

`probe` reports the rank's host, device and usable backends. `run_backend` builds one
HybridEPBuffer for a backend and, for each SM count, runs dispatch then combine: warm-up
calls, then timed calls; it returns the raw samples and the traffic of the last calls.
Rank 0 prints progress on stderr.

Legend: T tokens on this rank, K routes per token, H hidden, R dispatched rows.
"""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from .. import backends
from ..buffer import HybridEPBuffer
from ..fp8 import dequantize_fp8
from ..metadata import describe_device, gpu_driver
from . import deepep
from .inputs import Progress, make_inputs, traffic_fields
from .spec import BACKENDS_WITHOUT_SMS, BENCH_BACKENDS, BenchSpec
from .timing import make_timer


def probe(spec: BenchSpec) -> dict:
    """This rank's host and device, and which backends its EP group can use."""
    group = dist.group.WORLD
    info = {"rank": dist.get_rank(group), "host": socket.gethostname()}
    if spec.shared_gpu:  # the pool sets a device per rank for NCCL groups only
        torch.cuda.set_device(info["rank"] % torch.cuda.device_count())
    if spec.device == "cuda":
        info |= {"device": describe_device("cuda"), "device_index": torch.cuda.current_device(),
                 "driver": gpu_driver()}
    else:
        info |= {"device": describe_device("cpu"), "driver": None}
    # ranks sharing a GPU form a gloo group on purpose (NCCL takes one rank per GPU)
    unavailable = {"cuda": backends.cuda_unavailable_reason(group, explicit=spec.shared_gpu),
                   deepep.NAME: deepep.unavailable_reason(spec.device)}
    info["backends"] = [name for name in BENCH_BACKENDS if unavailable.get(name) is None]
    info["unavailable"] = unavailable
    return info


def run_backend(spec: BenchSpec, backend: str) -> list[dict]:
    """One buffer for `backend`; per SM count: warm-up, then timed dispatch and combine pairs."""
    if backend == deepep.NAME:
        return deepep.run_backend(spec)
    group = dist.group.WORLD
    rank = dist.get_rank(group)
    buf = HybridEPBuffer(group, spec.hidden, spec.tokens, spec.experts,
                         ranks_per_node=spec.ranks_per_node, backend=backend)
    device = buf.device
    x, scales, topk_idx, topk_weights = make_inputs(spec, rank, device)
    timer = make_timer(group, device)
    expert_out = None  # combine input [R, H]; the routing is fixed, so R is the same every call

    results = []
    for num_sms in spec.sms_for(backend):
        if backend in BACKENDS_WITHOUT_SMS:
            sms_label = "no SM setting"
        else:
            sms_label = f"{num_sms} SMs" if num_sms is not None else "default SMs"
        progress = Progress(rank == 0, f"{backend} ({sms_label})", spec.iters)
        keys = (f"dispatch/{num_sms}", f"combine/{num_sms}")
        for phase, n in (("warm-up", spec.warmup), ("timed", spec.iters)):
            for i in range(n):
                res = timer.call(keys[0], lambda: buf.dispatch(x, topk_idx, topk_weights, scales=scales,
                                                               num_sms=num_sms), record=phase == "timed")
                dispatch_traffic = buf.last_traffic
                if expert_out is None:
                    expert_out = (dequantize_fp8(res.tokens, res.scales, spec.combine_dtype)
                                  if res.scales is not None else res.tokens.to(spec.combine_dtype))
                timer.call(keys[1], lambda: buf.combine(expert_out, res.handle, num_sms=num_sms),
                           record=phase == "timed")
                combine_traffic = buf.last_traffic
                progress.update(phase, i + 1, n)
        results.append({
            "rank": rank,
            "num_sms": num_sms,
            "timing": timer.method,
            "dispatch": {"samples_ms": timer.samples_ms(keys[0]), "traffic": traffic_fields(dispatch_traffic)},
            "combine": {"samples_ms": timer.samples_ms(keys[1]), "traffic": traffic_fields(combine_traffic)},
        })
    return results
