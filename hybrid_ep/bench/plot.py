"""PNG plots of a results document (matplotlib, Agg canvas; pyplot's global state is not used).

bandwidth_per_rank.png: for dispatch and combine, the algorithm bandwidth (algbw) and the
NVLink / RDMA bus bandwidth (busbw) of each rank, one bar per run (backend, SM count).
bandwidth_vs_sms.png, only when a backend that takes an SM count ran with --sms: mean
bandwidth over ranks against SMs; backends without an SM setting are drawn as dashed
horizontal lines. Every panel names its quantity and unit; a footnote defines algbw and busbw.
"""

from __future__ import annotations

import os

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .metrics import OPS
from .report import config_line, links_note, run_title

_METRICS = (("algbw_gbps", "algorithm bandwidth (algbw)"),
            ("nvlink_gbps", "NVLink bus bandwidth (busbw)"),
            ("rdma_gbps", "RDMA bus bandwidth (busbw)"))
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
        fig = Figure(figsize=figsize, layout="constrained")
    except TypeError:  # matplotlib < 3.5
        fig = Figure(figsize=figsize, constrained_layout=True)
    if h_pad is not None:
        engine = getattr(fig, "get_layout_engine", None)
        if engine is not None:
            engine().set(h_pad=h_pad)
        else:  # matplotlib < 3.6
            fig.set_constrained_layout_pads(h_pad=h_pad)
    return fig


def _save(fig: Figure, path: str) -> str:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=110)
    return path


def plot_per_rank(doc: dict, path: str) -> str:
    runs = doc["runs"]
    config = doc["metadata"]["config"]
    W = config["world_size"]
    fig = _figure((6.0 * len(_METRICS), 10.0), h_pad=0.12)
    axes = fig.subplots(len(OPS), len(_METRICS), squeeze=False)
    x = np.arange(W)
    width = 0.8 / max(1, len(runs))
    for i, op in enumerate(OPS):
        for j, (key, name) in enumerate(_METRICS):
            ax = axes[i][j]
            for k, run in enumerate(runs):
                values = [r[op][key] for r in run["ranks"]]
                ax.bar(x - 0.4 + width * (k + 0.5), values, width, label=run_title(run))
            _style(ax, f"{op}: {name}", "rank (node)", f"{name.split(' (')[0]}, GB/s")
            ax.set_xticks(x)  # then the labels: set_xticks(x, labels) needs matplotlib >= 3.5
            ax.set_xticklabels([f"{r} ({r // config['ranks_per_node']})" for r in range(W)])
            ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=_FONT["legend"])
    fig.suptitle(_title(doc, "bandwidth per rank"), fontsize=_FONT["suptitle"])
    _footnote(fig, doc)
    return _save(fig, path)


def has_sm_sweep(doc: dict) -> bool:
    return any(run["num_sms"] is not None for run in doc["runs"])


def plot_vs_sms(doc: dict, path: str) -> str:
    fig = _figure((13.0, 6.4))
    axes = fig.subplots(1, len(OPS), squeeze=False)[0]
    swept = sorted({run["backend"] for run in doc["runs"] if run["num_sms"] is not None})
    flat = [run for run in doc["runs"] if run["num_sms"] is None]
    for ax, op in zip(axes, OPS):
        for backend in swept:
            runs = sorted((r for r in doc["runs"] if r["backend"] == backend and r["num_sms"] is not None),
                          key=lambda r: r["num_sms"])
            ax.plot([r["num_sms"] for r in runs], [r["summary"][op]["mean_algbw_gbps"] for r in runs],
                    marker="o", label=f"{backend}: algbw")
            ax.plot([r["num_sms"] for r in runs], [r["summary"][op]["mean_rdma_gbps"] for r in runs],
                    marker="s", linestyle=":", label=f"{backend}: RDMA busbw")
        for run in flat:
            ax.axhline(run["summary"][op]["mean_algbw_gbps"], linestyle="--", color="gray",
                       label=f"{run_title(run)}: algbw")
        _style(ax, f"{op}: mean over ranks", "SMs per call (num_sms)", "bandwidth, GB/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=_FONT["legend"])
    fig.suptitle(_title(doc, "bandwidth vs SMs"), fontsize=_FONT["suptitle"])
    _footnote(fig, doc)
    return _save(fig, path)


def write_plots(doc: dict, out_dir: str) -> list[str]:
    paths = [plot_per_rank(doc, os.path.join(out_dir, "bandwidth_per_rank.png"))]
    if has_sm_sweep(doc):
        paths.append(plot_vs_sms(doc, os.path.join(out_dir, "bandwidth_vs_sms.png")))
    return paths
