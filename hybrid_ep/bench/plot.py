"""PNG plots of a results document (hybrid_ep.figures: matplotlib, the plots extra).

bandwidth_per_rank.png: for dispatch and combine, the algorithm bandwidth (algbw) and the
NVLink / RDMA bus bandwidth (busbw) of each rank, one bar per run (backend, SM count); the
legend sits above the panels, and from W = 17 on every panel has its own row, wider with W.
bandwidth_vs_sms.png, only when a backend that takes an SM count ran with --sms: mean algbw
and NVLink / RDMA busbw over ranks against SMs; backends without an SM setting are drawn as
dashed horizontal lines (algbw). A busbw that is 0 everywhere (one node: no RDMA) is not drawn
and the legend says so. Every panel names its quantity and unit; a footnote defines algbw and busbw.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np

from ..figures import new_figure, save_png
from .metrics import OPS
from .report import config_line, links_note, run_title

if TYPE_CHECKING:
    from matplotlib.figure import Figure

_METRICS = (("algbw_gbps", "algorithm bandwidth (algbw)"),
            ("nvlink_gbps", "NVLink bus bandwidth (busbw)"),
            ("rdma_gbps", "RDMA bus bandwidth (busbw)"))
_DPI = 110
_FONT = {"title": 12, "label": 11, "tick": 10, "legend": 9, "suptitle": 12, "note": 9.5}
_DEFINITIONS = ("algbw: rows the rank receives in dispatch (one per token and destination rank) x row bytes / time; "
                "combine sends the same rows back.\n"
                "busbw (bus bandwidth): bytes the rank sends on that link under the hierarchical scheme / time. "
                "GB/s = 1e9 bytes/s.")


def _title(doc: dict, what: str) -> str:
    meta = doc["metadata"]
    return f"hybrid-ep {what} | {doc['label']}\n{config_line(doc)}\n{meta['device']} | {meta['date']}"


def _footnote(fig: Figure, doc: dict) -> None:
    """What algbw and busbw are, and on CPU that no byte took NVLink or RDMA (below the panels)."""
    note = links_note(doc)
    text = _DEFINITIONS + (f"\n{note}" if note else "")
    fig.supxlabel(text, x=0.01, ha="left", fontsize=_FONT["note"], linespacing=1.4)


def _style(ax, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title, fontsize=_FONT["title"])
    ax.set_xlabel(xlabel, fontsize=_FONT["label"])
    ax.set_ylabel(ylabel, fontsize=_FONT["label"])
    ax.tick_params(labelsize=_FONT["tick"])


def _figure(figsize: tuple[float, float], h_pad: float | None = None) -> Figure:
    """A constrained-layout figure on any matplotlib setup.py allows (no version pinned):
    layout="constrained" and get_layout_engine are matplotlib 3.5 / 3.6."""
    try:
        fig = new_figure(figsize=figsize, layout="constrained")
    except TypeError:  # matplotlib < 3.5
        fig = new_figure(figsize=figsize, constrained_layout=True)
    if h_pad is not None:
        engine = getattr(fig, "get_layout_engine", None)
        if engine is not None:
            engine().set(h_pad=h_pad)
        else:  # matplotlib < 3.6
            fig.set_constrained_layout_pads(h_pad=h_pad)
    return fig


# Per-rank figure: up to _GRID_MAX_RANKS ranks the six panels form a grid (ops x metrics); beyond,
# one panel per row, as wide as the ranks need up to _MAX_WIDTH inches (bars stay a few pixels wide
# at W = 256), with rank labels thinned to what fits upright.
_GRID_MAX_RANKS = 16
_MIN_WIDTH = 14.0  # the title and the footnote's lines fit
_MAX_WIDTH = 26.0
_LEGEND_COLUMNS = 4
_LABEL_PX = 16  # room for one rank label, rotated upright, at the tick font size and _DPI


def unused_links(doc: dict, values) -> dict[str, str]:
    """{metric key: why it is not drawn} for the busbw metrics whose every value is 0: a link the
    run's bytes did not take (one node: no RDMA; one rank per node: no NVLink).
    values(key) -> every number of that metric the plot would draw."""
    config = doc["metadata"]["config"]
    why = {"nvlink_gbps": ("NVLink", "one rank per node" if config["ranks_per_node"] == 1 else "no rank sent on it"),
           "rdma_gbps": ("RDMA", "one node" if config["nodes"] == 1 else "no rank sent on it")}
    return {key: f"{link} busbw: 0 ({reason}), not drawn" for key, (link, reason) in why.items()
            if all(v == 0 for v in values(key))}


def _tick_step(num_ranks: int, panel_inches: float) -> int:
    """Label every step-th rank (a power of two) so that the upright labels fit the panel."""
    fits = max(1, int(panel_inches * _DPI / _LABEL_PX))
    step = 1
    while -(-num_ranks // step) > fits:
        step *= 2
    return step


def _per_rank_layout(W: int, num_runs: int) -> tuple[int, int, float, float]:
    """(rows, columns, panel width, panel height) in inches for the per-rank figure."""
    if W <= _GRID_MAX_RANKS:
        return len(OPS), len(_METRICS), 6.0, 3.6
    width = min(_MAX_WIDTH, max(_MIN_WIDTH, 3.0 + 0.12 * W * num_runs ** 0.5))
    return len(OPS) * len(_METRICS), 1, width, 2.6


def plot_per_rank(doc: dict, path: str) -> str:
    runs = doc["runs"]
    config = doc["metadata"]["config"]
    W, G = config["world_size"], config["ranks_per_node"]
    nrows, ncols, panel_w, panel_h = _per_rank_layout(W, len(runs))
    legend_rows = -(-len(runs) // _LEGEND_COLUMNS)
    legend_h = 0.3 * legend_rows + 0.15
    fig = _figure((panel_w * ncols, panel_h * nrows + legend_h + 2.4), h_pad=0.12)
    # The legend gets its own row above the panels, so that it covers no bar.
    grid = fig.add_gridspec(nrows + 1, ncols, height_ratios=[legend_h] + [panel_h] * nrows)
    panels = [(op, key, name) for op in OPS for key, name in _METRICS]
    skipped = unused_links(doc, lambda key: [r[op][key] for run in runs for r in run["ranks"] for op in OPS])
    x = np.arange(W)
    width = 0.8 / max(1, len(runs))
    step = _tick_step(W, panel_w)
    handles = []
    for n, (op, key, name) in enumerate(panels):
        ax = fig.add_subplot(grid[1 + n // ncols, n % ncols])
        if key in skipped:  # all 0: an empty panel that says why
            ax.text(0.5, 0.5, skipped[key], transform=ax.transAxes, ha="center", va="center",
                    fontsize=_FONT["label"], color="0.35")
            ax.set_yticks([])
        else:
            for k, run in enumerate(runs):
                values = [r[op][key] for r in run["ranks"]]
                bars = ax.bar(x - 0.4 + width * (k + 0.5), values, width, label=run_title(run))
                if n == 0:
                    handles.append(bars)
            ax.set_ylim(bottom=0)
        _style(ax, f"{op}: {name}", "rank (node)", f"{name.split(' (')[0]}, GB/s")
        ax.set_xlim(-0.6, W - 0.4)
        ticks = x[::step]
        ax.set_xticks(ticks)  # then the labels: set_xticks(x, labels) needs matplotlib >= 3.5
        ax.set_xticklabels([f"{r} ({r // G})" for r in ticks], rotation=0 if W <= 8 else 90)
        if step > 1:
            ax.set_xticks(x, minor=True)
        if G < W:  # node boundaries
            for b in range(G, W, G):
                ax.axvline(b - 0.5, color="0.75", linewidth=0.8, zorder=0)
        ax.grid(axis="y", alpha=0.3)
    legend_ax = fig.add_subplot(grid[0, :])
    legend_ax.axis("off")
    legend_ax.legend(handles, [run_title(run) for run in runs], loc="center", fontsize=_FONT["legend"],
                     ncol=min(len(runs), _LEGEND_COLUMNS), frameon=False)
    fig.suptitle(_title(doc, "bandwidth per rank"), fontsize=_FONT["suptitle"])
    _footnote(fig, doc)
    return save_png(fig, path, _DPI)


def has_sm_sweep(doc: dict) -> bool:
    return any(run["num_sms"] is not None for run in doc["runs"])


# Series of the SM sweep per swept backend: (summary key, metric key, label, marker, line style).
_SWEEP_SERIES = (("mean_algbw_gbps", "algbw_gbps", "algbw", "o", "-"),
                 ("mean_nvlink_gbps", "nvlink_gbps", "NVLink busbw", "^", "--"),
                 ("mean_rdma_gbps", "rdma_gbps", "RDMA busbw", "s", ":"))


def plot_vs_sms(doc: dict, path: str) -> str:
    fig = _figure((13.0, 6.4))
    axes = fig.subplots(1, len(OPS), squeeze=False)[0]
    swept = sorted({run["backend"] for run in doc["runs"] if run["num_sms"] is not None})
    flat = [run for run in doc["runs"] if run["num_sms"] is None]
    sweep_runs = [run for run in doc["runs"] if run["num_sms"] is not None]
    by_metric = {metric: summary for summary, metric, *_ in _SWEEP_SERIES}
    skipped = unused_links(doc, lambda key: [run["summary"][op][by_metric[key]] for run in sweep_runs for op in OPS])
    for ax, op in zip(axes, OPS):
        for b, backend in enumerate(swept):
            runs = sorted((r for r in sweep_runs if r["backend"] == backend), key=lambda r: r["num_sms"])
            for summary, metric, label, marker, style in _SWEEP_SERIES:
                if metric in skipped:
                    continue
                ax.plot([r["num_sms"] for r in runs], [r["summary"][op][summary] for r in runs], color=f"C{b}",
                        marker=marker, linestyle=style, label=f"{backend}: {label}")
        for run in flat:
            ax.axhline(run["summary"][op]["mean_algbw_gbps"], linestyle="--", color="gray",
                       label=f"{run_title(run)}: algbw")
        for why in skipped.values():  # say what is missing, in the legend
            ax.plot([], [], linestyle="none", label=why)
        _style(ax, f"{op}: mean over ranks", "SMs per call (num_sms)", "bandwidth, GB/s")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=_FONT["legend"])
    fig.suptitle(_title(doc, "bandwidth vs SMs"), fontsize=_FONT["suptitle"])
    _footnote(fig, doc)
    return save_png(fig, path, _DPI)


def write_plots(doc: dict, out_dir: str) -> list[str]:
    paths = [plot_per_rank(doc, os.path.join(out_dir, "bandwidth_per_rank.png"))]
    if has_sm_sweep(doc):
        paths.append(plot_vs_sms(doc, os.path.join(out_dir, "bandwidth_vs_sms.png")))
    return paths
