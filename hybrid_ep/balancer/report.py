"""Balancer reports: statistics files, a JSON summary and PNG plots (matplotlib, Agg canvas).

The statistics file is what training writes and the offline CLI reads (`.npz`):
  load [L, E] float64       tokens per expert over the aggregation window
  history [T, L, E]         tokens per expert per reduction interval, finite, >= 0 (optional)
  steps [T] int64           training step of each history row, one per row (optional)
  ep_size                   EP size at collection time, an integer >= 1 (optional scalar)
  layer_numbers [L] int64   model layer number of each MoE layer, >= 1 (optional)
Plots are drawn on hybrid_ep.figures (matplotlib, the plots extra, imported when one is drawn).
Legend: T intervals, L layers, E experts, W ranks.
"""

from __future__ import annotations

import json
import logging
import math
import os
import zipfile

import numpy as np

from ..figures import matplotlib_part, new_figure, plots_missing, save_png
from ..logs import log_once
from ..metadata import metadata
from ..wording import byte_unit, plural
from .metrics import SUMMARY_CONFIG_KEYS, SUMMARY_UNITS

_PANEL_COLUMNS = 8  # panels per row of a heatmap: 61 layers -> 8 x 8 small panels
# Bytes a moved slot carries per expert parameter: bf16 weight (2), fp32 main weight (4),
# Adam's two fp32 moments (8). Mixed-precision training with Adam; pass your own otherwise.
DEFAULT_BYTES_PER_PARAM = 2 + 4 + 8


def slot_bytes(params_per_slot: int, bytes_per_param: int = DEFAULT_BYTES_PER_PARAM) -> int:
    """Bytes one slot's migration moves: its expert's parameters x bytes per parameter."""
    for name, value in (("params_per_slot", params_per_slot), ("bytes_per_param", bytes_per_param)):
        if int(value) != value or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(params_per_slot) * int(bytes_per_param)


def save_statistics(path: str, load, history=None, steps=None, ep_size: int | None = None,
                    layer_numbers=None) -> str:
    """Write a statistics file (format above); arrays may be torch or numpy."""
    load_LE = _as_array(load, np.float64, "load")
    if load_LE.ndim != 2:
        raise ValueError(f"load must be [layers, experts], got shape {load_LE.shape}")
    arrays = {"load": load_LE}
    if history is not None:
        hist = _as_array(history, np.float64, "history")
        if hist.ndim != 3 or hist.shape[1:] != load_LE.shape:
            raise ValueError(f"history must be [T, {load_LE.shape[0]}, {load_LE.shape[1]}], got {hist.shape}")
        arrays["history"] = hist
    if steps is not None:
        arrays["steps"] = _as_array(steps, np.int64, "steps").reshape(-1)
        if history is not None and arrays["steps"].shape[0] != arrays["history"].shape[0]:
            raise ValueError(f"steps has {arrays['steps'].shape[0]} entries, history has "
                             f"{arrays['history'].shape[0]} rows")
    if ep_size is not None:
        arrays["ep_size"] = np.int64(ep_size)
    if layer_numbers is not None:
        arrays["layer_numbers"] = _as_array(layer_numbers, np.int64, "layer_numbers").reshape(-1)
        if arrays["layer_numbers"].shape[0] != load_LE.shape[0]:
            raise ValueError(f"layer_numbers has {arrays['layer_numbers'].shape[0]} entries, load has "
                             f"{load_LE.shape[0]} layers")
    with open(path, "wb") as f:  # a file object: np.savez would append .npz to a bare name
        np.savez(f, **arrays)
    return path


def load_statistics(path: str) -> dict:
    """Read a statistics file: {'load', and 'history', 'steps', 'ep_size', 'layer_numbers' if present}.

    Every field is converted and checked here, each failure a ValueError naming the file and
    the field: the CLI and training's resumed reports catch ValueError, while a string, NaN or
    a steps/history mismatch left for later died there with a TypeError or IndexError (or, for
    layer numbers 1.5, was truncated into a placement for layer 1)."""
    with open(path, "rb") as f:
        start = f.read(len(_NPZ_MAGIC))
    if start != _NPZ_MAGIC:
        kind = "one .npy array" if start.startswith(b"\x93NUMPY") else _what_file_starts_with(start)
        raise ValueError(f"{path}: not a statistics file (an .npz with a 'load' array, as training's "
                         f"statistics.npz), got {kind}")
    try:
        data = np.load(path, allow_pickle=False)
    except zipfile.BadZipFile as exc:  # the zip signature, then no readable archive
        raise ValueError(f"{path}: not a statistics file: a damaged .npz ({exc})") from exc
    with data:
        if "load" not in data:
            raise ValueError(f"{path}: no 'load' array (keys: {sorted(data.files)})")
        out = {key: data[key] for key in data.files}
    out["load"] = _read_load(path, out["load"])
    if "history" in out:
        out["history"] = _read_history(path, out["history"], out["load"].shape)
    if "steps" in out:
        out["steps"] = _read_steps(path, out["steps"], out.get("history"))
    if "ep_size" in out:
        out["ep_size"] = _read_ep_size(path, out["ep_size"])
    if "layer_numbers" in out:
        out["layer_numbers"] = _read_layer_numbers(path, out["layer_numbers"], out["load"].shape[0])
    return out


