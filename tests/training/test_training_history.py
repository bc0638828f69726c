"""norms.jsonl (non-finite values, truncation on resume, a half-written line) and plot_norm_history."""

from __future__ import annotations

import math

import pytest
from matplotlib.figure import Figure
from training_helpers import history_lines

import hf_knorm
from hf_knorm.training.history import NormHistory, read_norm_history


def _record(step, values, normalization="x^3/16"):
    return {"step": step, "epoch": step / 10, "loss": 1.0, "normalization": normalization,
            "layers": [{"attn_fro": v, "attn_fro_max": v, "attn_fro_sqrtn": v, "attn_fro_sqrtn_max": v,
                        "key_norm": 1.0, "value_norm": 1.0, "kv_ratio": 1.0} for v in values]}


def test_nonfinite_values_round_trip_as_strings(tmp_path):
    history = NormHistory(tmp_path / "norms.jsonl")
    history.append(_record(1, [1.5, math.nan, math.inf, -math.inf]))
    line = history_lines(tmp_path / "norms.jsonl")[0]  # strict JSON
    assert [layer["attn_fro"] for layer in line["layers"]] == [1.5, "nan", "inf", "-inf"]
    back = read_norm_history(tmp_path)[0]["layers"]
    assert back[0]["attn_fro"] == 1.5 and math.isnan(back[1]["attn_fro"])
    assert back[2]["attn_fro"] == math.inf and back[3]["attn_fro"] == -math.inf


def test_keep_until_drops_later_steps_and_a_half_written_line(tmp_path):
    path = tmp_path / "norms.jsonl"
    history = NormHistory(path)
    for step in (2, 4, 6):
        history.append(_record(step, [1.0]))
    with open(path, "a") as handle:
        handle.write('{"step": 8, "layers": [{"attn_f')  # killed mid-write
    assert [r["step"] for r in read_norm_history(path)] == [2, 4, 6]
    kept = history.keep_until(4)
    assert [r["step"] for r in kept] == [2, 4]
    assert [r["step"] for r in history_lines(path)] == [2, 4]
    assert not list(tmp_path.glob("*.partial"))
    history.keep_until(0)
    assert path.read_text() == ""


def test_a_broken_line_in_the_middle_is_an_error(tmp_path):
    path = tmp_path / "norms.jsonl"
    path.write_text('{"step": 1, "layers": []}\nnot json\n{"step": 2, "layers": []}\n')
    with pytest.raises(ValueError, match="norms.jsonl:2 is not a valid history line"):
        read_norm_history(path)
    with pytest.raises(FileNotFoundError, match="No norm history"):
        read_norm_history(tmp_path / "elsewhere")


def _drawn(monkeypatch):
    """Capture the figure plot_norm_history saves."""
    figures = []
    save = Figure.savefig

    def keep(self, *args, **kwargs):
        figures.append(self)
        return save(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    return figures


def test_plot_norm_history_one_panel_per_layer_one_line_per_run(tmp_path, monkeypatch):
    figures = _drawn(monkeypatch)
    for name, scale in (("softmax", 1.0), ("x3-16", 0.1)):
        history = NormHistory(tmp_path / name / "norms.jsonl")
        for step in range(1, 6):
            history.append(_record(step, [scale * step * (layer + 1) for layer in range(12)], name))
    path = hf_knorm.plot_norm_history([tmp_path / "softmax", tmp_path / "x3-16"], tmp_path / "fig.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    axes = [ax for ax in figures[0].axes if ax.get_visible()]
    assert len(axes) == 12
    assert all(ax.get_yscale() == "log" and len(ax.lines) == 2 for ax in axes)
    assert figures[0].axes[0].get_subplotspec().get_gridspec().get_geometry() == (3, 4)
    assert [t.get_text() for t in figures[0].legends[0].get_texts()] == ["softmax", "x3-16"]


def test_twelve_runs_have_twelve_distinct_styles_and_a_legend_in_rows(tmp_path, monkeypatch):
    from hf_knorm.plots import LEGEND_COLUMNS

    figures = _drawn(monkeypatch)
    runs = []
    for number in range(12):
        history = NormHistory(tmp_path / f"run{number}" / "norms.jsonl")
        for step in range(1, 4):
            history.append(_record(step, [step * (number + 1.0)] * 2, f"run{number}"))
        runs.append(tmp_path / f"run{number}")
    styles = ["-"] * 5 + ["--"] * 7
    hf_knorm.plot_norm_history(runs, tmp_path / "fig.png", linestyles=styles)
    lines = figures[0].axes[0].lines
    assert len({line.get_color() for line in lines}) == 12
    assert [line.get_linestyle() for line in lines] == styles
    legend = figures[0].legends[0]
    assert len(legend.get_texts()) == 12 and legend._ncols == 3  # two panels (7.2 inches) hold three entries a row
    renderer = figures[0]._get_renderer()  # the renderer savefig drew with
    assert legend.get_window_extent(renderer).width <= figures[0].bbox.width  # the legend is not cut at the edges
    wide = [(f"run {number}", [1, 2], [[1.0, 2.0]] * 4) for number in range(12)]  # four panels a row
    hf_knorm.plots.plot_layer_curves(wide, tmp_path / "wide.png")
    assert figures[1].legends[0]._ncols == LEGEND_COLUMNS


def test_the_figure_marks_where_a_run_went_nonfinite(tmp_path, monkeypatch):
    figures = _drawn(monkeypatch)
    history = NormHistory(tmp_path / "x-1" / "norms.jsonl")
    for step, value in ((1, 10.0), (2, 20.0), (3, math.nan), (4, math.nan)):
        history.append(_record(step, [value, 5.0], "x/1"))
    hf_knorm.plot_norm_history(tmp_path / "x-1", tmp_path / "fig.png")
    broken, fine = figures[0].axes[:2]
    markers = [line for line in broken.lines if line.get_marker() == "x"]
    assert len(markers) == 1 and list(markers[0].get_xdata()) == [3.0] and list(markers[0].get_ydata()) == [20.0]
    assert not [line for line in fine.lines if line.get_marker() == "x"]
    with pytest.raises(ValueError, match="Unknown statistic"):
        hf_knorm.plot_norm_history(tmp_path / "x-1", tmp_path / "fig.png", statistic="nope")
