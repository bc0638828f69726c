"""Figures. One function per figure; each writes a PNG and returns its path.

Figures are built with ``matplotlib.figure.Figure`` rather than ``pyplot``: no display is needed, and the user's
pyplot backend (a notebook's inline one, say) is left alone.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import NullLocator

# --- K/V balancing ------------------------------------------------------------------------------------------------


def plot_kv_norms(keys_before, values_before, keys_after, values_after, path, title: str | None = None):
    """TransMLA's Fig. 4a: per-channel key (blue) and value (orange) L2 norms, "Original kv-norm" over "Balanced kv-norm".

    Args:
        keys_before, values_before, keys_after, values_after: ``(C,)`` norms, ``C = H_kv * head_dim``.
        path: the PNG to write; title: an optional suptitle.
    """

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(10, 6))
    axes = fig.subplots(2, 1, sharex=True)
    for ax, keys, values, name in ((axes[0], keys_before, values_before, "Original kv-norm"),
                                   (axes[1], keys_after, values_after, "Balanced kv-norm")):
        keys, values = np.asarray(keys, dtype=float), np.asarray(values, dtype=float)
        channels = np.arange(len(keys))
        ax.bar(channels - 0.22, keys, width=0.45, color="tab:blue", label="Key")  # side by side: no colour mixing
        ax.bar(channels + 0.22, values, width=0.45, color="tab:orange", label="Value")
        ax.set_title(name)
        ax.set_ylabel("L2 norm")
        ax.set_xlim(-0.5, len(keys) - 0.5)
        ax.legend(loc="upper right")
    axes[1].set_xlabel("channel (KV heads side by side)")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def plot_kv_ratios(ratios_before, ratios_after, path, title: str | None = None):
    """Per layer, mean key-channel norm / mean value-channel norm, before and after balancing (log y)."""

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(8, 3.5))
    ax = fig.subplots()
    layers = np.arange(len(ratios_before))
    ax.plot(layers, np.asarray(ratios_before, dtype=float), "o-", color="tab:red", label="original")
    ax.plot(layers, np.asarray(ratios_after, dtype=float), "s-", color="tab:green", label="balanced")
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("mean ||K_c|| / mean ||V_c||")
    ax.set_title(title or "K/V mean-norm ratio per layer")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


# --- KNorm needle-in-a-haystack -----------------------------------------------------------------------------------


NEEDLE_COLORS = ["#d7301f", "#fdae61", "#ffffbf", "#a6d96a", "#1a9850"]  # missed (red) -> found (green)


def _draw_needle_panel(ax, lengths, depths, accuracy, fontsize: int = 9):
    """One needle heatmap on ``ax`` (x length, y depth, a cell's accuracy written in it); returns the image."""
    from matplotlib.colors import LinearSegmentedColormap

    values = np.array([[np.nan if a is None else float(a) for a in row] for row in accuracy], dtype=float)
    cmap = LinearSegmentedColormap.from_list("missed_found", NEEDLE_COLORS).with_extremes(bad="#bbbbbb")
    image = ax.imshow(np.ma.masked_invalid(values), cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto")
    for i in range(values.shape[0]):
        for j in range(values.shape[1]):
            text = "-" if np.isnan(values[i, j]) else f"{values[i, j]:.2f}"
            ax.text(j, i, text, ha="center", va="center", fontsize=fontsize)
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{100 * d:.0f}%" for d in depths])
    return image


def plot_needle_heatmap(lengths, depths, accuracy, path, title: str | None = None):
    """KNorm's needle-in-a-haystack heatmap: x context length, y needle depth, green found -> red missed.

    Args:
        lengths: the context lengths (tokens), the columns; depths: needle depths in [0, 1], the rows (0 = top).
        accuracy: ``accuracy[depth][length]`` in [0, 1], or None for a cell not run (drawn grey).
        path: the PNG to write; title: e.g. "NIAH, r=0.5 (kvpress protocol)".
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(max(5.5, 1.2 * len(lengths) + 2.5), 0.6 * len(depths) + 1.6))  # wide enough for the title
    ax = fig.subplots()
    image = _draw_needle_panel(ax, lengths, depths, accuracy)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(textwrap.fill(title or "Needle in a haystack", 60))  # a long variant's name on two lines
    fig.colorbar(image, ax=ax, label="accuracy (exact match)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def plot_needle_heatmap_grid(panels, path, title: str | None = None):
    """Needle heatmaps side by side: one row per entry of ``panels``, one column per entry of each row.

    Args:
        panels: ``{row label: {column label: (lengths, depths, accuracy)}}`` (``accuracy`` as in
            :func:`plot_needle_heatmap`); e.g. rows = eviction scores, columns = compression ratios.
        path: the PNG to write; title: the figure's title.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = list(dict.fromkeys(column for row in panels.values() for column in row))
    fig = Figure(figsize=(2.6 * len(columns) + 1.8, 2.0 * len(panels) + 1.0), layout="constrained")
    axes = np.atleast_2d(fig.subplots(len(panels), len(columns), squeeze=False))
    image = None
    for i, (row, cells) in enumerate(panels.items()):
        for j, column in enumerate(columns):
            ax = axes[i, j]
            if column not in cells:
                ax.set_axis_off()
                continue
            image = _draw_needle_panel(ax, *cells[column], fontsize=7)
            ax.tick_params(labelsize=7)
            if i == 0:
                ax.set_title(column, fontsize=10)
            if column == next(name for name in columns if name in cells):  # the row's first drawn panel
                ax.set_ylabel(f"{row}\ndepth", fontsize=9)
            if i == len(panels) - 1:
                ax.set_xlabel("context length (tokens)", fontsize=8)
    if title:
        fig.suptitle(title)
    if image is not None:
        fig.colorbar(image, ax=axes.ravel().tolist(), label="accuracy (exact match)", shrink=0.6)
    fig.savefig(path, dpi=110)
    return path


# --- Norms during training ----------------------------------------------------------------------------------------


LINE_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray",
               "tab:olive", "tab:cyan", "black", "gold")
"""Twelve distinguishable line colours: a figure of up to twelve runs (every family of the attention-norms job) has
no two lines of one colour."""
LEGEND_COLUMNS = 6
"""At most this many legend entries side by side below the panels; more runs take more legend rows."""


def plot_layer_curves(runs, path, ylabel: str = "||A||_F", xlabel: str = "step", title: str | None = None,
                      colors=None, linestyles=None):
    """The "attention norms across layers" figure: one panel per layer, one line per run, log y.

    Args:
        runs: a list of ``(label, x, values)``: ``x`` the ``(T,)`` steps or epochs of the run's logging steps, and
            ``values`` a ``(L, T)`` array, one row per layer (NaN/inf where the statistic was not finite). Where a
            layer's values stop being finite, the line ends with an ``x`` marker at its last finite value (at the
            panel's top when none was finite).
        path: the PNG to write; ylabel, xlabel, title: axis labels and the suptitle.
        colors: one matplotlib colour per run (default: :data:`LINE_COLORS`, cycled), e.g. the seed figure's softmax
            orange, x/1 yellow, x/16 green, x^3/1 blue, x^3/16 purple.
        linestyles: one matplotlib line style per run (default: all solid), e.g. solid for the paper's
            normalizations and dashed for the other families.

    Returns:
        The path written. Panels sit in rows of 4 (3 x 4 for 12 layers); the legend is below them, in rows of at most
        :data:`LEGEND_COLUMNS` entries (fewer where the panels are narrower).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    layers = max(np.asarray(values).shape[0] for _, _, values in runs)
    columns = min(4, layers)
    rows = -(-layers // columns)
    legend_columns = min(len(runs), LEGEND_COLUMNS, max(1, int(3.6 * columns // 2.2)))  # entries fit the width
    legend_rows = -(-len(runs) // legend_columns)
    fig = Figure(figsize=(3.6 * columns, 2.7 * rows + 0.6 + 0.25 * (legend_rows - 1)))
    axes = np.atleast_1d(fig.subplots(rows, columns, sharex=True, squeeze=False)).ravel()
    palette = list(colors or LINE_COLORS)
    styles = list(linestyles or ["-"])
    for number, (label, x, values) in enumerate(runs):
        x, values = np.asarray(x, dtype=float), np.asarray(values, dtype=float)
        color, style = palette[number % len(palette)], styles[number % len(styles)]
        for layer in range(values.shape[0]):
            ax, y = axes[layer], values[layer]
            finite = np.isfinite(y) & (y > 0)
            ax.plot(x[finite], y[finite], color=color, ls=style, lw=1.2, label=label if layer == 0 else None)
            broken = np.flatnonzero(~np.isfinite(y))
            if broken.size:
                before = np.flatnonzero(finite[: broken[0]])
                if before.size:
                    ax.plot([x[broken[0]]], [y[before[-1]]], "x", color=color, ms=8, mew=2)
                else:  # nothing finite to stand on: mark at the top edge
                    ax.plot([x[broken[0]]], [1.0], "x", color=color, ms=8, mew=2,
                            transform=ax.get_xaxis_transform(), clip_on=False)
    for layer, ax in enumerate(axes):
        if layer >= layers:
            ax.set_visible(False)
            continue
        ax.set_yscale("log")
        ax.yaxis.set_minor_locator(NullLocator())  # decades only: thirty panels of minor ticks took most of the drawing
        ax.set_title(f"Layer {layer + 1}", fontsize=10, y=1.0)  # y given: no search for ticks above the panel
        ax.grid(True, which="major", alpha=0.3)
        if layer % columns == 0:
            ax.set_ylabel(ylabel)
        if layer >= layers - columns:
            ax.set_xlabel(xlabel)
    fig.legend(loc="lower center", ncol=legend_columns, frameon=False, handlelength=3)
    width, height = fig.get_figwidth(), fig.get_figheight()
    if title:
        fig.suptitle(title, y=1 - 0.12 / height)  # its top 0.12 inch below the edge, whatever the figure's height
    # Fixed margins in inches (the panels' size is fixed): the legend rows and the x label below, the y tick labels
    # and label left, each panel's title above it. Not tight_layout: measuring every panel's ticks cost as much as
    # drawing the figure (two thirds of it with 30 layers).
    bottom = 0.45 + 0.25 * (legend_rows - 1) + 0.45
    top = 0.3 + (0.45 if title else 0.0)
    fig.subplots_adjust(left=0.75 / width, right=1 - 0.15 / width, bottom=bottom / height, top=1 - top / height,
                        wspace=0.75 / (3.6 - 0.75 * (columns - 1) / columns - 0.9 / columns),
                        hspace=0.45 / (2.7 - 0.45 * (rows - 1) / rows - (bottom + top - 0.6) / rows))
    fig.savefig(path, dpi=110)
    return path


# --- Held-out perplexity during conversion ------------------------------------------------------------------------


def plot_perplexity_curves(curves, path, references=None, title: str | None = None, matched: bool = False):
    """Held-out perplexity against training tokens, log y: one line per run or stage, reference lines across.

    Args:
        curves: ``{label: [(tokens, perplexity), ...]}``; stages of one run follow each other on the token axis
            when the caller offsets them (a conversion's recovery starts where its transfer ended).
        path: the PNG to write.
        references: ``{label: perplexity}`` drawn as dashed horizontal lines (e.g. the original softmax model).
        title: the figure title.
        matched: the i-th reference line takes the colour of the i-th curve (one reference per curve).

    Returns:
        The path written. Non-finite points are left out.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(7.0, 4.2))
    ax = fig.subplots()
    colors = []
    for label, points in curves.items():
        points = [(x, y) for x, y in points if np.isfinite(y) and y > 0]
        x, y = zip(*points) if points else ((), ())
        colors.append(ax.plot(x, y, marker="o", ms=3, lw=1.4, label=label)[0].get_color())
    for number, (label, value) in enumerate((references or {}).items()):
        color = colors[number] if matched and number < len(colors) else ["black", "gray", "tab:brown"][number % 3]
        ax.axhline(value, ls="--", lw=1.2, color=color, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("held-out perplexity")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


# --- Linear-time x/1 ----------------------------------------------------------------------------------------------


def plot_scaling(panels, path, xlabel: str, title: str | None = None):
    """Log-log curves, one panel per measured quantity: the attention layer's time against N, decoding's cache size
    and time per token against the context.

    Args:
        panels: a list of ``(panel title, y label, curves)``; ``curves`` a list of ``(label, x, y)``.
        path: the PNG to write; xlabel: the shared x label (log 2 scale); title: the suptitle.

    Returns:
        The path written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = Figure(figsize=(5 * len(panels), 4))
    axes = np.atleast_1d(fig.subplots(1, len(panels), squeeze=False)).ravel()
    for ax, (panel_title, ylabel, curves) in zip(axes, panels):
        for (label, x, y), marker in zip(curves, "o^sdv*"):
            ax.plot(x, y, marker=marker, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(panel_title, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