_NPZ_MAGIC = b"PK\x03\x04"  # numpy's .npz is a zip archive


def _what_file_starts_with(start: bytes) -> str:
    """A short description of a file that is not an .npz, for the error that refuses it."""
    if not start:
        return "an empty file"
    if start.lstrip()[:1] in (b"{", b"["):
        return "a JSON file"
    if all(32 <= b < 127 or b in b"\t\r\n" for b in start):
        return "a text file"
    return "a file of another kind"


def _numbers(path: str, name: str, value: np.ndarray, dtype=np.float64) -> np.ndarray:
    """value as finite numbers of dtype; strings, objects and booleans (a hand-made or foreign
    file) are refused by name instead of failing later inside numpy or the planner. An integer
    dtype takes only whole values: 1.5 is refused, not truncated."""
    if value.dtype.kind not in "iuf":
        raise ValueError(f"{path}: {name} must hold numbers, got dtype {value.dtype}")
    if not np.isfinite(value).all():
        raise ValueError(f"{path}: {name} must be finite, got {value[~np.isfinite(value)].flat[0]}")
    if np.dtype(dtype).kind == "i" and value.dtype.kind == "f" and (value != np.round(value)).any():
        raise ValueError(f"{path}: {name} must hold integers, got {value[value != np.round(value)].flat[0]}")
    return value.astype(dtype)


def _read_load(path: str, value: np.ndarray) -> np.ndarray:
    """[L, E] float64 (a single layer's [E] as [1, E])."""
    load = _numbers(path, "load", value)
    if load.ndim == 1:
        load = load[None, :]
    if load.ndim != 2:
        raise ValueError(f"{path}: load must be [layers, experts], got shape {load.shape}")
    if 0 in load.shape:
        raise ValueError(f"{path}: load must hold at least one layer and one expert, got shape {load.shape}")
    return load


def _read_history(path: str, value: np.ndarray, load_shape: tuple) -> np.ndarray:
    """[T, L, E] token counts, as save_statistics writes them: finite and >= 0."""
    history = _numbers(path, "history", value)
    if history.ndim != 3 or history.shape[1:] != load_shape:
        raise ValueError(f"{path}: history has shape {history.shape}, expected [T, {load_shape[0]}, "
                         f"{load_shape[1]}] (reductions, layers, experts)")
    if (history < 0).any():
        raise ValueError(f"{path}: history must be token counts >= 0, got {history[history < 0].flat[0]}")
    return history


def _read_steps(path: str, value: np.ndarray, history: np.ndarray | None) -> np.ndarray:
    """[T] int64, one per history row: training selects history rows by their steps."""
    steps = _numbers(path, "steps", value, np.int64)
    if steps.ndim != 1:
        raise ValueError(f"{path}: steps must be one step per history row, got shape {steps.shape}")
    if history is not None and steps.shape[0] != history.shape[0]:
        raise ValueError(f"{path}: steps has {steps.shape[0]} entries, history has {history.shape[0]} rows")
    return steps


def _read_ep_size(path: str, value: np.ndarray) -> int:
    """One integer >= 1; named as the file's field, since the CLI's --ep-size may be absent."""
    whole = (value.dtype.kind in "iuf" and value.ndim == 0 and bool(np.isfinite(value))
             and float(value) == int(value) and int(value) >= 1)
    if not whole:
        raise ValueError(f"{path}: ep_size must be one integer >= 1, got {value.tolist()!r}")
    return int(value)


def _read_layer_numbers(path: str, value: np.ndarray, num_layers: int) -> np.ndarray:
    """[L] int64 >= 1: Megatron counts layers from 1, and placement files are matched by them."""
    numbers = _numbers(path, "layer_numbers", value, np.int64)
    if numbers.shape != (num_layers,):
        raise ValueError(f"{path}: layer_numbers has shape {numbers.shape}, load has {num_layers} layers")
    if (numbers < 1).any():
        raise ValueError(f"{path}: layer_numbers must be >= 1 (Megatron counts layers from 1), got "
                         f"{numbers.tolist()}")
    return numbers


