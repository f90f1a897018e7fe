"""The series' plot: median CPU time per pair per rank, the minimum of the four runs of each tree,
per level, W and path. Run from the repository root: python benchmarks/results/2026-11-28-cpu-host-time/plot.py"""

import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = pathlib.Path(__file__).parent
LEVELS = ("engine", "group", "buffer", "autograd", "training")
PATHS = ("receive", "direct", "peer")


def minima(tree: str) -> dict:
    """(level, W, path) -> the least of the four runs' medians."""
    out: dict = {}
    for i in range(1, 5):
        for p in json.loads((HERE / f"host_{tree}_{i}.json").read_text())["points"]:
            for level in LEVELS:
                if level in p:
                    key = (level, p["world_size"], p["data_path"])
                    v = p[level]["cpu_us_per_pair_per_rank"]
                    out[key] = min(out.get(key, v), v)
    return out


def main() -> None:
    before, after = minima("before"), minima("after")
    keys = [k for k in before if k in after]
    keys.sort(key=lambda k: (k[1], LEVELS.index(k[0]), PATHS.index(k[2])))
    fig, ax = plt.subplots(figsize=(12, 4.5))
    xs = range(len(keys))
    ax.bar([x - 0.2 for x in xs], [before[k] for k in keys], width=0.4, label="before (b54daf3)", color="#bbbbbb")
    ax.bar([x + 0.2 for x in xs], [after[k] for k in keys], width=0.4, label="after (98a1789)",
           color=["#d62728" if k[2] == "peer" else "#1f77b4" for k in keys])
    ax.axhline(30, color="k", lw=0.8, ls="--", label="target, 30 us")
    ax.set_xticks(list(xs), [f"W={w} {lvl}\n{path}" for lvl, w, path in keys], rotation=90, fontsize=7)
    ax.set_ylabel("CPU us per pair per rank (min of 4 runs)")
    ax.set_title("Host path per static dispatch + combine pair, launches off (CPU model, 2-core VM)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(HERE / "host_time.png", dpi=110)


if __name__ == "__main__":
    main()
