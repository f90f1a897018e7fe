"""micro_tma.png: bytes per second per SM of the bulk-copy sweeps (M2), one panel per swept
setting, one line per copy pattern."""

from __future__ import annotations

import os

# The swept setting of each sweep and its axis label (csrc/microbench/sweep_copy.cuh).
SWEEPS = (("sms", "sms", "SMs at once"), ("copy_bytes", "copy_bytes", "bytes per copy"),
          ("stages", "stages", "stages"), ("depth", "depth", "store groups left reading"),
          ("pipelines", "pipelines", "pipelines per SM"))


def _pattern(r: dict) -> str:
    return r["mode"] if r["mode"] != "mix" else f"1 load + {r['fanout']} store"


def plot(records: list[dict], path: str) -> str | None:
    """Writes the PNG; None (nothing written) without matplotlib or without M2 lines."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    lines = [r for r in records if r.get("test") == "tma" and isinstance(r.get("gbps_per_sm"), (int, float))]
    if not lines:
        return None
    fig, axes = plt.subplots(1, len(SWEEPS), figsize=(4 * len(SWEEPS), 3.6), squeeze=False)
    for ax, (sweep, key, label) in zip(axes[0], SWEEPS):
        points: dict[str, list[tuple[float, float]]] = {}
        for r in lines:
            if r.get("sweep") == sweep:
                points.setdefault(_pattern(r), []).append((r[key], r["gbps_per_sm"]))
        for name, xy in sorted(points.items()):
            xy.sort()
            ax.plot([x for x, _ in xy], [y for _, y in xy], marker="o", label=name)
        ax.set_xlabel(label)
        ax.set_ylabel("GB/s per SM (loaded + stored)")
        if sweep in ("sms", "copy_bytes"):
            ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        if points:
            ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