def write_heatmap(history, path: str, layer_names=None, title: str = "tokens per rank",
                  vmax: float | None = None) -> str:
    """One PNG: per layer a heatmap of history [T, L, W] (intervals down, ranks across).

    All panels share one colour scale (0 .. vmax, default the maximum), so hot ranks stand
    out across layers and two heatmaps written with the same vmax compare directly.
    """
    hist = _as_array(history, np.float64, "history")
    if hist.ndim != 3:
        raise ValueError(f"history must be [iterations, layers, ranks], got shape {hist.shape}")
    T, L, W = hist.shape
    names = list(layer_names) if layer_names is not None else [f"layer {i}" for i in range(1, L + 1)]
    if len(names) != L:
        raise ValueError(f"layer_names has {len(names)} entries, history has {L} layers")
    cols = min(_PANEL_COLUMNS, L)
    rows = math.ceil(L / cols)
    fig = new_figure(figsize=(2.6 * cols + 1.6, 2.2 * rows + 1.2))
    MaxNLocator = matplotlib_part("ticker").MaxNLocator
    top = vmax if vmax is not None else float(hist.max()) if hist.size else 1.0
    image = None
    for i in range(L):
        ax = fig.add_subplot(rows, cols, i + 1)
        image = ax.imshow(hist[:, i, :], aspect="auto", interpolation="nearest", cmap="viridis",
                          vmin=0.0, vmax=max(top, 1e-12), origin="upper")
        ax.set_title(str(names[i]), fontsize=10)
        ax.tick_params(labelsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(nbins=4, integer=True, min_n_ticks=1))
        ax.yaxis.set_major_locator(MaxNLocator(nbins=4, integer=True, min_n_ticks=1))
        if i % cols == 0:
            ax.set_ylabel("interval", fontsize=9)
        if i + cols >= L:  # lowest panel of its column
            ax.set_xlabel("EP rank", fontsize=9)
    fig.suptitle(f"{title} ({plural(T, 'interval')} x {plural(W, 'rank')})", fontsize=13)
    # margins in inches, so one row of panels keeps room for its axis labels
    fig.subplots_adjust(left=0.06, right=0.88, bottom=0.7 / fig.get_figheight(), top=1 - 1.0 / fig.get_figheight(),
                        hspace=0.7, wspace=0.35)
    cax = fig.add_axes([0.91, 0.12, 0.015, 0.72])
    bar = fig.colorbar(image, cax=cax)
    bar.set_label("tokens routed to the rank in one interval", fontsize=10)
    bar.ax.tick_params(labelsize=9)
    return save_png(fig, path)


def write_imbalance_plot(summary: dict, path: str, bytes_per_slot: int | None = None) -> str:
    """Bars per layer of rank and slot imbalance before and after, and slots moved, from
    metrics.summarize; with bytes_per_slot (slot_bytes) the moved bytes too. Layers are
    labelled by summary["layer_numbers"] (the model's numbers, as in the CLI's table) when
    it has them, else numbered from 1."""
    L = len(summary["imbalance_rank_after"])
    x = np.arange(1, L + 1)
    numbers = [int(n) for n in summary.get("layer_numbers", x)]
    if len(numbers) != L:
        raise ValueError(f"summary['layer_numbers'] has {len(numbers)} entries for {L} layers")
    fig = new_figure(figsize=(max(7.0, 0.22 * L + 2.5), 8.5))
    for row, level in enumerate(("rank", "slot")):
        ax = fig.add_subplot(3, 1, row + 1)
        ax.bar(x - 0.2, summary[f"imbalance_{level}_before"], width=0.4, label="before", color="tab:red")
        ax.bar(x + 0.2, summary[f"imbalance_{level}_after"], width=0.4, label="after", color="tab:green")
        ax.set_ylabel(f"{level} imbalance\n(max - mean) / mean", fontsize=10)
        _from_zero(ax, max(max(summary[f"imbalance_{level}_before"]), max(summary[f"imbalance_{level}_after"])), 0.01)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=9)
    ax = fig.add_subplot(3, 1, 3)
    moves = np.asarray(summary["moves"], dtype=np.int64)
    ax.bar(x, moves, width=0.6, color="tab:blue")
    ax.set_ylabel("slots moved", fontsize=10)
    _from_zero(ax, float(moves.max(initial=0)), 1.0)
    ax.grid(axis="y", alpha=0.3)
    total = f"{int(moves.sum())} slots moved"
    if bytes_per_slot is not None:
        scale, unit = byte_unit(float(moves.max(initial=0)) * bytes_per_slot)
        right = ax.twinx()
        right.set_ylim(ax.get_ylim()[0] * bytes_per_slot / scale, ax.get_ylim()[1] * bytes_per_slot / scale)
        right.set_ylabel(f"moved ({unit})", fontsize=10)
        t_scale, t_unit = byte_unit(float(moves.sum()) * bytes_per_slot)
        total += f" = {moves.sum() * bytes_per_slot / t_scale:.3g} {t_unit} ({bytes_per_slot} B per slot)"
    ax.set_title(total, fontsize=10)
    ax.set_xlabel("layer", fontsize=10)
    ticks = np.arange(1, L + 1, max(1, math.ceil(L / 20)))
    for a in fig.axes:
        a.set_xlim(0.3, L + 0.7)
        a.set_xticks(ticks)
        a.set_xticklabels([str(numbers[t - 1]) for t in ticks])
        a.tick_params(labelsize=9)
    fig.suptitle(f"balancer: {plural(summary['num_experts'], 'expert')} in {plural(summary['num_slots'], 'slot')} "
                 f"on {plural(summary['num_ranks'], 'rank')} ({plural(summary['num_nodes'], 'node')})", fontsize=11)
    fig.tight_layout()
    return save_png(fig, path)


