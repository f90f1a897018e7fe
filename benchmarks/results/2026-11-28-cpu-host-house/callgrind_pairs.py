"""Callgrind markers around N pairs per point: os.getppid() before and after each timed block."""
import gc, os, sys, contextlib, inspect, torch
from hybrid_ep.backends.cuda.emulation import EmulatedGroup
from hybrid_ep.bench import host as hb
hb.steady_cpu_heap()
N = int(os.environ.get("CG_N", "40"))
KW = "peer_memory_bytes" if "peer_memory_bytes" in inspect.signature(EmulatedGroup.__init__).parameters else "arena_bytes"
configs = [(1, "receive"), (1, "direct"), (1, "peer"), (8, "receive"), (8, "direct"), (8, "peer")]
order = []
for W, path in configs:
    H, T, K = 1024, 256, 8
    E = max(2 * W, K)
    peer = path == "peer"
    group = EmulatedGroup(W, H, T, E, device="cpu", data_path="direct" if peer else path, num_sms_dispatch=1,
                          num_sms_combine=1, separate_processes=peer, **{KW: hb.PEER_BYTES if peer else None})
    gen = torch.Generator().manual_seed(0)
    xs, scales = hb._inputs(W, T, H, "bf16", gen)
    idx, w = hb._routing(W, T, E, K, gen)
    static = T * K
    group.ext.set_launches_enabled(False)
    between = None
    if peer:
        group.dispatch(xs, idx, w, num_out_tokens=static)
        ledger = list(group.peer.ledger)
        def between():
            group.peer.ledger = list(ledger)
    inp = getattr(group, "in_peer_memory", None) or group.in_arena
    outs = [inp(i, torch.zeros(static, H, dtype=torch.bfloat16)) for i in range(W)]
    def group_pair():
        res = group.dispatch(xs, idx, w, num_out_tokens=static)
        group.combine(outs, [r.handle for r in res])
    levels = [("group", group_pair)]
    stack = contextlib.ExitStack()
    if W == 1:
        stack.enter_context(hb._world_of_one())
        buf = hb._single_rank_buffer(group)
        def buffer_pair():
            res = buf.dispatch(xs[0], idx[0], w[0], num_out_tokens=static)
            buf.combine(outs[0], res.handle)
        levels.append(("buffer", buffer_pair))
    for level, pair in levels:
        for _ in range(10):
            if between: between()
            pair()
        gc.collect(); gc.disable()  # no collection inside a measured block: it lands by chance
        os.getppid()
        for _ in range(N):
            if between: between()
            pair()
        os.getppid()
        gc.enable()
        order.append((W, path, level))
    group.ext.set_launches_enabled(True)
    group.close()
    stack.close()
print("ORDER", order)
