"""Dispatch + combine pairs between callgrind markers (os.getppid() before and after each measured
block; run under valgrind --dump-before=getppid), for the points bench.host times: one tree's
EmulatedGroup (`group`) and, at W = 1, HybridEPBuffer (`buffer`), launches off. Runs on the
trees before and after the house (the peer-memory size argument was named arena_bytes before)."""

import contextlib
import gc
import inspect
import os

import torch

from hybrid_ep.backends.cuda.emulation import EmulatedGroup
from hybrid_ep.bench import host as hb

hb.steady_cpu_heap()
N = int(os.environ.get("CG_N", "40"))
SIZE_ARG = "peer_memory_bytes" if "peer_memory_bytes" in inspect.signature(EmulatedGroup.__init__).parameters \
    else "arena_bytes"
POINTS = [(1, "receive"), (1, "direct"), (1, "peer"), (8, "receive"), (8, "direct"), (8, "peer")]


def measure(pair, between) -> None:
    for _ in range(10):
        if between:
            between()
        pair()
    gc.collect()
    gc.disable()  # no collection inside a measured block: it lands by chance
    os.getppid()
    for _ in range(N):
        if between:
            between()
        pair()
    os.getppid()
    gc.enable()


def main() -> None:
    order = []
    for world, path in POINTS:
        hidden, tokens, topk = 1024, 256, 8
        experts = max(2 * world, topk)
        peer = path == "peer"
        group = EmulatedGroup(world, hidden, tokens, experts, device="cpu", data_path="direct" if peer else path,
                              num_sms_dispatch=1, num_sms_combine=1, separate_processes=peer,
                              **{SIZE_ARG: hb.PEER_BYTES if peer else None})
        gen = torch.Generator().manual_seed(0)
        xs, _ = hb._inputs(world, tokens, hidden, "bf16", gen)
        idx, w = hb._routing(world, tokens, experts, topk, gen)
        static = tokens * topk
        group.ext.set_launches_enabled(False)
        between = None
        if peer:
            group.dispatch(xs, idx, w, num_out_tokens=static)
            ledger = list(group.peer.ledger)

            def between():
                group.peer.ledger = list(ledger)
        in_block = getattr(group, "in_peer_memory", None) or group.in_arena
        outs = [in_block(i, torch.zeros(static, hidden, dtype=torch.bfloat16)) for i in range(world)]

        def group_pair():
            res = group.dispatch(xs, idx, w, num_out_tokens=static)
            group.combine(outs, [r.handle for r in res])

        measure(group_pair, between)
        order.append((world, path, "group"))
        with contextlib.ExitStack() as stack:
            if world == 1:
                stack.enter_context(hb._world_of_one())
                buf = hb._single_rank_buffer(group)

                def buffer_pair():
                    res = buf.dispatch(xs[0], idx[0], w[0], num_out_tokens=static)
                    buf.combine(outs[0], res.handle)

                measure(buffer_pair, between)
                order.append((world, path, "buffer"))
            group.ext.set_launches_enabled(True)
            group.close()
    print("ORDER", order)


if __name__ == "__main__":
    main()