def _from_zero(ax, top: float, least: float) -> None:
    """y from 0, with room above the tallest bar; all-zero bars (nothing moved) keep a
    positive axis instead of matplotlib's symmetric one around 0."""
    ax.set_ylim(0.0, max(top * 1.08, least))


BYTES_UNITS = {
    "bytes_per_slot": "bytes one moved slot carries (weights, master copy, optimizer state)",
    "moved_bytes": "bytes per layer: moves x bytes_per_slot, what one EP group's migration carries",
    "moved_bytes_total": "bytes, the sum of moved_bytes",
}


def write_report(summary: dict, directory: str, history=None, step: int | None = None,
                 history_before=None, layer_names=None, bytes_per_slot: int | None = None) -> dict[str, str]:
    """Write summary JSON, the imbalance plot and, with history [T, L, W] tokens per rank
    under the new placement (and history_before under the old one), heatmaps (the plots where
    matplotlib is installed, else one logged line says so); return {kind: path}. step, when
    given, is recorded and suffixes the file names. bytes_per_slot (see slot_bytes): adds
    moved_bytes per layer and in total to the JSON and the plot.
    """
    if bytes_per_slot is not None and (int(bytes_per_slot) != bytes_per_slot or bytes_per_slot < 1):
        raise ValueError(f"bytes_per_slot must be a positive integer, got {bytes_per_slot!r}")
    os.makedirs(directory, exist_ok=True)
    tag = "" if step is None else f"_step{int(step)}"
    units = dict(SUMMARY_UNITS, step="training iteration of the reduction this report plans on",
                 layer_numbers="the model's layer number of each MoE layer (from 1)")
    if bytes_per_slot is not None:
        units.update(BYTES_UNITS)
    doc = {"metadata": metadata("hybrid_ep.balancer", device_type="cpu", units=units,
                                config={k: summary[k] for k in SUMMARY_CONFIG_KEYS} | {"step": step}),
           **summary, "step": step}
    if bytes_per_slot is not None:
        doc["bytes_per_slot"] = int(bytes_per_slot)
        doc["moved_bytes"] = [int(m) * int(bytes_per_slot) for m in summary["moves"]]
        doc["moved_bytes_total"] = sum(doc["moved_bytes"])
    paths = {"summary": os.path.join(directory, f"balancer_summary{tag}.json")}
    with open(paths["summary"], "w") as f:
        json.dump(doc, f, indent=1)
    missing = plots_missing()
    if missing is not None:  # the JSON alone; the line once per process
        log_once(logging.getLogger(__name__), logging.WARNING, f"hybrid_ep balancer report: no PNG plots: {missing}")
        return paths
    paths["imbalance"] = write_imbalance_plot(summary, os.path.join(directory, f"imbalance{tag}.png"),
                                              bytes_per_slot=bytes_per_slot)
    hists = {"heatmap_after": history, "heatmap_before": history_before}
    present = [_as_array(h, np.float64, name) for name, h in hists.items() if h is not None]
    vmax = max((float(h.max()) for h in present if h.size), default=None)
    for name, hist in hists.items():
        if hist is not None:
            label = "after (new placement)" if name == "heatmap_after" else "before"
            paths[name] = write_heatmap(hist, os.path.join(directory, f"{name}{tag}.png"), layer_names,
                                        title=f"tokens per rank, {label}", vmax=vmax)
    return paths


def _as_array(x, dtype, name: str) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    try:
        return np.asarray(x, dtype=dtype)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name}: cannot convert to an array of {np.dtype(dtype).name} ({exc})") from exc


