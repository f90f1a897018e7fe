"""Plots where matplotlib is installed (the plots extra): without it, drawing one is refused by
name with the install line, and the tools that draw them still write their JSON and say why no
plot (matplotlib hidden from the import system here, as on an install without the extra)."""

from __future__ import annotations

import json
import logging
import sys

import numpy as np
import pytest

from hybrid_ep import figures

pytestmark = pytest.mark.unit


@pytest.fixture
def no_matplotlib(monkeypatch):
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib...` fails as when it is missing


def test_a_figure_is_an_agg_canvas_png(tmp_path):
    fig = figures.new_figure(figsize=(2, 1))
    fig.add_subplot(1, 1, 1).plot([0, 1], [1, 0])
    path = figures.save_png(fig, str(tmp_path / "f.png"), dpi=50)
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert type(fig.canvas).__name__ == "FigureCanvasAgg" and figures.plots_missing() is None


def test_without_matplotlib_a_figure_is_refused_with_the_extra_named(no_matplotlib):
    with pytest.raises(figures.PlotsUnavailable, match=r"needs matplotlib, the plots extra: pip install 'hybrid-ep\["):
        figures.new_figure()
    assert "pip install 'hybrid-ep[plots]'" in figures.plots_missing()


def test_without_matplotlib_the_balancer_report_writes_its_json_and_logs_why(no_matplotlib, tmp_path, caplog):
    from hybrid_ep.balancer.metrics import summarize
    from hybrid_ep.balancer.planner import plan_placement
    from hybrid_ep.balancer.report import write_report

    load = np.random.default_rng(3).random((4, 16)) * 100
    summary = summarize(load, None, plan_placement(load, 20, 2, 4))
    with caplog.at_level(logging.WARNING, logger="hybrid_ep.balancer.report"):
        paths = write_report(summary, str(tmp_path / "rep"), history=np.ones((3, 4, 4)), step=7)
    assert list(paths) == ["summary"] and json.load(open(paths["summary"]))["step"] == 7
    assert not list((tmp_path / "rep").glob("*.png"))
    assert "no PNG plots: drawing plots needs matplotlib" in caplog.text
