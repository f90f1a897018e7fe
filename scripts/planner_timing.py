"""Planning time of the checkout this script is run from, on one of the benchmark's timing loads.

`python -m tools.balancer_study.quality` times the planner once per run and pattern; on a
shared machine one slow period moves those medians. Two versions compare better
timed in turns, each in its own process, several rounds:

    for round in 1 2 3; do
      for repo in ../old ../new; do OMP_NUM_THREADS=1 python scripts/planner_timing.py --repo $repo; done
    done

The load and the +-10% perturbation are those of quality.timing (seed 0) for --pattern
(default topk-zipf-1.2; the refit's exchanges run on more layers of zipf-0.6, lognormal-1.0
or uniform-noise, the slowest with previous). --rdma-weight times the node-aware plan
(plan_placement's rdma_weight) instead; --group-limited draws the load with DeepSeek-V3's
node-limited routing (8 groups, top-4; the locality study's timing loads) from a Zipf
popularity of --zipf.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repo", default=".", help="checkout whose hybrid_ep is timed (its _planner built in place)")
    p.add_argument("--layers", type=int, default=61)
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--slots", type=int, default=320)
    p.add_argument("--tokens", type=int, default=16384, help="tokens per layer")
    p.add_argument("--pattern", default="topk-zipf-1.2", help="load pattern (quality.PATTERNS)")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--move-budget", type=float, default=None,
                   help="also time plan_placement(previous=, move_budget=) at this fraction")
    p.add_argument("--rdma-weight", type=float, default=None, help="time the node-aware plan at this weight")
    p.add_argument("--group-limited", action="store_true",
                   help="a group-limited Zipf load (8 groups, top-4 of them) instead of --pattern's")
    p.add_argument("--zipf", type=float, default=1.2, help="with --group-limited: the Zipf exponent")
    args = p.parse_args(argv)
    sys.path.insert(0, args.repo)
    from hybrid_ep.balancer.planner import plan_placement
    from tools.balancer_study.quality import PATTERNS, sample_load

    W, N, S = args.ranks, args.ranks // 8, args.slots
    if args.pattern not in PATTERNS:
        p.error(f"--pattern must be one of {', '.join(PATTERNS)}, got {args.pattern!r}")
    if args.group_limited:
        import torch

        from hybrid_ep.synthetic import sample_topk, zipf_popularity

        gen = torch.Generator().manual_seed(0)
        rows = []
        for _ in range(args.layers):
            idx = sample_topk(args.tokens, 256, 8, gen, popularity=zipf_popularity(256, args.zipf, gen), num_groups=8,
                              topk_groups=4)
            rows.append(np.bincount(idx.reshape(-1).numpy(), minlength=256))
        load = np.stack(rows).astype(np.float64)
        label = f"group-limited zipf-{args.zipf:g}"
    else:
        load = sample_load(args.pattern, args.layers, 256, 8, args.tokens, 100).numpy()
        label = args.pattern
    weight = {} if args.rdma_weight is None else {"rdma_weight": args.rdma_weight}
    perturbed = load * np.random.default_rng(0).uniform(0.9, 1.1, load.shape)
    previous = plan_placement(load, S, N, W, **weight)
    fresh, warm, capped = [], [], []
    for _ in range(args.repeats):
        t = time.process_time()
        plan_placement(perturbed, S, N, W, **weight)
        fresh.append(time.process_time() - t)
        t = time.process_time()
        plan_placement(perturbed, S, N, W, previous=previous, **weight)
        warm.append(time.process_time() - t)
        if args.move_budget is not None:
            t = time.process_time()
            plan_placement(perturbed, S, N, W, previous=previous, move_budget=args.move_budget, **weight)
            capped.append(time.process_time() - t)
    label += "" if args.rdma_weight is None else f", node-aware (rdma_weight {args.rdma_weight:g})"
    print(f"{args.repo}: {label}, {args.layers} x 256, W {W}, {N} nodes, S {S}; "
          f"CPU ms median (fastest) of {args.repeats}: "
          f"fresh {1e3 * statistics.median(fresh):.1f} ({1e3 * min(fresh):.1f}), "
          f"with previous {1e3 * statistics.median(warm):.1f} ({1e3 * min(warm):.1f})"
          + (f", with move budget {args.move_budget} {1e3 * statistics.median(capped):.1f} ({1e3 * min(capped):.1f})"
             if capped else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
