"""plot_norm_history: the per-layer norm curves of one or more runs, from their ``norms.jsonl`` files."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .history import history_path, read_norm_history
from ..recording.per_step import STATISTICS

_YLABELS = {
    "attn_fro": "||A||_F",
    "attn_fro_max": "max ||A||_F",
    "attn_fro_sqrtn": "||A||_F / sqrt(N)",
    "attn_fro_sqrtn_max": "max ||A||_F / sqrt(N)",
    "key_norm": "mean ||k||",
    "value_norm": "mean ||v||",
    "kv_ratio": "||k|| / ||v||",
}


def plot_norm_history(runs, path, statistic: str = "attn_fro", labels=None, x: str = "step",
                      title: str | None = None, colors=None, linestyles=None) -> Path:
    """Draw one panel per layer, one line per run, log y, from the runs' norm histories.

    Args:
        runs: run folders (holding ``norms.jsonl``) or history files, or one of them.
        path: the PNG to write.
        statistic: which statistic to draw (one of ``hf_knorm.recording.per_step.STATISTICS``).
        labels: one legend label per run (default: the run's normalization, with its folder name when two runs
            share one).
        x: ``"step"`` or ``"epoch"``.
        title: the figure title (default: names the statistic).
        colors, linestyles: one matplotlib colour and line style per run (defaults: :func:`hf_knorm.plots.plot_layer_curves`'s).

    Returns:
        The path written. A run whose statistic stops being finite ends with an ``x`` at its last finite value.

    Raises:
        FileNotFoundError: a run has no history; ValueError: an unknown statistic or x, or an empty history.
    """
    from ..plots import plot_layer_curves  # matplotlib loads when a figure is drawn, not when hf_knorm is imported

    if statistic not in STATISTICS:
        raise ValueError(f"Unknown statistic {statistic!r}; choose from {', '.join(STATISTICS)}.")
    if x not in ("step", "epoch"):
        raise ValueError(f"x must be 'step' or 'epoch', not {x!r}.")
    runs = [runs] if isinstance(runs, (str, os.PathLike)) else list(runs)
    histories = [read_norm_history(run) for run in runs]
    for run, history in zip(runs, histories):
        if not history:
            raise ValueError(f"The norm history {history_path(run)} has no logging step yet.")
    if labels is None:
        labels = [history[-1].get("normalization") or history_path(run).parent.name
                  for run, history in zip(runs, histories)]
        if len(set(labels)) < len(labels):
            labels = [f"{label} ({history_path(run).parent.name})" for label, run in zip(labels, runs)]
    curves = []
    for label, history in zip(labels, histories):
        steps = [record.get(x) if record.get(x) is not None else np.nan for record in history]
        values = np.array([[layer[statistic] for layer in record["layers"]] for record in history], dtype=float).T
        curves.append((label, steps, values))
    return plot_layer_curves(curves, path, ylabel=_YLABELS[statistic], xlabel=x,
                             title=title or f"{_YLABELS[statistic]} per layer during training", colors=colors,
                             linestyles=linestyles)
