"""The soak with one process per rank (`python -m hybrid_ep.testing.soak --processes`), as a
training job runs: each rank one HybridEPBuffer in its own process, kept for the whole soak, so
that the calls after the first go through peer memory the way a job's do (grown on demand,
announced on the count exchange, the direct path where every rank can take it).

Calls run in blocks of --check-every on every rank at once (one pool task per block); the last
call of a block has its inputs and the experts' outputs made in the parent, and every rank's
results of it are held against the dense oracle there (cases.Expected). The other calls of a
block draw their inputs on the ranks from the same rotation (soak.call_case), so nothing but the
checked call's tensors crosses between processes. Each rank samples its memory at every check;
the soak is flat when every rank's second-half peak stays within --flat-mib of its first half's.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from .cases import Case, Expected, _routing_kwargs, case_buffer, make_rank_inputs, run_call

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

    from .soak import call_case, sample_memory

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


def run(args) -> tuple[int, dict]:
    """Soak W processes; (exit status, the JSON's record), as soak.run."""
    from ..spawn import ProcessGroupPool
    from .soak import MIB, MemorySample, call_case, describe_device, flat_verdict

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
