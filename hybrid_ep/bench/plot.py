"""PNG plots of a results document (matplotlib, Agg canvas; pyplot's global state is not used).

bandwidth_per_rank.png: for dispatch and combine, algbw / NVLink / RDMA bandwidth of each
rank, one bar per run (backend, SM count). bandwidth_vs_sms.png, only when a backend that
takes an SM count ran with --sms: mean bandwidth over ranks against SMs; backends without
an SM setting are drawn as dashed horizontal lines.
"""

from __future__ import annotations

import os

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .metrics import OPS
from .report import config_line, run_title

_METRICS = (("algbw_gbps", "algbw"), ("nvlink_gbps", "NVLink busbw"), ("rdma_gbps", "RDMA busbw"))


def _title(doc: dict, what: str) -> str:
    return f"hybrid-ep {what} | {doc['label']}\n{config_line(doc)}\n{doc['machine']['device']} | {doc['date']}"


def _save(fig: Figure, path: str) -> str:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=110)
    return path


def plot_per_rank(doc: dict, path: str) -> str:
    runs = doc["runs"]
    W = doc["config"]["world_size"]
    fig = Figure(figsize=(5.2 * len(_METRICS), 8.0), layout="constrained")
    axes = fig.subplots(len(OPS), len(_METRICS), squeeze=False)
    x = np.arange(W)
    width = 0.8 / max(1, len(runs))
    for i, op in enumerate(OPS):
        for j, (key, name) in enumerate(_METRICS):
            ax = axes[i][j]
            for k, run in enumerate(runs):
                values = [r[op][key] for r in run["ranks"]]
                ax.bar(x - 0.4 + width * (k + 0.5), values, width, label=run_title(run))
            ax.set_title(f"{op}: {name}")
            ax.set_xticks(x, [f"{r}\nnode {r // doc['config']['ranks_per_node']}" for r in range(W)])
            ax.set_xlabel("rank")
            ax.set_ylabel("GB/s")
            ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize="small")
    fig.suptitle(_title(doc, "bandwidth per rank"), fontsize="medium")
    return _save(fig, path)


def has_sm_sweep(doc: dict) -> bool:
    return any(run["num_sms"] is not None for run in doc["runs"])


def plot_vs_sms(doc: dict, path: str) -> str:
    fig = Figure(figsize=(11.0, 4.8), layout="constrained")
    axes = fig.subplots(1, len(OPS), squeeze=False)[0]
    swept = sorted({run["backend"] for run in doc["runs"] if run["num_sms"] is not None})
    flat = [run for run in doc["runs"] if run["num_sms"] is None]
    for ax, op in zip(axes, OPS):
        for backend in swept:
            runs = sorted((r for r in doc["runs"] if r["backend"] == backend and r["num_sms"] is not None),
                          key=lambda r: r["num_sms"])
            ax.plot([r["num_sms"] for r in runs], [r["summary"][op]["mean_algbw_gbps"] for r in runs],
                    marker="o", label=f"{backend} algbw")
            ax.plot([r["num_sms"] for r in runs], [r["summary"][op]["mean_rdma_gbps"] for r in runs],
                    marker="s", linestyle=":", label=f"{backend} RDMA busbw")
        for run in flat:
            ax.axhline(run["summary"][op]["mean_algbw_gbps"], linestyle="--", color="gray",
                       label=f"{run_title(run)} algbw")
        ax.set_title(f"{op}: mean over ranks")
        ax.set_xlabel("SMs")
        ax.set_ylabel("GB/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(_title(doc, "bandwidth vs SMs"), fontsize="medium")
    return _save(fig, path)


def write_plots(doc: dict, out_dir: str) -> list[str]:
    paths = [plot_per_rank(doc, os.path.join(out_dir, "bandwidth_per_rank.png"))]
    if has_sm_sweep(doc):
        paths.append(plot_vs_sms(doc, os.path.join(out_dir, "bandwidth_vs_sms.png")))
    return paths
