"""Studies of the balancer's planner, not used in training: the quality benchmark and what it measures against.

    python -m tools.balancer_study.quality --out DIR      # docs/benchmarks/balancer_planner.md

`quality` (the planner against EPLB and a greedy baseline: imbalance, moved slots, planning
time), `baselines` (EPLB's and the greedy plan, written from their published descriptions),
`refit_bound` (a lower bound on the slots any refit must change). The runtime balancer
(hybrid_ep.balancer) imports none of them; they live beside the package, in the checkout,
and are imported as `tools.balancer_study` from its root (`tools` is a namespace package).
"""
