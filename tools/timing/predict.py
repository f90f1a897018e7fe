"""Predicted dispatch and combine times at a benchmark shape, from runs of the CPU model.

The model runs the kernels at one or two token counts per rank (the bench's 4096 does not fit
every shape in this machine's memory, and the model's time grows linearly in the tokens); a
prediction at the bench's count is read off the line through the two (or is the run itself
when the counts are equal). A call's time is the sum of its launches': dispatch is the count
kernel and the dispatch kernel, combine its one kernel; each launch's own time is kept too, so a
prediction can be scored against the bench's per-kernel GPU times (kernels_ms) as well as its
call times. The host's work between them (the dispatch reads one count back to size its output)
is not in it.
"""

from __future__ import annotations

import dataclasses
from concurrent import futures as concurrent_futures

KERNELS = ("dispatch", "combine")


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the benchmark ran: W ranks as `nodes` nodes, H, tokens per rank, top-k of E, seed."""

    world_size: int
    nodes: int
    hidden: int
    tokens: int
    topk: int
    experts: int
    seed: int = 0
    dtype: str = "bf16"  # the rows' dtype: "bf16", or "fp8" (float8_e4m3fn with fp32 scales per 128)

    @classmethod
    def from_args(cls, args, world_size: int, nodes: int, experts: int | None = None) -> "Shape":
        """The shape of add_shape_arguments' options (experts: where the command derives it)."""
        return cls(world_size, nodes, args.hidden, args.tokens, args.topk,
                   args.experts if experts is None else experts, args.seed, getattr(args, "dtype", "bf16"))


def add_shape_arguments(parser, *, tokens: int, experts: int | None = 16, experts_help: str | None = None) -> None:
    """The benchmark shape's options (--hidden, --tokens, --topk, --experts, --seed), defined
    once for every timing command; the defaults are the bench's but for the token count."""
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--tokens", type=int, default=tokens, help=f"tokens per rank (default {tokens})")
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=experts, help=experts_help or f"default {experts}")
    parser.add_argument("--seed", type=int, default=0, help="routing and input seed (the bench's default 0)")


def job(shape: Shape, tokens: int, sms: list[int], tables: list[dict] | None, model_seed: int = 0,
        payload: bool = True, posted_puts: bool = False) -> dict:
    """A driver.py job for `shape` at `tokens` per rank, timed with each cost table; without
    payload the model's bulk copies move no bytes (the same times, far less memory); with
    posted_puts the puts between nodes are priced as a cluster's NIC does (driver.py)."""
    out = {"world_size": shape.world_size, "nodes": shape.nodes, "hidden": shape.hidden, "tokens": tokens,
           "topk": shape.topk, "experts": shape.experts, "seed": shape.seed, "sms": list(sms),
           "costs": tables, "model_seed": model_seed}
    if not payload:  # older checkouts' drivers (calibration builds) know no such key
        out["payload"] = False
    if shape.dtype != "bf16":  # nor this one
        out["dtype"] = shape.dtype
    if posted_puts:  # nor this one
        out["posted_puts"] = True
    return out


def call_times(result: dict, tables: int) -> dict:
    """{(sms, call): [ns of the measured call per table]} from a driver result, and per kernel
    the call launched {(sms, call, kernel): [ns of its launches per table]} (kernel: the model's
    launch name, "count", "dispatch_direct", ...)."""
    out = {}
    for run in result["runs"]:
        for call in KERNELS:
            ns = [0.0] * tables
            for launch in run[call]["launches"]:
                ns[launch["table"]] += launch["time_ns"]
                if "kernel" in launch:
                    per = out.setdefault((run["sms"], call, launch["kernel"]), [0.0] * tables)
                    per[launch["table"]] += launch["time_ns"]
            out[(run["sms"], call)] = ns
    return out


def count_run(run_job, shape: Shape, tables: list[dict], payload: bool = True) -> list[float]:
    """The count kernel's ns per table at shape.tokens, from one dispatch call there (driver.py's
    dispatch_only job, one SM per rank: the count kernel runs on one block per rank whatever the
    SMs). Its tally warps take 992 tokens a tile, so a line through runs at fewer tokens misses
    the tiles' fixed work (2026-11-27 H200, W = 2: 0.0899 ms through 128 / 256, 0.0945 at 4096)."""
    j = job(shape, shape.tokens, [1], tables, payload=payload)
    j["dispatch_only"] = True
    ns = [0.0] * len(tables)
    for launch in run_job(j)["runs"][0]["dispatch"]["launches"]:
        if launch.get("kernel") == "count":
            ns[launch["table"]] += launch["time_ns"]
    return ns


def with_count(ns: dict, count_ns: list[float]) -> dict:
    """predict's times with the count kernel's replaced by `count_ns` (per table), each dispatch
    call's time moved by the same amount."""
    out = dict(ns)
    for key in [k for k in ns if len(k) == 3 and k[1] == "dispatch" and k[2] == "count"]:
        sms = key[0]
        out[(sms, "dispatch")] = [d - c + n for d, c, n in zip(ns[(sms, "dispatch")], ns[key], count_ns)]
        out[key] = list(count_ns)
    return out


def extrapolate(t1: int, ns1: float, t2: int, ns2: float, t: int) -> float:
    """The value at t on the line through (t1, ns1) and (t2, ns2)."""
    if t1 == t2:
        return ns1
    return ns1 + (ns2 - ns1) * (t - t1) / (t2 - t1)


def predict(run_job, shape: Shape, sms: list[int], tables: list[dict], model_tokens: tuple[int, ...],
            concurrent: bool = False, payload: bool = True, posted_puts: bool = False) -> dict:
    """{(sms, call): [predicted ns at shape.tokens per table]}, and {(sms, call, kernel): [...]}
    for each kernel of the call (call_times); run_job(job) -> driver result.
    With `concurrent`, the runs at the token counts are made at once (for a run_job that runs
    each job in its own process: the model in this process is one per process)."""
    if not 1 <= len(model_tokens) <= 2:
        raise ValueError(f"model_tokens takes one or two token counts, got {model_tokens}")
    jobs = [job(shape, t, sms, tables, payload=payload, posted_puts=posted_puts) for t in model_tokens]
    if concurrent:
        with concurrent_futures.ThreadPoolExecutor(len(jobs)) as pool:
            results = list(pool.map(run_job, jobs))
    else:
        results = [run_job(j) for j in jobs]
    runs = [call_times(r, len(tables)) for r in results]
    t1, t2 = model_tokens[0], model_tokens[-1]
    return {key: [extrapolate(t1, a, t2, b, shape.tokens) for a, b in zip(runs[0][key], runs[-1][key])]
            for key in runs[0]}
