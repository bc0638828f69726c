"""Figures. One function per figure; each writes a PNG and returns its path.

Figures are built with ``matplotlib.figure.Figure`` rather than ``pyplot``: no display is needed, and the user's
pyplot backend (a notebook's inline one, say) is left alone.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

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


def plot_needle_heatmap(lengths, depths, accuracy, path, title: str | None = None):
    """KNorm's needle-in-a-haystack heatmap: x context length, y needle depth, green found -> red missed.

    Args:
        lengths: the context lengths (tokens), the columns; depths: needle depths in [0, 1], the rows (0 = top).
        accuracy: ``accuracy[depth][length]`` in [0, 1], or None for a cell not run (drawn grey).
        path: the PNG to write; title: e.g. "NIAH, r=0.5 (kvpress protocol)".
    """
    from matplotlib.colors import LinearSegmentedColormap

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    values = np.array([[np.nan if a is None else float(a) for a in row] for row in accuracy], dtype=float)
    cmap = LinearSegmentedColormap.from_list(
        "missed_found", ["#d7301f", "#fdae61", "#ffffbf", "#a6d96a", "#1a9850"]
    ).with_extremes(bad="#bbbbbb")
    fig = Figure(figsize=(1.2 * len(lengths) + 2.5, 0.6 * len(depths) + 1.6))
    ax = fig.subplots()
    image = ax.imshow(np.ma.masked_invalid(values), cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto")
    for i in range(values.shape[0]):
        for j in range(values.shape[1]):
            text = "-" if np.isnan(values[i, j]) else f"{values[i, j]:.2f}"
            ax.text(j, i, text, ha="center", va="center", fontsize=9)
    ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{100 * d:.0f}%" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(title or "Needle in a haystack")
    fig.colorbar(image, ax=ax, label="accuracy (exact match)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path
