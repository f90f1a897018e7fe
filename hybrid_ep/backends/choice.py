"""What `backend="auto"` picks, and the measurement each pick rests on.

`auto` follows a rule, not a probe: it picks `cuda` for a topology only where a benchmark on
real hardware showed the kernels faster than the reference backend (NCCL's all-to-all) there;
everywhere else it picks `reference`, which is also the better-verified path. A timed probe
at buffer creation was not chosen: it would time one shape on a cold buffer, add seconds and
a collective to every buffer, and could pick differently from run to run on noise, while the
measurements that decide the question (docs/benchmarks/) are made once per hardware and kept.

`AUTO_RULES` is the one home of the rule: a new measurement flips an entry here, with the
measurement it rests on, and docs/architecture.md's "What runs where" table follows it (a
test compares the two).

A user's own measurement comes first: where `hybrid-ep-bench --calibrate` has timed both
backends at the group's topology on the same device and versions (evidence.py), auto follows
it, cuda only where it was faster, and its log line names the measurement; where the
calibration failed there, auto keeps reference and its line gives the failure.
"""

from __future__ import annotations

import dataclasses
import logging

_log = logging.getLogger("hybrid_ep")

WHERE_DOCUMENTED = "docs/architecture.md#what-runs-where"


@dataclasses.dataclass(frozen=True)
class AutoRule:
    """What auto picks for one topology, and why."""

    topology: str  # "one node" | "several nodes"
    picks: str  # "reference" | "cuda"
    evidence: str  # the measurement (device, date, numbers) the pick rests on
    source: str  # where the measurement is written down


AUTO_RULES = {
    "one node": AutoRule(
        topology="one node",
        picks="reference",
        evidence="the cuda kernels have run on one H100 only (8 ranks emulated, 2026-11-26: 24.3 GB/s "
        "dispatch, 39.6 combine per SM on the direct path); not yet timed against NCCL's all-to-all on "
        "several GPUs",
        source="benchmarks/results/2026-11-26-h100-b/README.md",
    ),
    "several nodes": AutoRule(
        topology="several nodes",
        picks="reference",
        evidence="the inter-node cuda path has not run on two real GPUs (only in single-GPU emulation "
        "and between processes sharing one H100, 2026-11-26)",
        source="benchmarks/results/2026-11-26-h100-b/README.md",
    ),
}


def topology_of(num_nodes: int) -> str:
    return "one node" if num_nodes == 1 else "several nodes"


@dataclasses.dataclass(frozen=True)
class BackendChoice:
    """The backend a buffer runs, what was asked for, and why (kept on the buffer, logged once)."""

    name: str
    asked: str
    reason: str

    def describe(self, num_nodes: int, ranks_per_node: int, members: list[int] | None = None) -> str:
        """The log line; members: the group's global ranks (one line per EP group says which)."""
        shape = f"{num_nodes} node{'s' if num_nodes > 1 else ''} x {ranks_per_node} ranks"
        group = f"EP group of ranks {ranks_text(members)} ({shape})" if members else f"EP {shape}"
        return f"hybrid_ep: backend {self.name} (asked: {self.asked}) for {group}: {self.reason}"


def ranks_text(ranks: list[int]) -> str:
    """'0-7', '0-14 step 2' (an EP group inside TP x CP), else the first ones and the count."""
    if len(ranks) == 1:
        return str(ranks[0])
    step = ranks[1] - ranks[0]
    if step > 0 and all(b - a == step for a, b in zip(ranks, ranks[1:])):
        return f"{ranks[0]}-{ranks[-1]}" + (f" step {step}" if step > 1 else "")
    return f"{', '.join(map(str, ranks[:4]))}, ... ({len(ranks)})"


def choose_auto(num_nodes: int, cuda_runs_here, evidence=None) -> BackendChoice:
    """auto's pick for a group of `num_nodes` nodes. cuda_runs_here() -> None when the cuda
    backend can run this group, else why not; it is asked only where cuda would be picked.
    evidence: the user's measurement for this group (an evidence.Measurement), or None (the rule)."""
    if evidence is not None:
        if evidence.failure is not None:
            return BackendChoice("reference", "auto", evidence.summary())
        if evidence.faster != "cuda":
            return BackendChoice("reference", "auto", f"measured here: {evidence.summary()}")
        reason = cuda_runs_here()
        if reason is None:
            return BackendChoice("cuda", "auto", f"measured faster here: {evidence.summary()}")
        return BackendChoice("reference", "auto", f"cuda cannot run here ({reason}), though measured faster: "
                                                  f"{evidence.summary()}")
    rule = AUTO_RULES[topology_of(num_nodes)]
    if rule.picks == "cuda":
        reason = cuda_runs_here()
        if reason is None:
            return BackendChoice("cuda", "auto", f"faster than reference on {rule.topology}: {rule.evidence} "
                                                 f"({rule.source})")
        return BackendChoice("reference", "auto", f"cuda cannot run here ({reason})")
    # The rule's evidence stays on the rule (and in the docs): the reason is one short log line.
    return BackendChoice("reference", "auto",
                         f"until cuda is measured faster than NCCL on {rule.topology} ({WHERE_DOCUMENTED}; "
                         f"backend='cuda' to run it)")


def log_choice(choice: BackendChoice, rank: int, num_nodes: int, ranks_per_node: int,
               members: list[int] | None = None) -> None:
    """One line per buffer, on the group's rank 0: per EP group of a job, which backend runs and why."""
    if rank == 0:
        _log.info("%s", choice.describe(num_nodes, ranks_per_node, members))
