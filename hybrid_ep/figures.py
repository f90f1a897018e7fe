"""PNG figures on matplotlib's Agg canvas, never pyplot's global state. matplotlib is the `plots`
extra (`pip install 'hybrid-ep[plots]'`), imported here when a figure is made: the library and
its tools run without it, and only drawing a figure asks for it, by name."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matplotlib.figure import Figure

INSTALL = "pip install 'hybrid-ep[plots]'"


class PlotsUnavailable(ImportError):
    """matplotlib is not installed: the message says how to install it."""


def matplotlib_part(name: str) -> ModuleType:
    """matplotlib.<name> (figure, ticker, ...); PlotsUnavailable when matplotlib is missing."""
    try:
        return importlib.import_module(f"matplotlib.{name}")
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name.split(".")[0] != "matplotlib":
            raise
        raise PlotsUnavailable(f"drawing plots needs matplotlib, the plots extra: {INSTALL}") from exc


def plots_missing() -> str | None:
    """None where plots can be drawn; else the line saying why not and how to install it."""
    try:
        matplotlib_part("figure")
    except PlotsUnavailable as exc:
        return str(exc)
    return None


def new_figure(**kwargs) -> Figure:
    """A matplotlib Figure (kwargs: Figure's), on an Agg canvas."""
    fig = matplotlib_part("figure").Figure(**kwargs)
    matplotlib_part("backends.backend_agg").FigureCanvasAgg(fig)
    return fig


def save_png(fig: Figure, path: str, dpi: float = 100) -> str:
    """Write `fig` as a PNG at `path`; returns the path."""
    fig.savefig(path, dpi=dpi)
    return path
