"""Host reads per training step on the peer path (ranks in separate processes, emulated): L MoE
layers of differentiable dispatch + combine, then backward, as many steps; per step, the reads the
agreement decided in forward and in backward, the direct dispatches and the peer memory. A read is
a host synchronisation on a GPU. Run from the repository root:

    python benchmarks/results/2026-11-28-cpu-host-time/reads_per_step.py --size dynamic
    python benchmarks/results/2026-11-28-cpu-host-time/reads_per_step.py --size static
"""

import argparse
import json
import pathlib
import sys

import torch

from hybrid_ep.backends.cuda.emulation import EmulatedGroup


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=("dynamic", "static"), required=True)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    torch.set_num_threads(1)
    # fp32 rows of 8 KiB, 256 tokens top-2 on 2 ranks: a block of a few MiB, several of peer
    # memory's 2 MiB chunks, as at a real layer's size (there: hundreds of MiB)
    W, H, T, K, E, L = 2, 2048, 256, 2, 4, args.layers
    static = None if args.size == "dynamic" else W * T * K
    group = EmulatedGroup(W, H, T, E, device="cpu", data_path="direct", num_sms_dispatch=1, num_sms_combine=1,
                          separate_processes=True)
    gen = torch.Generator().manual_seed(0)
    steps = []
    try:
        for n in range(args.steps):
            h = [torch.randn(T, H, generator=gen, requires_grad=True) for _ in range(W)]
            reads, directs, paths = group.peer.reads, group.peer.directs, []
            for _ in range(L):
                idx = [torch.argsort(torch.rand(T, E, generator=gen), dim=1)[:, :K].contiguous() for _ in range(W)]
                ws = [torch.rand(T, K, generator=gen, requires_grad=True) for _ in range(W)]
                rows, probs, handles = group.dispatch_autograd(h, idx, ws, num_out_tokens=static)
                paths.append(handles[0].data_path)
                h = group.combine_autograd([r * 1.5 for r in rows], probs, handles, apply_probs=True)
            forward_reads = group.peer.reads - reads
            sum(y.sum() for y in h).backward()
            steps.append({"step": n, "forward_paths": paths, "forward_reads": forward_reads,
                          "backward_reads": group.peer.reads - reads - forward_reads,
                          "dispatches": 2 * L, "direct_dispatches": group.peer.directs - directs,
                          "peer_memory_mib": [m.extent >> 20 for m in group.peer.own]})
            print(json.dumps(steps[-1]))
    finally:
        group.close()
    out = pathlib.Path(__file__).parent / f"reads_per_step_{args.size}.json"
    out.write_text(json.dumps({"command": " ".join(sys.argv), "world_size": W, "hidden": H, "tokens": T, "topk": K,
                               "experts": E, "layers": L, "num_out_tokens": static, "steps": steps}, indent=1) + "\n")


if __name__ == "__main__":
    main()
