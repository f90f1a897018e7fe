"""`python -m harness.soak`: many dispatch + combine pairs on one emulated group, fresh
routing every call, checked against the oracle every few calls, with device memory and host RSS
recorded so that a leak, a hang or a rare wrong row shows up where a test of a few calls would
not (docs/dev/testing.md, "On one GPU").

    python -m harness.soak -w 8 --calls 2000 --data-path direct --out soak_direct
    python -m harness.soak -w 8 --ranks-per-node 4 --calls 500 --out soak_2x4
    python -m harness.soak --device cpu -w 4 --hidden 128 --tokens 24 --calls 40
    python -m harness.soak --processes -w 8 --calls 2000 --out soak_processes

--processes runs W processes, each one rank of a HybridEPBuffer kept for the whole soak, as a
training job runs (under MPS on one GPU): the calls after the first go through peer memory as a
job's do; with --backend reference and --device cpu they are gloo processes on the CPU.

Every call draws its own case from a rotation (ROTATION): uniform, Zipf, all tokens' first choice
on one expert, a quarter of the ranks without tokens, each with dynamic and with static output
sizes (static: a row budget that drops rows on some calls). Each call runs dispatch, combine and
a dispatch that reuses the handles, and synchronises, so a timeout or a bad route raises at the
call that made it. Memory is sampled at every check: the second half's peak may exceed the first
half's by at most --flat-mib, else the run fails as not flat.

Writes OUT/soak.json (arguments, device, calls done, checks, memory samples, verdict) and prints a
progress line per check. Exit status: 0 all calls ran and matched and memory stayed flat; 1 a check
failed, a call raised (a timeout included) or memory grew; 2 bad arguments; 3 the time budget ran
out first (what ran is in the JSON).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import time

import torch

from hybrid_ep.dtypes import DISPATCH_BY_NAME
from hybrid_ep.verify.cases import Case, Expected, _routing_kwargs, case_buffer, make_rank_inputs, run_call

from .emulated import check_emulated, emulated_group_for

# (routing, zero-token ranks, static size): one call's kind, in the order calls take them
ROTATION = tuple((routing, zeros, static) for static in (False, True)
                 for routing, zeros in (("uniform", False), ("zipf", False), ("one-expert", False),
                                        ("uniform", True)))
MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class MemorySample:
    call: int
    rss_bytes: int
    device_allocated: int | None = None
    device_reserved: int | None = None
    device_used: int | None = None  # total - free as the driver sees it (other processes included)


def host_rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; 0 where it is not readable)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def sample_memory(call: int, device: torch.device) -> MemorySample:
    if device.type != "cuda":
        return MemorySample(call, host_rss_bytes())
    free, total = torch.cuda.mem_get_info(device)
    return MemorySample(call, host_rss_bytes(), torch.cuda.memory_allocated(device),
                        torch.cuda.memory_reserved(device), total - free)


def call_case(args, call: int) -> Case:
    """The case of call `call`: its routing kind from ROTATION, token counts drawn per call."""
    routing, zeros, static = ROTATION[call % len(ROTATION)]
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + call)
    tokens = torch.randint(args.tokens // 2, args.tokens + 1, (args.world_size,), generator=gen)
    if call % 3 == 0:
        tokens[0] = args.tokens  # a full rank now and then: the buffer's largest call
    if zeros:
        tokens[torch.randperm(args.world_size, generator=gen)[: max(1, args.world_size // 4)]] = 0
    # static size: about the mean rows a rank receives, so the heavier ranks drop rows
    num_out = max(1, int(tokens.sum()) * args.topk // args.world_size) if static else None
    return Case(args.world_size, args.ranks_per_node, args.experts, args.hidden, tuple(int(t) for t in tokens),
                args.topk, DISPATCH_BY_NAME[args.dtype], routing=routing, num_out_tokens=num_out, backend="cuda",
                seed=args.seed * 1_000_003 + call)


def flat_verdict(samples: list[MemorySample], tolerance_bytes: int) -> dict:
    """Whether the second half's peak of each figure stays within tolerance of the first half's."""
    half = len(samples) // 2
    verdict: dict = {"tolerance_bytes": tolerance_bytes, "flat": True, "growth_bytes": {}}
    if half < 1:
        verdict["flat"] = None  # too few samples to say
        return verdict
    for name in ("rss_bytes", "device_allocated", "device_reserved"):
        first = [getattr(s, name) for s in samples[:half]]
        second = [getattr(s, name) for s in samples[half:]]
        if first[0] is None:
            continue
        growth = max(second) - max(first)
        verdict["growth_bytes"][name] = growth
        if growth > tolerance_bytes:
            verdict["flat"] = False
    return verdict


def describe_device(device: torch.device) -> dict:
    info = {"device": str(device), "torch": torch.__version__, "host": platform.node(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": os.environ.get("GPU_CHECK_COMMIT")}
    if device.type == "cuda":
        info["name"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m harness.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda: the GPU (hybrid_ep._C); cpu: the CPU model (hybrid_ep._model)")
    p.add_argument("-w", "--world-size", type=int, default=8)
    p.add_argument("--ranks-per-node", type=int, default=None, help="default: the world size (one node)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=512, help="most tokens a rank has in a call")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=None, help="default 8 x world size")
    p.add_argument("--dtype", choices=tuple(DISPATCH_BY_NAME), default="bf16")
    p.add_argument("--data-path", choices=("direct", "receive"), default=None,
                   help="the buffer's data path (default: the buffer's own choice)")
    p.add_argument("--calls", type=int, default=2000, help="dispatch + combine pairs")
    p.add_argument("--check-every", type=int, default=50, help="oracle check (and memory sample) every N calls")
    p.add_argument("--flat-mib", type=float, default=16.0,
                   help="most growth of the second half's memory peak over the first half's, MiB")
    p.add_argument("--budget-s", type=float, default=None, help="stop after this many seconds (exit 3)")
    p.add_argument("--processes", action="store_true",
                   help="one process per rank, each with its own buffer for the whole soak (run_processes)")
    p.add_argument("--backend", choices=("cuda", "reference"), default="cuda",
                   help="--processes: the buffers' backend (reference: torch.distributed, e.g. gloo on the CPU)")
    p.add_argument("--timeout-s", type=float, default=60.0,
                   help="--processes: HYBRID_EP_TIMEOUT_S of the ranks (a block of calls may take ten times it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="folder for soak.json")
    return p


def check_args(parser: argparse.ArgumentParser, args) -> None:
    args.ranks_per_node = args.ranks_per_node or args.world_size
    args.experts = args.experts or 8 * args.world_size
    for name in ("world_size", "ranks_per_node", "hidden", "tokens", "topk", "experts", "calls", "check_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.world_size % args.ranks_per_node:
        parser.error(f"--ranks-per-node ({args.ranks_per_node}) must divide --world-size ({args.world_size})")
    if args.experts % args.world_size:
        parser.error(f"--experts ({args.experts}) must be a multiple of --world-size ({args.world_size})")
    if args.topk > args.experts:
        parser.error(f"--topk ({args.topk}) must be <= --experts ({args.experts})")
    if args.data_path is not None and args.processes:
        parser.error("--data-path is the emulation's: with --processes every call takes the buffer's own path")
    if args.backend != "cuda" and not args.processes:
        parser.error("--backend reference needs --processes (the emulation runs the cuda kernels)")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device (use --device cpu for the CPU model)")


def run(args) -> tuple[int, dict]:
    """Soak the group; returns (exit status, the JSON's record)."""
    first = call_case(args, 0)
    group = emulated_group_for(dataclasses.replace(first, tokens=(args.tokens,) * args.world_size), args.device,
                               data_path=args.data_path)
    device = group.device
    record: dict = {"args": vars(args), "device": describe_device(device), "calls_done": 0, "checks_passed": 0,
                    "data_paths": {}, "samples": [], "failure": None}
    samples: list[MemorySample] = []
    start, status = time.perf_counter(), 0
    try:
        for call in range(args.calls):
            if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
                record["failure"] = f"time budget of {args.budget_s:g} s ran out after {call} calls"
                status = 3
                break
            case = call_case(args, call)
            check = (call + 1) % args.check_every == 0 or call == args.calls - 1
            res = check_emulated(group, case, check=check)
            path = res[0].handle.data_path
            record["data_paths"][path] = record["data_paths"].get(path, 0) + 1
            del res
            record["calls_done"] = call + 1
            if check:
                record["checks_passed"] += 1
                samples.append(sample_memory(call + 1, device))
                s = samples[-1]
                dev = "" if s.device_reserved is None else (
                    f", device allocated {(s.device_allocated or 0) / MIB:.1f} MiB, "
                    f"reserved {s.device_reserved / MIB:.1f}")
                print(f"soak: {call + 1}/{args.calls} calls, {record['checks_passed']} checks matched the oracle "
                      f"({time.perf_counter() - start:.1f} s; RSS {s.rss_bytes / MIB:.1f} MiB{dev})", flush=True)
    except (AssertionError, RuntimeError, ValueError) as err:
        record["failure"] = f"call {record['calls_done']} ({call_case(args, record['calls_done'])}): {err}"
        status = 1
    finally:
        group.close()
    record["wall_s"] = round(time.perf_counter() - start, 3)
    record["samples"] = [dataclasses.asdict(s) for s in samples]
    record["memory"] = flat_verdict(samples, int(args.flat_mib * MIB))
    if status == 0 and record["memory"]["flat"] is False:
        record["failure"] = f"memory grew: {record['memory']['growth_bytes']} bytes over the first half's peak"
        status = 1
    return status, record


_BUFFERS: dict[tuple, object] = {}  # this rank's buffer, by the soak's configuration (kept between blocks)


def _buffer(case: Case):
    key = (case.world_size, case.ranks_per_node, case.num_experts, case.hidden, case.backend,
           case.config.max_tokens_per_rank)
    if key not in _BUFFERS:
        _BUFFERS.clear()
        _BUFFERS[key] = case_buffer(case)
    return _BUFFERS[key]


def block_on_rank(args, sizing: Case, calls: list[int], checked: tuple[dict, torch.Tensor]) -> dict:
    """Runs on every rank: `calls` in order on the rank's kept buffer, the last one with the
    parent's inputs and experts' output; its results, every call's data path, a memory sample."""
    import torch.distributed as dist

    rank = dist.get_rank()
    buf = _buffer(sizing)
    paths = []
    for call in calls[:-1]:
        case = call_case(args, call)
        inputs = {k: None if v is None else v.to(buf.device) for k, v in make_rank_inputs(case)[rank].items()}
        rows = buf.dispatch(inputs["x"], scales=inputs["scales"], num_out_tokens=case.num_out_tokens,
                            **_routing_kwargs(case, inputs))
        buf.combine(torch.zeros(rows.tokens.shape[0], case.hidden, dtype=case.combine_dtype, device=buf.device),
                    rows.handle)
        paths.append(rows.handle.data_path)
    got = run_call(buf, call_case(args, calls[-1]), *checked)
    paths.append(got["data_path"])
    if buf.device.type == "cuda":
        torch.cuda.synchronize(buf.device)
    return {"result": got, "paths": paths, "memory": dataclasses.asdict(sample_memory(calls[-1] + 1, buf.device))}


def run_processes(args) -> tuple[int, dict]:
    """Soak W processes, each one rank with its buffer kept for the whole soak; (exit status, the
    JSON's record), as run. Calls run in blocks of --check-every on every rank at once; the last
    call of a block has its inputs and the experts' outputs made here and every rank's results
    held against the oracle (cases.Expected); memory is flat when every rank's is."""
    from hybrid_ep.spawn import ProcessGroupPool

    sizing = dataclasses.replace(call_case(args, 0), tokens=(args.tokens,) * args.world_size,
                                 backend=args.backend)
    record: dict = {"args": vars(args), "calls_done": 0, "checks_passed": 0, "data_paths": {}, "samples": [],
                    "failure": None, "processes": args.world_size}
    samples: list[list[MemorySample]] = [[] for _ in range(args.world_size)]
    start, status = time.perf_counter(), 0
    env = {"HYBRID_EP_TIMEOUT_S": str(args.timeout_s)}
    with ProcessGroupPool(args.world_size, "gloo", env=env) as pool:
        record["device"] = describe_device(torch.device(args.device))
        try:
            for first in range(0, args.calls, args.check_every):
                if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
                    record["failure"] = f"time budget of {args.budget_s:g} s ran out after {first} calls"
                    status = 3
                    break
                calls = list(range(first, min(first + args.check_every, args.calls)))
                want = Expected.of(dataclasses.replace(call_case(args, calls[-1]), backend=args.backend))
                got = pool.run(block_on_rank, [(args, sizing, calls, (want.inputs[r], want.expert_outs[r]))
                                               for r in range(args.world_size)], timeout_s=args.timeout_s * 10)
                for r, g in enumerate(got):
                    if g["paths"] != got[0]["paths"]:
                        raise AssertionError(f"calls {calls[0]}-{calls[-1]}: rank {r} took the paths {g['paths']}, "
                                             f"rank 0 {got[0]['paths']}")
                for path in got[0]["paths"]:
                    record["data_paths"][path] = record["data_paths"].get(path, 0) + 1
                record["calls_done"] = calls[-1]  # the checked call is done once it matched
                want.check_call([g["result"] for g in got], f" call {calls[-1]}")
                record["calls_done"] = calls[-1] + 1
                record["checks_passed"] += 1
                for r, g in enumerate(got):
                    samples[r].append(MemorySample(**g["memory"]))
                s = samples[0][-1]
                dev = "" if s.device_reserved is None else f", device reserved {s.device_reserved / MIB:.1f} MiB"
                print(f"soak: {record['calls_done']}/{args.calls} calls in {args.world_size} processes, "
                      f"{record['checks_passed']} checks matched the oracle ({time.perf_counter() - start:.1f} s; "
                      f"rank 0 RSS {s.rss_bytes / MIB:.1f} MiB{dev}; paths {record['data_paths']})", flush=True)
        except (AssertionError, RuntimeError, ValueError) as err:
            record["failure"] = f"call {record['calls_done']} ({call_case(args, record['calls_done'])}): {err}"
            status = 1
    record["wall_s"] = round(time.perf_counter() - start, 3)
    record["samples"] = [[dataclasses.asdict(s) for s in rank] for rank in samples]
    verdicts = [flat_verdict(rank, int(args.flat_mib * MIB)) for rank in samples]
    grown = [r for r, v in enumerate(verdicts) if v["flat"] is False]
    record["memory"] = {"flat": not grown if all(v["flat"] is not None for v in verdicts) else None,
                        "growth_bytes": verdicts[0]["growth_bytes"], "by_rank": verdicts}
    if status == 0 and grown:
        record["failure"] = f"memory grew on ranks {grown}: {[verdicts[r]['growth_bytes'] for r in grown]}"
        status = 1
    return status, record


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    if args.processes:
        status, record = run_processes(args)
    else:
        status, record = run(args)
    record["status"] = status
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "soak.json"), "w") as f:
            json.dump(record, f, indent=1)
    verdict = "passed" if status == 0 else f"FAILED: {record['failure']}"
    print(f"soak: {record['calls_done']} calls ({record['data_paths']}), {record['checks_passed']} oracle checks, "
          f"memory growth {record['memory']['growth_bytes']} B, {record['wall_s']:.1f} s: {verdict}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
